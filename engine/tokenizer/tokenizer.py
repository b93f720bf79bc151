"""Tokenizer loading (transformers ``AutoTokenizer``).

- An HF directory with tokenizer files: ``AutoTokenizer.from_pretrained(dir)``.
- A GGUF file: ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` converts the embedded
  vocabulary (about 5-7 s for SmolLM2); the result is saved once under
  ``<cache>/gguf/<stem>-<key>/tokenizer`` (see ``engine.loader.loader.gguf_cache_dir``) and reloaded
  from there (under 1 s).
- A config-only directory (dummy weights) without tokenizer files: the embedded default
  model's tokenizer when its ids fit the config's vocabulary (``vocab_size >= 49152``), else
  a ``ValueError``. Benchmarks with dummy weights that feed token ids directly need no
  tokenizer at all: callers may skip this function and use ``tokenizer=None``.
"""

from __future__ import annotations

import json
import logging
import os

from engine.loader.gguf import scan_gguf
from engine.loader.loader import (
    ModelSource,
    default_model_file,
    gguf_cache_dir,
    resolve_model_path,
    save_to_cache,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(d: str) -> bool:
    return any(os.path.isfile(os.path.join(d, f)) for f in TOKENIZER_FILES)


def _gguf_tokenizer(gguf_file: str, use_cache: bool):
    from transformers import AutoTokenizer

    cached = gguf_cache_dir(gguf_file) / "tokenizer"
    if use_cache and has_tokenizer_files(str(cached)):
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # noqa: BLE001 - a broken cache entry: convert again
            logger.warning("ignoring cached tokenizer %s: %s", cached, e)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file),
                                        gguf_file=os.path.basename(gguf_file))
    if use_cache:
        save_to_cache(tok.save_pretrained, cached)
    return tok


def _config_vocab_size(source: ModelSource) -> int | None:
    path = source.config_file or os.path.join(source.root, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    return cfg.get("vocab_size")


def load_tokenizer(source_or_path: ModelSource | str | None = None,
                   vocab_size: int | None = None, use_cache: bool = True):
    """Load the tokenizer for a model source or a tokenizer directory.

    Args:
        source_or_path: a :class:`ModelSource`, a path (model dir, ``.gguf`` file, tokenizer
            dir or config ``.json``), or None/"" for the embedded default model.
        vocab_size: the model's vocabulary size, used to check the fallback tokenizer of a
            config-only source (default: ``vocab_size`` from its config.json).
        use_cache: read/write the converted GGUF tokenizer cache.
    Returns:
        a transformers tokenizer.
    Raises:
        FileNotFoundError: a missing path or default model.
        ValueError: no tokenizer can be found for the source.
    """
    from transformers import AutoTokenizer

    if isinstance(source_or_path, str) and os.path.isdir(source_or_path) \
            and has_tokenizer_files(source_or_path):
        return AutoTokenizer.from_pretrained(source_or_path)
    source = (source_or_path if isinstance(source_or_path, ModelSource)
              else resolve_model_path(source_or_path))
    if source.kind == "gguf":
        return _gguf_tokenizer(source.gguf_file, use_cache)
    if has_tokenizer_files(source.root):
        return AutoTokenizer.from_pretrained(source.root)
    if source.kind != "config":
        raise ValueError(f"{source.root} has weights but no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES)}); pass --tokenizer-path")
    vocab = vocab_size if vocab_size is not None else _config_vocab_size(source)
    default_file = default_model_file()
    default_vocab = scan_gguf(default_file)[0].get("tokenizer.ggml.tokens.len", 0)
    if vocab is None or vocab < default_vocab:
        raise ValueError(f"{source.config_file or source.root} has no tokenizer files and its "
                         f"vocab_size ({vocab}) is smaller than the default tokenizer's "
                         f"({default_vocab}); pass --tokenizer-path, or feed token ids")
    default = _gguf_tokenizer(default_file, use_cache)
    logger.warning("%s has no tokenizer; using the embedded default model's tokenizer "
                   "(%d tokens) for its %d-token vocabulary", source.config_file or source.root,
                   len(default), vocab)
    return default


#: architecture -> the special tokens that also end a turn: gpt-oss's harmony ends the
#: answer with ``<|return|>`` and a tool call with ``<|call|>`` (its generation config lists
#: both; its config.json names only ``<|return|>``)
TURN_END_TOKENS = {"GptOssForCausalLM": ("<|return|>", "<|call|>")}


def eos_token_ids(config, tokenizer) -> list[int]:
    """EOS ids from the model config (``eos_token_id``, its text config's), the tokenizer,
    and the family's turn-end tokens (``TURN_END_TOKENS``, when each is one token of the
    tokenizer's vocabulary)."""
    ids: set[int] = set()
    archs = getattr(config, "architectures", None) or []
    for text in (t for a in archs for t in TURN_END_TOKENS.get(a, ())):
        convert = getattr(tokenizer, "convert_tokens_to_ids", None)
        tid = convert(text) if convert is not None else None
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    for src in (getattr(config, "eos_token_id", None),
                getattr(getattr(config, "text_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return sorted(ids)
