"""The KV cache: the two-level paged pool (``pool.py``), the radix prefix cache
(``radix_cache.py``) and the manager that moves pages between them and requests
(``manager.py``)."""
