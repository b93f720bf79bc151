"""Stage 2 of the request path, the engine process: the request queue, continuous batching
with chunked prefill (``scheduler.py``; the host-side batch it builds is
``engine/executor/schedule_batch.py``), an extend step's admission (``admission.py``), the
prefix-cache policy (``prefix_policy.py``), constrained requests waiting for their grammar
(``grammar_queue.py``), the step's results (``output.py``), ``Req`` (``request.py``), the
process loop (``engine_loop.py``) and the one function that builds an engine from
``ServerArgs`` (``build.py``)."""
