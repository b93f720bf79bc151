"""A serving step through the captured graphs, with the eager step as the fallback.

``replay_graphs(runner, batch, future_ids)`` replays the decode graph (``runner
.graph_runner``) or the piecewise graphs (``runner.piecewise_runner``) that fit ``batch``
and returns the logits, or None when none fits and the runner steps eagerly (always for
a step with an image request: the graphs take neither M-RoPE positions nor image
embeddings). A hybrid model's speculative verify step (``verify_n``) replays a verify graph
(``GraphRunner.can_verify``), or runs eagerly where none fits. A replay that
raises (a driver or graph-runtime error, seen on XPU's SYCL graphs) is logged once through
``engine.device.replay_or_none``, that kind of graph is dropped from the runner, and the
step (and every later one of that kind) runs eagerly; it used to stop the engine. Under
tensor parallelism the error is raised as before: one rank cannot fall back alone.
"""

from __future__ import annotations

import torch

from engine import device as dev
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode


def replay_graphs(runner, batch: ScheduleBatch, future_ids: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
    """The float32 logits ``[batch_size, vocab]`` of ``batch`` from a graph replay, or None
    when the step is to run eagerly (no graph fits it, or its replay raised: module
    docstring).

    Raises:
        whatever the replay raises, under tensor parallelism only.
    """
    gr, pw = runner.graph_runner, runner.piecewise_runner
    if any(getattr(r, "mm", None) is not None for r in batch.reqs):
        return None  # image requests: M-RoPE positions and vision embeddings, eager steps
    if batch.verify_n:  # a hybrid model's verify step: its own graphs
        fits = gr is not None and gr.can_verify(batch)
    else:
        fits = batch.mode == ForwardMode.DECODE and gr is not None and \
            gr.can_run(batch.batch_size)
    if fits:
        what, attr = "decode graphs", "graph_runner"

        def replay():
            return gr.replay(batch, future_ids)
    elif batch.mode == ForwardMode.EXTEND and pw is not None and pw.can_run(batch.num_tokens):
        what, attr = "piecewise graphs", "piecewise_runner"

        def replay():
            return pw.run(batch, future_ids)
    else:
        return None
    if runner.tp.size > 1:
        return replay()
    logits = dev.replay_or_none(runner.device_type, what, replay)
    if logits is None:
        setattr(runner, attr, None)
    return logits
