"""Stage 3: running a step on the device: ``ModelRunner`` (rank 0's runner) over
``RankRunner`` (model, KV pools, forward, sampling), the step's host-side batch
(``ScheduleBatch``) and its builder into device tensors (``forward_batch_builder.py``, which
the EAGLE head calls too, over its own pools), the decode and piecewise graph runners, and
the tensor-parallel workers (``tp_worker.py``) with their step messages
(``tp_messages.py``). The step's device tensors (``ForwardBatch``) are
``engine/forward_batch.py``, below the models that read them."""
