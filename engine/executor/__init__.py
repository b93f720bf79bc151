"""Stage 3: running a step on the device: ``ModelRunner`` (model, KV pools, forward, sampling),
``ForwardBatch`` (the step's device tensors), and the decode and piecewise graph runners."""
