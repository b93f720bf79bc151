"""LoRA's flags (SGLang's names; ``engine/lora/``), adapter names and their checks;
``ServerArgs`` takes the flags flat (``engine/args/fields.py``'s ``take_fields``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.args.fields import flag

#: --max-lora-rank without --lora-paths to take it from
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoraArgs:
    """The LoRA group of ``ServerArgs`` (its fields' ``help`` is the flags')."""

    lora_paths: tuple[str, ...] | None = flag(
        None, "LoRA adapters (peft directories) to serve: name=path (SGLang's form) or a path "
              "(named after its directory); a request picks one with model 'name' or "
              "'<served model>:name'")
    enable_lora: bool = flag(False, "serve LoRA adapters even without --lora-paths (they "
                                    "come later through POST /load_lora_adapter)")
    max_loras_per_batch: int = flag(8, "LoRA: most distinct adapters in one step (the "
                                       "device slots of every layer)", ge=1, le=64)
    max_loaded_loras: int | None = flag(
        None, "LoRA: most adapters loaded at once (host memory, counting an unloaded one "
              "until the requests on it end; beyond --max-loras-per-batch the least recently "
              "used leave the device; default: no limit)", ge=1)
    max_lora_rank: int | None = flag(
        None, "LoRA: largest adapter rank (the slots' size; default: the largest of "
              f"--lora-paths, else {DEFAULT_MAX_LORA_RANK})", ge=1, le=512)


def lora_enabled(args) -> bool:
    """Whether the engine serves LoRA adapters (--lora-paths or --enable-lora)."""
    return bool(args.lora_paths) or args.enable_lora


#: a LoRA adapter's name: 1..256 of these (no ':', SGLang's "base:name" separator; nothing
#: a URL path, a log line or a metric label would escape)
MAX_ADAPTER_NAME_LEN, ADAPTER_NAME_CHARS = 256, "ASCII letters, digits, '.', '_' and '-'"


def adapter_name_error(name: str) -> str | None:
    """What is wrong with a LoRA adapter name (``--lora-paths``, ``lora_name``), or None:
    empty, over ``MAX_ADAPTER_NAME_LEN`` characters, or one outside ``ADAPTER_NAME_CHARS``."""
    shown = name if len(name) <= 64 else name[:64] + "..."
    if len(name) > MAX_ADAPTER_NAME_LEN:
        return (f"the LoRA adapter name {shown!r} has {len(name)} characters, more than "
                f"{MAX_ADAPTER_NAME_LEN}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        return f"the LoRA adapter name {shown!r} must be 1 or more {ADAPTER_NAME_CHARS}"
    return None


def lora_path_items(paths) -> list[tuple[str, str]]:
    """``--lora-paths`` as ``(name, path)``: ``name=path``, or a path named after its last
    directory (SGLang's forms).

    Raises:
        ValueError: naming --lora-paths, for an empty name or path, a name with ':', a
            name ``adapter_name_error`` refuses or a name given twice.
    """
    out: list[tuple[str, str]] = []
    for item in paths or ():
        name, eq, path = item.partition("=")
        if not eq:
            path = item
            name = item.rstrip("/").rpartition("/")[2]
        if not name or not path or ":" in name:
            raise ValueError(f"--lora-paths {item!r}: expected name=path or a directory, with "
                             "a name without ':'")
        if (bad := adapter_name_error(name)) is not None:
            raise ValueError(f"--lora-paths {item[:300]!r}: {bad} (give name=path)")
        if name in dict(out):
            raise ValueError(f"--lora-paths: the adapter name {name!r} is given twice")
        out.append((name, path))
    return out


def lora_error(a) -> str | None:
    """What is wrong with the --lora-* flags of ``a`` (a ``ServerArgs``: with
    --speculative-algorithm too), or None."""
    if not lora_enabled(a):
        given = [f for f in ("max_loaded_loras", "max_lora_rank") if getattr(a, f) is not None]
        if given:
            return f"--{given[0].replace('_', '-')} needs --lora-paths or --enable-lora"
        return None
    try:
        items = lora_path_items(a.lora_paths)
    except ValueError as e:
        return str(e)
    if a.max_loaded_loras is not None and len(items) > a.max_loaded_loras:
        return (f"--lora-paths gives {len(items)} adapters, more than --max-loaded-loras "
                f"{a.max_loaded_loras}")
    if a.speculative_algorithm:
        return ("--lora-paths/--enable-lora with --speculative-algorithm is not built (verify "
                "steps do not apply adapters yet)")
    return None
