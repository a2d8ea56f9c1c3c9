#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, x86-64, no network there): the packages fate_lab needs at versions
# its image lacks. Run here once; the device run then carries .whl/ (device_check.sh installs them first).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "transformers==$(${PY:-.venv/bin/python} -c "import transformers; print(transformers.__version__)")"
ls -la .whl
