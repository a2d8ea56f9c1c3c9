#!/usr/bin/env bash
# The prepared device check: what a GPU owner (or a lent GPU session) runs first, in under 8 minutes on one GPU.
# 1. versions and the GPU; 2. the CUDA tests (offloaded tokens == plain tokens on the device, emulated and native
# link); 3. every preset on the native PCIe link and on an emulated scaled link, each row with the simulator's
# prediction for the same config beside the measurement (compute profile calibrated on this GPU).
# Usage (repo root, a python3 with torch+CUDA): bash benchmarks/device_check.sh
# Packages the GPU machine lacks or has at another version (transformers >= 5.20 here) travel as wheels in .whl/
# (bash benchmarks/device_wheels.sh makes them); they are installed into /tmp/site first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"
if [ ! -f data/tiny_moe/model.safetensors ]; then
  # A lent machine takes at most 64 MiB of working tree: the embedded model's weights may not travel. Then the check
  # runs on random weights of its shape (the CUDA path's exactness and the link's speed, not its trained routing).
  echo "data/tiny_moe/model.safetensors absent: random weights of its shape (seed 0), routing untrained"
  $PY - <<'PYEOF' || exit 1
import torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained("data/tiny_moe")
AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained("data/tiny_moe", safe_serialization=True)
PYEOF
fi
echo "== CUDA tests"
timeout 240 $PY -m pytest -q -p no:cacheprovider --import-mode=importlib tests/offloading/test_runtime.py -k cuda 2>&1 | tail -n 15
echo "== presets on the native link and an emulated scaled link, predicted beside measured"
timeout 300 $PY -m benchmarks.bench_device --new-tokens 48
