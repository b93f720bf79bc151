"""Pooling checkpoints: which ``PoolingSpec`` a model is served with, and how its weights
load onto the causal class of its family.

A pooling model is detected from its checkpoint or asked for by a flag:

- ``*ForSequenceClassification`` (a cross-encoder): ``classify``, the ``score`` head
  ``[num_labels, hidden]`` over the last token (one label: a relevance score);
- ``*Model`` (a bare encoder stack, e.g. what ``Qwen3Model.save_pretrained`` writes), a
  sentence-transformers ``modules.json``, or ``--is-embedding``: ``embed``, pooled as
  ``1_Pooling/config.json`` says (``lasttoken``, ``mean_tokens``, ``cls_token``) and
  L2-normalised when ``modules.json`` lists a ``Normalize`` module; without those files, a
  decoder embedder's default: last token, normalised (Qwen3-Embedding, whose config says
  ``Qwen3ForCausalLM``);
- ``--yes-no-reranker``: ``yes_no`` on a causal LM (Qwen3-Reranker).

The weights load onto the family's ``*ForCausalLM`` (its decoder stack is the same):
un-prefixed names (a ``*Model`` checkpoint) get ``model.``, ``score.weight`` goes to the
pooler, and an absent LM head is zeroed (an embedder never reads it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator

import torch

from engine.layers.pooler import Pooler, PoolingSpec
from engine.models import MODEL_REGISTRY

logger = logging.getLogger(__name__)

_SUFFIXES = ("ForSequenceClassification", "Model")


def pooling_architecture(config) -> str | None:
    """The checkpoint's architecture when it is a pooling one (``*ForSequenceClassification``
    or ``*Model``), else None."""
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else ""
    return arch if arch.endswith(_SUFFIXES) and not arch.endswith("ForCausalLM") else None


def as_causal(config):
    """``config`` with a pooling architecture renamed to its family's ``*ForCausalLM`` (the
    class ferry builds), in place, when ferry serves that family; other configs are returned
    as they are (an unsupported one is then refused under its own name)."""
    arch = pooling_architecture(config)
    if arch is not None:
        suffix = next(s for s in _SUFFIXES if arch.endswith(s))
        causal = arch[: -len(suffix)] + "ForCausalLM"
        if causal in MODEL_REGISTRY:
            config.architectures = [causal]
    return config


def _read_json(path: str) -> dict | list | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _sentence_transformers(root: str) -> tuple[str, bool] | None:
    """``(pooling, normalize)`` from a sentence-transformers directory, or None."""
    modules = _read_json(os.path.join(root, "modules.json"))
    if not isinstance(modules, list):
        return None
    pooling, normalize = "last", False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            cfg = _read_json(os.path.join(root, m.get("path", "1_Pooling"), "config.json")) or {}
            if cfg.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            elif cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif cfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            else:
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
                raise ValueError(f"{root}: sentence-transformers pooling {modes} is not "
                                 "supported (ferry pools lasttoken, mean_tokens or cls_token)")
        elif kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize


def resolve_pooling(config, root: str | None, tokenizer_path: str | None, *,
                    is_embedding: bool = False, yes_no_reranker: bool = False,
                    enable_matryoshka: bool = False) -> PoolingSpec | None:
    """The ``PoolingSpec`` a model is served with, or None for a generation model.

    Args:
        config: the checkpoint's HF config (before :func:`as_causal`).
        root: the directory of its files (None: the embedded model).
        tokenizer_path: where the ``yes``/``no`` tokens are looked up (``yes_no``).
        is_embedding, yes_no_reranker, enable_matryoshka: the flags of the same names.
    Raises:
        ValueError: a cross-encoder with other than one label, ``--yes-no-reranker`` on a
            checkpoint that is not a causal LM or without ``yes``/``no`` tokens, an
            unsupported sentence-transformers pooling.
    """
    arch = pooling_architecture(config) or ""
    st = _sentence_transformers(root) if root and os.path.isdir(root) else None
    dims = tuple(getattr(config, "matryoshka_dimensions", None) or ())
    matryoshka = bool(enable_matryoshka or getattr(config, "is_matryoshka", False) or dims)
    if yes_no_reranker:
        if arch:
            raise ValueError(f"--yes-no-reranker reads the LM head of a causal LM; this "
                             f"checkpoint is a {arch}")
        return PoolingSpec("yes_no", yes_no_ids=_yes_no_ids(tokenizer_path or root))
    if arch.endswith("ForSequenceClassification"):
        labels = int(getattr(config, "num_labels", 1) or 1)
        if labels != 1:
            raise ValueError(f"{arch} with {labels} labels: ferry serves cross-encoders of "
                             "one label (a relevance score for /v1/rerank and /v1/score)")
        return PoolingSpec("classify", num_labels=labels)
    if is_embedding or arch or st is not None:
        pooling, normalize = st if st is not None else ("last", True)
        return PoolingSpec("embed", pooling=pooling, normalize=normalize,
                           matryoshka=matryoshka, matryoshka_dims=dims)
    return None


def _yes_no_ids(path: str | None) -> tuple[int, int]:
    from transformers import AutoTokenizer

    if path is None:
        raise ValueError("--yes-no-reranker needs the model's tokenizer (its yes/no tokens)")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.convert_tokens_to_ids(["no", "yes"])
    if any(i is None or i == tok.unk_token_id for i in ids):
        raise ValueError("--yes-no-reranker: the tokenizer has no single 'yes'/'no' tokens")
    return int(ids[0]), int(ids[1])


def attach_pooler(model, spec: PoolingSpec, dtype: torch.dtype) -> None:
    """Give ``model`` its ``pooler`` (under the device context the model was built in)."""
    model.pooler = Pooler(spec, model.model_config.hidden_size, dtype)


def route_weights(model, weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with ``model.`` added where a ``*Model`` checkpoint leaves it
    out; ``score.weight`` is copied into ``model.pooler`` instead of yielded."""
    score = getattr(getattr(model, "pooler", None), "score", None)
    for name, tensor in weights:
        if name == "score.weight" and score is not None:
            if tuple(tensor.shape) != tuple(score.shape):
                raise ValueError(f"score.weight: shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(score.shape)}")
            score.data.copy_(tensor.to(score.dtype))
            model.pooler.loaded = True
            continue
        if not name.startswith(("model.", "lm_head.", "score.")):
            name = f"model.{name}"  # embed_tokens, layers.*, norm of a *Model checkpoint
        yield name, tensor


def settle_missing(model, missing: list[str]) -> list[str]:
    """Of the weights a pooling checkpoint lacks, zero the LM head of an embedder or
    cross-encoder (never read) and return the rest; a ``classify`` model without its
    ``score.weight`` is added to them."""
    spec: PoolingSpec = model.pooler.spec
    if spec.task != "yes_no" and "lm_head.weight" in missing:
        model.lm_head.weight.data.zero_()
        missing = [m for m in missing if m != "lm_head.weight"]
    if spec.task == "classify" and not getattr(model.pooler, "loaded", False):
        missing = [*missing, "score.weight"]
    return missing


def init_dummy_head(model, seed: int) -> None:
    """Random ``score`` head for ``--load-format dummy``."""
    score = getattr(getattr(model, "pooler", None), "score", None)
    if score is not None:
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        score.data.copy_(torch.randn(score.shape, generator=gen).mul_(0.02).to(score.dtype))
