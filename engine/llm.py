"""Offline generation: ``LLM(...).generate(prompts, SamplingParams(...))``.

It drives the same ``Scheduler`` (continuous batching, chunked prefill, paged KV) that the
engine process runs, in this process and without HTTP.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from engine.args import ServerArgs
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req


@dataclass
class RequestOutput:
    """The result of one prompt: ``text``, ``token_ids`` (generated) and ``finish_reason``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    matched_stop: str | int | None = None
    # with SamplingParams.logprobs: per generated token (logprob, [[id, logprob], ...top-k])
    logprobs: list | None = None
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first
    prompt_logprobs: list | None = None


def final_text(tokenizer, token_ids: list[int], matched, skip_special_tokens: bool = True) -> str:
    """The text of a finished output: without a matched stop token, cut before a stop string."""
    ids = token_ids[:-1] if isinstance(matched, int) and token_ids else token_ids
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


class LLM:
    """An in-process engine.

    Args: any ``ServerArgs`` field as a keyword (model_path=None is the embedded SmolLM2).
    Raises: ValueError for unknown fields or unsupported models.
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        from engine.executor.model_runner import ModelRunner, text_config
        from engine.scheduler.scheduler import Scheduler
        from engine.tokenizer.tokenizer import eos_token_ids, load_tokenizer

        names = {f.name for f in dataclasses.fields(ServerArgs)}
        bad = set(kwargs) - names
        if bad:
            raise ValueError(f"unknown LLM argument(s): {', '.join(sorted(bad))}")
        self.args = ServerArgs(model_path=model_path, **kwargs)
        self.runner = ModelRunner(self.args)
        try:
            self.tokenizer = load_tokenizer(self.args.tokenizer_path or model_path)
        except Exception:
            if self.args.load_format != "dummy":
                raise
            self.tokenizer = None
        self.vocab_size = text_config(self.runner.config).vocab_size
        self.scheduler = Scheduler(self.args, self.runner, self.tokenizer,
                                   eos_token_ids(self.runner.config, self.tokenizer))
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids), in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else (
            [sampling_params or SamplingParams()] * len(prompts))
        reqs = []
        for p, sp in zip(prompts, sps):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            sp.verify(self.vocab_size)
            if not ids:
                raise ValueError("empty prompt")
            room = self.runner.max_context_len - len(ids)
            if room < 1:
                raise ValueError(f"prompt of {len(ids)} tokens exceeds the context "
                                 f"({self.runner.max_context_len})")
            max_new = min(sp.max_tokens or room, room)
            req = Req(f"offline-{next(self._ids)}", ids, sp, False, max_new)
            self.scheduler.add_request(req)
            reqs.append(req)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate")
        while any(not r.finished for r in reqs):
            outs = self.scheduler.step()
            if bar is not None:
                bar.update(sum(1 for o in outs if o.finished_reason is not None))
        if bar is not None:
            bar.close()
        results = []
        for r in reqs:
            fr = r.finished_reason
            text = None
            if self.tokenizer is not None:
                text = final_text(self.tokenizer, r.output_ids, fr.matched,
                                  r.sampling_params.skip_special_tokens)
            results.append(RequestOutput(
                r.origin_input_ids, list(r.output_ids), text, fr.type, fr.matched,
                r.logprobs if r.sampling_params.logprobs is not None else None,
                r.prompt_logprobs))
        return results
