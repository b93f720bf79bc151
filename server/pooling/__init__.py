"""The pooling endpoints: ``/v1/embeddings`` (OpenAI's shape) for an embedding model, and
``/v1/rerank`` and ``/rerank`` (Cohere's and Jina's shape) and ``/v1/score`` (vLLM's) for a
scoring model (a cross-encoder or a yes/no reranker); see ``engine/layers/pooler.py`` for
what the engine computes."""
