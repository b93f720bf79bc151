"""Stage 2 of the request path, the engine process: the request queue, continuous batching
with chunked prefill (``scheduler.py``), the step's results (``output.py``), the host-side
batch (``schedule_batch.py``), ``Req`` (``request.py``), the process loop (``engine_loop.py``) and
the one function that builds an engine from ``ServerArgs`` (``build.py``)."""
