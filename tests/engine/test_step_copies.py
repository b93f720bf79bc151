"""The step path's host-to-device copies stay non-blocking (issue 41, item 6f).

A blocking copy (``.to(device)`` without ``non_blocking``, ``torch.tensor(..., device=d)``,
``dst.copy_(host)``) waits for the device's in-flight step (on XPU an in-order queue's
``memcpy().wait()``), so the host cannot prepare step N+1 while step N runs and the overlap
scheduler gains nothing. On the CPU the copies are no-ops, so the test records the calls
instead: it runs real steps of a CPU engine (prefill, decode, sampling with penalties, through
the public ``LLM.generate`` -> ``RankRunner.forward``/``sample``) with ``torch.Tensor.to``,
``torch.Tensor.copy_``, ``torch.tensor`` and ``torch.as_tensor`` wrapped, and asserts that:

- the step's host arrays go through ``engine.device.host_to_device`` (the pinned,
  non-blocking copy on an accelerator);
- nothing else moves host data to a device without ``non_blocking=True``;
- ``host_to_device`` itself, on an accelerator (here the ``meta`` device, with pinning
  stubbed), copies with ``non_blocking=True``.

It calls no private step function by name (``build_forward_batch`` is being moved).
"""

from __future__ import annotations

import pytest
import torch

from engine import device as dev
from engine.loader.loader import config_dir

KW = dict(model_path=config_dir("llama-tiny"), load_format="dummy", device="cpu",
          dtype="float32", max_total_tokens=2048, chunked_prefill_size=64,
          max_running_requests=8)


class _Recorder:
    """Wraps the copy entry points of torch; ``blocking`` lists the host-to-device copies
    made without ``non_blocking=True``, ``helper`` counts ``dev.host_to_device`` calls."""

    def __init__(self, monkeypatch):
        self.blocking: list[str] = []
        self.helper = 0
        self.on = False
        self.host: list[torch.Tensor] = []  # tensors made from Python data (kept alive)
        self.host_ids: set[int] = set()
        to, copy_, tensor, as_tensor = (torch.Tensor.to, torch.Tensor.copy_, torch.tensor,
                                        torch.as_tensor)
        h2d = dev.host_to_device
        rec = self

        def _target(args, kw):
            t = kw.get("device")
            if t is None and args:
                a = args[0]
                if isinstance(a, (torch.device, str)):
                    t = a
                elif isinstance(a, torch.Tensor):
                    t = a.device
            return t

        def to_(self, *args, **kw):
            if rec.on and _target(args, kw) is not None and self.device.type == "cpu" \
                    and not kw.get("non_blocking", len(args) > 1 and args[1] is True):
                rec.blocking.append(f"Tensor.to{args!r}{kw!r}")
            return to(self, *args, **kw)

        def copy(self, src, non_blocking=False):
            if rec.on and not non_blocking and rec.is_host(src):
                rec.blocking.append("Tensor.copy_ from a host tensor")
            return copy_(self, src, non_blocking)

        def make(fn):
            def wrapped(*args, **kw):
                if rec.on and kw.get("device") is not None:
                    rec.blocking.append(f"{fn.__name__}(..., device={kw['device']!r})")
                out = fn(*args, **kw)
                if rec.on and kw.get("device") is None and isinstance(out, torch.Tensor):
                    rec.host.append(out)
                    rec.host_ids.add(id(out))
                return out
            return wrapped

        def helper(host, device):
            rec.helper += rec.on
            return h2d(host, device)

        monkeypatch.setattr(torch.Tensor, "to", to_)
        monkeypatch.setattr(torch.Tensor, "copy_", copy)
        monkeypatch.setattr(torch, "tensor", make(tensor))
        monkeypatch.setattr(torch, "as_tensor", make(as_tensor))
        monkeypatch.setattr(dev, "host_to_device", helper)

    def is_host(self, t: torch.Tensor) -> bool:
        """``t`` or the tensor it views was made from Python data on the host."""
        return id(t) in self.host_ids or (t._base is not None and id(t._base) in self.host_ids)


def test_step_copies_to_the_device_are_non_blocking(monkeypatch):
    from engine import LLM, SamplingParams

    with LLM(**KW) as llm:
        rec = _Recorder(monkeypatch)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, llm.vocab_size, (n,), generator=g).tolist()
                   for n in (3, 40, 9)]
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                 ignore_eos=True, repetition_penalty=1.1,
                                 frequency_penalty=0.2, presence_penalty=0.1,
                                 logit_bias={5: 2.0}),
                  SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05, ignore_eos=True)]
        rec.on = True
        outs = llm.generate(prompts, params)
        rec.on = False
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    # prefill and decode steps: two copies each (int64 and int32 arrays), at least
    assert rec.helper >= 2 * 2, rec.helper
    assert rec.blocking == [], rec.blocking[:10]


def test_host_to_device_on_an_accelerator_is_non_blocking(monkeypatch):
    calls = []
    to = torch.Tensor.to

    def to_(self, *args, **kw):
        calls.append((args, kw))
        return to(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "to", to_)
    out = dev.host_to_device(torch.arange(4), torch.device("meta"))
    assert out.device.type == "meta"
    assert calls == [((torch.device("meta"),), {"non_blocking": True})]


@pytest.mark.parametrize("blocking", [
    lambda t: t.to(torch.device("cpu")),
    lambda t: t.to("cpu", torch.int32),
    lambda t: torch.tensor([1, 2], device=t.device),
    lambda t: torch.empty(2, dtype=t.dtype).copy_(torch.tensor([1, 2])),
])
def test_the_recorder_sees_blocking_copies(blocking, monkeypatch):
    """The recorder is not blind: each of these would be a blocking host-to-device copy."""
    rec = _Recorder(monkeypatch)
    rec.on = True
    blocking(torch.zeros(2, dtype=torch.int64))
    rec.on = False
    assert len(rec.blocking) == 1, rec.blocking
