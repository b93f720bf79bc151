"""The ``quantization_config`` of AWQ, GPTQ and compressed-tensors pack-quantized 4-bit
checkpoints -> :class:`engine.layers.quantization.int4.Int4Config` (the layouts and what
each field means are described there). Parsed by hand; no AutoAWQ, GPTQModel or
compressed-tensors package is needed.
"""

from __future__ import annotations

from engine.layers.quantization.int4 import Int4Config


def _refuse(msg: str) -> ValueError:
    """The error of a ``quantization_config`` ferry cannot load (FP8's parsers use it too)."""
    return ValueError(f"unsupported quantization_config: {msg}")


def _group_size(qc: dict, method: str) -> int:
    g = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or g % 32:
        raise _refuse(f"{method} group_size {g!r}: ferry loads groups that are a positive "
                      "multiple of 32 (per-channel, group_size -1, is not supported)")
    return g


def _bits(qc: dict, method: str) -> None:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} bits {bits!r}: ferry loads 4-bit weights only")


def parse_awq(qc: dict) -> Int4Config:
    """An AWQ ``quantization_config`` (module docstring).

    Raises:
        ValueError: bits, group_size, version or zero_point ferry cannot load, naming it.
    """
    _bits(qc, "awq")
    group = _group_size(qc, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {qc.get('version')!r}: ferry loads the GEMM layout "
                      "(version 'gemm')")
    if qc.get("zero_point", True) is not True:
        raise _refuse("awq zero_point false: ferry loads AWQ weights with zero points")
    return Int4Config("awq", group, True, 0, "quant_method awq",
                      list(qc.get("modules_to_not_convert") or []))


def parse_gptq(qc: dict) -> Int4Config:
    """A GPTQ ``quantization_config`` (module docstring).

    Raises:
        ValueError: bits, group_size, checkpoint_format, dynamic or a Marlin
            serialization ferry cannot load, naming it.
    """
    _bits(qc, "gptq")
    group = _group_size(qc, "gptq")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
    if qc.get("is_marlin_format"):
        raise _refuse("gptq is_marlin_format true: the Marlin serialization is not supported")
    if qc.get("dynamic"):
        raise _refuse("gptq dynamic (per-module overrides) is not supported")
    return Int4Config("gptq", group, True, 1 if fmt == "gptq" else 0,
                      f"quant_method gptq ({fmt})", act_order=bool(qc.get("desc_act")))


def ct_groups(qc: dict, label: str, wtype: str, bits: int, hint: str):
    """Yield ``(what, group, weights)`` for each compressed-tensors ``config_groups`` entry,
    after checking that it has ``wtype`` ``bits``-bit weights and targets ``Linear``.

    Raises:
        ValueError: no groups, or a group that does not, naming it (``hint``: what ferry
            loads).
    """
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    for gname, g in groups.items():
        w = g.get("weights") or {}
        what = f"compressed-tensors {label}group {gname!r}"
        if w.get("type") != wtype or w.get("num_bits") != bits:
            raise _refuse(f"{what} has {w.get('type')} {w.get('num_bits')}-bit weights; "
                          f"ferry loads {hint}")
        if "Linear" not in (g.get("targets") or []):
            raise _refuse(f"{what} targets {g.get('targets')}; ferry expects 'Linear'")
        yield what, g, w


def parse_compressed_int4(qc: dict) -> Int4Config:
    """compressed-tensors ``format: pack-quantized`` with 4-bit integer weights in groups
    (llm-compressor's W4A16): every ``config_groups`` entry must target ``Linear`` with
    ``weights {type: int, num_bits: 4, strategy: group, group_size: G}``, no input
    activations, and the same G, ``symmetric`` and ``actorder``.

    Raises:
        ValueError: anything else, naming the group and the field.
    """
    seen = set()
    for what, g, w in ct_groups(qc, "pack-quantized ", "int", 4,
                                "4-bit integer packed weights"):
        if w.get("strategy") != "group":
            raise _refuse(f"{what}: weight strategy {w.get('strategy')!r} (supported: group)")
        if g.get("input_activations"):
            raise _refuse(f"{what} quantizes input_activations; ferry loads weight-only "
                          "4-bit checkpoints")
        seen.add((_group_size(w, what), bool(w.get("symmetric", True)),
                  w.get("actorder") == "group"))
    if len(seen) != 1:
        raise _refuse(f"compressed-tensors groups with different group_size/symmetric/"
                      f"actorder {sorted(seen)}")
    group, sym, act_order = seen.pop()
    return Int4Config("compressed-tensors", group, True, 0,
                      "compressed-tensors pack-quantized", list(qc.get("ignore") or []),
                      symmetric=sym, act_order=act_order)
