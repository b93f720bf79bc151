"""ferry's engine: scheduler, KV cache, model runner, sampler."""

from engine.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    # LLM pulls in torch and the model code; import it only when asked for
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
