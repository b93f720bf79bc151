"""Offline generation: ``LLM(...).generate(prompts, SamplingParams(...))``.

It drives the same ``Scheduler`` (continuous batching, chunked prefill, paged KV) that the
engine process runs, in this process and without HTTP.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from engine import device as dev
from engine.args import ServerArgs
from engine.sampling.params import SamplingParams
from engine.sampling.stops import compile_patterns, first_match
from engine.scheduler.request import Req
from engine.tokenizer.score_prompts import score_prompt_ids
from engine.validation import RequestError, images_for, pooling_mismatch, validate_request


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
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, else
    # (logprob, [[id, logprob], ...top-k], rank of the prompt token in the vocabulary)
    prompt_logprobs: list | None = None
    # prompt tokens whose KV came from the prefix cache (None: the cache is disabled)
    num_cached_tokens: int | None = None


def final_text(tokenizer, token_ids: list[int], matched, skip_special_tokens: bool = True,
               stop_regex: list[str] = ()) -> str:
    """The text of a finished output: without a matched stop token, cut before a stop string
    (or before the first match of the ``stop_regex`` pattern ``matched``)."""
    ids = token_ids[:-1] if isinstance(matched, int) and token_ids else token_ids
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if isinstance(matched, str):
        if matched in stop_regex:
            cut, _ = first_match(compile_patterns([matched]), text, 0, partial=False)
        else:
            cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


class LLM:
    """An in-process engine.

    Args: any ``ServerArgs`` field as a keyword (model_path=None is the embedded SmolLM2).
    Raises: ValueError for unknown fields, out-of-range values (checked by ``ServerArgs``,
    naming the flag) or unsupported models.
    """

    def __init__(self, model_path: str | None = None, **kwargs):
        from engine.scheduler.build import build_engine

        names = {f.name for f in dataclasses.fields(ServerArgs)}
        bad = set(kwargs) - names
        if bad:
            raise ValueError(f"unknown LLM argument(s): {', '.join(sorted(bad))}")
        self.args = ServerArgs(model_path=model_path, **kwargs)  # ValueError: a bad bound
        engine = build_engine(self.args)
        self.runner, self.tokenizer = engine.runner, engine.tokenizer
        self.scheduler, self.vocab_size = engine.scheduler, engine.vocab_size
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (``tp_size > 1``), leave the process group and
        give the device memory back (weights, KV pool, graphs: a second ``LLM`` in the same
        process sizes its KV pool from free memory); the object cannot generate afterwards
        (``RuntimeError``). Idempotent."""
        runner = self.__dict__.get("runner")
        if runner is None:
            return
        runner.shutdown()
        device_type = runner.device_type
        del self.runner, self.scheduler, runner
        dev.release_memory(device_type)

    def __getattr__(self, name: str):
        # only reached for attributes __init__ never set or shutdown() dropped
        if name in ("runner", "scheduler"):
            raise RuntimeError("this LLM was shut down; build a new one to generate")
        raise AttributeError(name)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _lora_id(self, name: str | None) -> int | None:
        if name is None:
            return None
        if not isinstance(name, str):
            raise RequestError(f"lora must be an adapter's name (a string), a list of them "
                               f"(one per prompt) or None, got {type(name).__name__}", "lora")
        if self.runner.lora is None:
            raise RequestError(f"LoRA adapter {name!r}: this engine serves no adapters "
                               "(lora_paths or enable_lora)", "lora")
        try:
            return self.runner.lora.resolve(name)
        except ValueError as e:
            raise RequestError(str(e), "lora") from None

    def load_lora(self, name: str, path: str) -> None:
        """Load a peft LoRA adapter under ``name`` (``enable_lora`` or ``lora_paths``).

        Raises:
            ValueError: (``engine.lora.adapter.LoRAError``) a bad adapter or a taken name.
        """
        if self.runner.lora is None:
            raise ValueError("this engine serves no LoRA adapters: pass enable_lora=True")
        self.runner.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name`` (requests running on it finish on it)."""
        if self.runner.lora is None:
            raise ValueError("this engine serves no LoRA adapters")
        self.runner.lora.unload(name)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora: str | list[str | None] | None = None,
                 images: list | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids), in input order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one ``SamplingParams`` for all prompts, or one per prompt
                (default: ``SamplingParams()``). A ``max_tokens`` beyond the context left by
                the prompt is cut to it.
            use_tqdm: show a progress bar.
            lora: the LoRA adapter (a name of ``lora_paths`` or :meth:`load_lora`) for all
                prompts, or one per prompt (None: the base model).
            images: per prompt, its images (a list of ``engine.io_struct.ImageData``, as
                ``server.media.process.process_images`` makes them, whose spans are the
                prompt's image tokens; None or [] for a text prompt), or None for none.
        Raises:
            ValueError: (``engine.validation.RequestError``, with ``param`` and ``code``)
                before anything runs, for an unknown LoRA adapter, a ``lora`` of another
                type, a ``lora`` or ``sampling_params`` list whose length is not the number
                of prompts, an empty prompt, a token id outside the vocabulary, a prompt that
                leaves no room for one token in the context (``context_length_exceeded``),
                out-of-range sampling settings, or a text prompt without a tokenizer.
        """
        if error := pooling_mismatch(self.runner.pooling, False):
            raise RequestError(error, "prompt")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else (
            [sampling_params or SamplingParams()] * len(prompts))
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        imgs = images if images is not None else [None] * len(prompts)
        for what, given in (("sampling_params", sps), ("lora", loras), ("images", imgs)):
            if len(given) != len(prompts):  # zip would drop prompts or ignore entries
                raise RequestError(f"{what} has {len(given)} entries for {len(prompts)} "
                                   "prompts: give one per prompt (or a single value)", what)
        reqs = []
        for p, sp, name, im in zip(prompts, sps, loras, imgs):  # all checked before running
            if isinstance(p, str) and self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; send token ids as the "
                                   "prompt", "prompt")
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            # a max_tokens beyond the room the prompt leaves is cut to it (finish "length")
            max_new = validate_request(ids, sp, self.vocab_size, self.runner.max_context_len,
                                       clamp_max_tokens=True)
            req = Req(f"offline-{next(self._ids)}", ids, sp, False, max_new,
                      lora_id=self._lora_id(name))
            if im:
                req.set_images(images_for(self.runner.model, im, len(ids)))
            reqs.append(req)
        for req in reqs:
            self.scheduler.add_request(req)
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
                                  r.sampling_params.skip_special_tokens,
                                  r.sampling_params.stop_regex)
            results.append(RequestOutput(
                r.origin_input_ids, list(r.output_ids), text, fr.type, fr.matched,
                r.logprobs if r.sampling_params.logprobs is not None else None,
                r.prompt_logprobs,
                r.cached_tokens if self.scheduler.kv.enabled else None))
        return results

    # ---- pooling models (embeddings, scores) ---------------------------------------------
    def embed(self, prompts) -> list[list[float]]:
        """The embedding of each prompt (a string or a list of token ids), in input order.

        Returns:
            per prompt, float32 values as floats (``[hidden]``; L2-normalised when the model
            says so: see ``engine/layers/pooler.py``).
        Raises:
            ValueError: (``RequestError``) a generation or scoring model, an empty prompt,
                a token id outside the vocabulary, a prompt beyond the context.
        """
        if self._task() != "embed":
            raise RequestError("this engine serves no embedding model (serve one, or pass "
                               "is_embedding=True)", "input")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._pool([self._ids_of(p) for p in prompts])

    def score(self, text_1: str | list[str], text_2: str | list[str],
              instruction: str | None = None) -> list[float]:
        """Relevance scores of pairs (vLLM's ``/v1/score``): one ``text_1`` against each
        ``text_2``, or the two lists pairwise.

        A cross-encoder's score is ``sigmoid(logit)`` of its one label; a yes/no reranker's
        P(yes) over its prompt (``engine/tokenizer/score_prompts.py``, with ``instruction``).

        Raises:
            ValueError: (``RequestError``) not a scoring model, lists of unequal lengths,
                no tokenizer, a pair beyond the context.
        """
        task = self._task()
        if task not in ("classify", "yes_no"):
            raise RequestError("this engine serves no scoring model (a "
                               "*ForSequenceClassification cross-encoder, or a causal LM with "
                               "yes_no_reranker=True)", "text_1")
        if self.tokenizer is None:
            raise RequestError("scoring text needs the model's tokenizer", "text_1")
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise RequestError(f"text_1 has {len(firsts)} entries and text_2 {len(seconds)}: "
                               "give one text_1, or as many as text_2", "text_1")
        ids = [score_prompt_ids(self.tokenizer, task, a, b, instruction)
               for a, b in zip(firsts, seconds)]
        return [a[0] for a in self._pool(ids)]

    def _task(self) -> str | None:
        """The pooling task (``embed``, ``classify``, ``yes_no``; None: generation)."""
        return None if self.runner.pooling is None else self.runner.pooling.task

    def _ids_of(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; send token ids", "input")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _pool(self, prompts: list[list[int]]) -> list[list[float]]:
        """Run pooling requests (prefill only) and return their answers in order."""
        reqs = []
        for ids in prompts:  # check all before the scheduler sees any
            validate_request(ids, _POOL_PARAMS, self.vocab_size, self.runner.max_context_len)
            req = Req(f"offline-{next(self._ids)}", ids, _POOL_PARAMS, False, 1)
            req.pooling = True
            reqs.append(req)
        for req in reqs:
            self.scheduler.add_request(req)
        answers: dict[str, list[float]] = {}
        while len(answers) < len(reqs):
            for o in self.scheduler.step():
                if o.finished_reason is not None:
                    if o.pooled is None:
                        raise RuntimeError(f"pooling request failed: {o.finished_reason}")
                    answers[o.req.rid] = o.pooled
        return [answers[r.rid] for r in reqs]


#: a pooling request's sampling settings: its one "token" is the answer
_POOL_PARAMS = SamplingParams(max_tokens=1)
