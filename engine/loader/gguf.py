"""GGUF weights: a fast header scan and one-tensor-at-a-time dequantisation.

Format: github.com/ggml-org/ggml docs/gguf.md (v2/v3, little endian). Dequantisation is
gguf-py's; tensor names map to HF names through gguf-py's name table, and the q/k row
permutation that llama.cpp's converter applies is undone by transformers' GGUF processors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}


def scan_gguf(path: str) -> tuple[dict, list[tuple[str, int, tuple[int, ...], int]]]:
    """Read a GGUF header: scalar metadata and tensor infos (no tensor data).

    A fast reader for what loading needs (``gguf.GGUFReader`` parses every element of the
    tokenizer arrays, seconds per file). Format: github.com/ggml-org/ggml docs/gguf.md (v2/v3,
    little endian).

    Returns:
        ``(metadata, tensors)``: metadata maps keys to scalar or string values (an array is
        not read: ``"<key>.len"`` holds its length); each tensor is ``(name, ggml_type, numpy_shape, absolute_byte_offset)``.
    Raises:
        ValueError: not a GGUF v2/v3 little-endian file.
    """
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", mm, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 little-endian file")
        off = 24

        def read_str(o: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", mm, o)
            return mm[o + 8: o + 8 + n].decode("utf-8", "replace"), o + 8 + n

        def skip(vtype: int, o: int) -> int:
            if vtype == 8:
                (n,) = struct.unpack_from("<Q", mm, o)
                return o + 8 + n
            if vtype == 9:
                itype, count = struct.unpack_from("<IQ", mm, o)
                o += 12
                if itype in _GGUF_SCALARS:
                    return o + count * struct.calcsize(_GGUF_SCALARS[itype])
                for _ in range(count):
                    o = skip(itype, o)
                return o
            return o + struct.calcsize(_GGUF_SCALARS[vtype])

        meta: dict = {}
        for _ in range(n_kv):
            key, off = read_str(off)
            (vtype,) = struct.unpack_from("<I", mm, off)
            off += 4
            if vtype == 8:
                meta[key], off = read_str(off)
            elif vtype in _GGUF_SCALARS:
                (meta[key],) = struct.unpack_from(_GGUF_SCALARS[vtype], mm, off)
                off = skip(vtype, off)
            else:  # an array: only its length is kept, as "<key>.len"
                meta[f"{key}.len"] = struct.unpack_from("<Q", mm, off + 4)[0]
                off = skip(vtype, off)
        infos = []
        for _ in range(n_tensors):
            name, off = read_str(off)
            (n_dims,) = struct.unpack_from("<I", mm, off)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, off + 4)
            off += 4 + 8 * n_dims
            ggml_type, rel = struct.unpack_from("<IQ", mm, off)
            off += 12
            infos.append((name, ggml_type, tuple(reversed(dims)), rel))
    align = int(meta.get("general.alignment", 32))
    data_start = -(-off // align) * align
    return meta, [(n, t, shape, data_start + rel) for n, t, shape, rel in infos]


#: GGUF architecture names of MoE models (with an ``<arch>.expert_count``) -> HF's
_GGUF_MOE_ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                   "llama": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}


def check_gguf_supported(path: str) -> None:
    """Refuse a GGUF file of a mixture-of-experts model (``<arch>.expert_count`` > 0).

    llama.cpp stores each layer's experts stacked (``ffn_{gate,up,down}_exps``), which the
    name table of :func:`iter_gguf` does not map onto ferry's MoE models (they load Hub
    safetensors, one tensor per expert).

    Raises:
        ValueError: an MoE GGUF file, naming its architecture and the format.
    """
    meta, _ = scan_gguf(path)
    arch = meta.get("general.architecture")
    experts = meta.get(f"{arch}.expert_count") or 0
    if experts:
        hf = _GGUF_MOE_ARCHS.get(arch, "an MoE model")
        raise ValueError(f"{path}: GGUF weights of mixture-of-experts models are not "
                         f"supported (GGUF architecture {arch!r}, {experts} experts: {hf}); "
                         "load its safetensors checkpoint instead")


def _name_map(gguf_file: str, arch: str, config, hf_names: list[str]) -> dict[str, str]:
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_enum = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_enum is None:
        raise ValueError(f"{gguf_file}: GGUF architecture {arch!r} is unknown to gguf-py")
    table = get_tensor_name_map(arch_enum, config.num_hidden_layers)
    name_map = {}
    for hf in hf_names:
        base, _, suffix = hf.rpartition(".")
        g = table.get_name(base)
        if g is not None:
            name_map[f"{g}.{suffix}"] = hf
    return name_map


def gguf_tensor_types(gguf_file: str, config, hf_names: list[str]) -> dict[str, int]:
    """HF name -> ggml type id of each GGUF tensor that maps onto ``hf_names``."""
    meta, infos = scan_gguf(gguf_file)
    name_map = _name_map(gguf_file, meta.get("general.architecture"), config, hf_names)
    return {name_map[n]: t for n, t, *_ in infos if n in name_map}


def iter_gguf(gguf_file: str, config, hf_names: list[str], keep_blocks: bool = False
              ) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """``(num_tensors, iterator of (hf_name, fp32 cpu tensor))`` for a GGUF file.

    Tensors are dequantised one at a time (``gguf.dequantize``). GGUF names map to
    ``hf_names`` through ``gguf.get_tensor_name_map`` (the table llama.cpp's converter
    uses), and the q/k row permutation llama.cpp applies is undone by transformers'
    ``TENSOR_PROCESSORS`` (what ``from_pretrained(gguf_file=...)`` runs).
    GGUF tensors whose names match none of ``hf_names`` are skipped.

    With ``keep_blocks``, Q4_0/Q4_1/Q8_0/Q4_K tensors are yielded as
    :class:`engine.layers.quantization.gguf.GgufBlocks` (raw block rows, which a float
    layer dequantizes when it loads them): the processor's row permutation is applied to
    whole rows of blocks (found by running it on the row indices).

    Raises:
        ValueError: with ``keep_blocks``, a processor that does more than permute the rows
            of a block tensor.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from gguf.quants import quant_shape_to_byte_shape
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from engine.layers.quantization.gguf import BLOCK_TYPES, GgufBlocks

    meta, infos = scan_gguf(gguf_file)
    arch = meta.get("general.architecture")
    name_map = _name_map(gguf_file, arch, config, hf_names)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    parsed: dict = {"tensors": {}, "config": config.to_dict()}

    def gen():
        import mmap

        with open(gguf_file, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # closed when collected
        # a plain ndarray over the mapping: np.memmap slicing is slow in dequantize
        data = np.frombuffer(mm, dtype=np.uint8)
        for name, ggml_type, shape, offset in infos:
            if name not in name_map:
                continue
            qtype = GGMLQuantizationType(ggml_type)
            byte_shape = quant_shape_to_byte_shape(shape, qtype)
            raw = data[offset: offset + int(np.prod(byte_shape))].reshape(byte_shape)
            if keep_blocks and ggml_type in BLOCK_TYPES and len(shape) == 2:
                yield name_map[name], GgufBlocks(_permute_rows(processor, raw, name, name_map,
                                                               parsed), ggml_type, shape)
                continue
            w = dequantize(raw, qtype)
            res = processor.process(weights=w, name=name, tensor_key_mapping=name_map,
                                    parsed_parameters=parsed)
            arr = np.ascontiguousarray(res.weights)
            if not arr.flags.writeable:
                arr = arr.copy()
            yield name_map[res.name], torch.from_numpy(arr)

    return sum(n in name_map for n, *_ in infos), gen()


def _permute_rows(processor, raw, name: str, name_map: dict, parsed: dict):
    """``raw`` block rows in the order the processor gives dequantized rows."""
    import numpy as np

    rows = raw.shape[0]
    idx = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    res = processor.process(weights=idx, name=name, tensor_key_mapping=name_map,
                            parsed_parameters=parsed)
    perm = np.asarray(res.weights).reshape(-1)
    if res.name != name or perm.shape != (rows,) or \
            not np.array_equal(np.sort(perm), idx.reshape(-1)):
        raise ValueError(f"GGUF tensor {name}: transformers' processor changes more than the "
                         "order of its rows; load it with --gguf-dequantize")
    return raw if np.array_equal(perm, idx.reshape(-1)) else raw[perm]


def capture_head_blocks(it, model, out: list):
    """Pass ``it`` through, keeping the LM head's GGUF blocks (the embedding table's when
    tied) in ``out`` when tensor parallelism is off."""
    from engine.distributed import get_tp
    from engine.layers.quantization.gguf import BLOCK_TYPES, GgufBlocks

    name = ("model.embed_tokens.weight" if getattr(model, "tie_word_embeddings", False)
            else "lm_head.weight")
    for hf_name, t in it:
        if hf_name == name and isinstance(t, GgufBlocks) and t.ggml_type in BLOCK_TYPES:
            if get_tp().size == 1:
                out.append(t)
        yield hf_name, t


def quantized_head(blocks, quant, dtype: torch.dtype, device: torch.device):
    """The LM head as a linear layer over its own GGUF blocks (the logits read the embedding
    table's Q8_0 bytes, 1.06 a weight, instead of 4 in fp32); the embedding lookup keeps
    the dequantized table. ``model.compute_logits`` uses it."""
    from engine.layers.linear import ReplicatedLinear
    from engine.layers.quantization.gguf import BLOCK, BLOCK_TYPES, scale_dtype

    vocab, hidden = blocks.shape
    from engine.layers.quantization import quantization_scope

    with torch.device(device), quantization_scope(quant):
        head = ReplicatedLinear(hidden, vocab, bias=False, dtype=dtype, tp_size=1, tp_rank=0)
    head.quant_method.set_format(head, BLOCK_TYPES[blocks.ggml_type][2], BLOCK,
                                 scale_dtype([blocks.ggml_type]))
    with torch.no_grad():
        head.weight.weight_loader(head.weight, blocks)
    logger.info("GGUF: the LM head reads its %s blocks (%.1f MB)", blocks.type_name,
                sum(p.numel() * p.element_size() for p in head.parameters()) / 1e6)
    return head


def keeps_gguf_blocks(quantization: str | None, gguf_dequantize: bool, device_type: str
                      ) -> bool:
    """Whether a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K linear weights stay in their blocks: on the CPU
    by default, on any device with ``--quantization gguf``; never with
    ``--gguf-dequantize`` or ``--quantization fp8|awq|gptq`` (which quantize dequantized
    weights).

    Raises:
        ValueError: ``--quantization gguf`` with ``--gguf-dequantize``.
    """
    if quantization == "gguf" and gguf_dequantize:
        raise ValueError("--quantization gguf keeps GGUF blocks; --gguf-dequantize drops them: "
                         "choose one")
    if gguf_dequantize or quantization in ("fp8", "awq", "gptq"):
        return False
    return quantization == "gguf" or device_type == "cpu"
