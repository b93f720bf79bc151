"""Sampling: ``SamplingParams`` (``params.py``, what a request asks for) and the batched device
sampler (``sampler.py``: penalties, logit bias, top-k/top-p/min-p, seeds, logprobs)."""
