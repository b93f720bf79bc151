"""A pooling engine's step result: each request's chunk of hidden states folded into its
``PoolState``, and the answers of the requests whose prompt is complete
(``engine/layers/pooler.py`` holds the pooling itself)."""

from __future__ import annotations

import torch

from engine.executor.schedule_batch import ScheduleBatch


@torch.inference_mode()
def pool_step(model, batch: ScheduleBatch, logits: torch.Tensor) -> list[tuple[object, list]]:
    """Fold an EXTEND step into its requests' pooling states (``req.pool_state``).

    Args:
        model: the model, with ``pooler`` and its ``hidden_out`` of this step's eager
            forward (``[T, hidden]``, the step's tokens in batch order).
        batch: the step; ``batch.sample[i]``: request i's prompt ends in this step.
        logits: ``[batch_size, vocab]`` float32, each request's last-token logits.
    Returns:
        ``(req, answer)`` for every request whose prompt ended here, ``answer`` a list of
        float (an embedding, or one score).
    """
    pooler, hidden = model.pooler, model.hidden_out
    done: list[int] = []
    off = 0
    for i, (req, p, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        req.pool_state = pooler.update(req.pool_state, hidden[off:off + n], first=p == 0)
        off += n
        if batch.sample[i]:
            done.append(i)
    if not done:
        return []
    last = logits[done] if pooler.spec.task == "yes_no" else None
    answers = pooler.finish([batch.reqs[i].pool_state for i in done], last).tolist()
    return [(batch.reqs[i], a) for i, a in zip(done, answers)]
