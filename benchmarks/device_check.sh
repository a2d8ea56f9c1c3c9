#!/usr/bin/env bash
# The prepared device check (issue 8): what a GPU owner runs first, in under 8 minutes on one GPU.
# 1. versions and the GPU; 2. the CUDA tests (offloaded tokens == plain tokens on the device, with the
# emulated and the native link); 3. every preset on the native PCIe link, one table.
# Usage (repo root, a python3 with torch+CUDA and fate_lab's dependencies): bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"
echo "== CUDA tests"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_runtime.py -k cuda 2>&1 | tail -n 15
echo "== presets on the native link"
timeout 300 $PY -m benchmarks.bench_device --new-tokens 48
