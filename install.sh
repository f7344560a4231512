#!/usr/bin/env bash
# Create .venv (if missing) and install vime into it, editable.
#   bash install.sh          # runtime only
#   bash install.sh dev      # plus the test tools (and megatron-core, for its CPU tests)
#   bash install.sh dev,bench
# torch is installed first, and only when the venv has none: a bare "torch"
# requirement would pull a multi-GB CUDA build onto a CPU machine. Set
# VIME_TORCH to choose another spec; on a machine without a local CPU wheel,
# point pip at PyTorch's CPU index (PIP_EXTRA_INDEX_URL) before running this.
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "${VIME_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",dev,"* ]]; then
    # The tests drive megatron-core on CPU. Its metadata says Python >= 3.12, but its code runs on 3.11,
    # and it imports triton at load time; --no-deps keeps pip from pulling a CUDA build of anything.
    .venv/bin/python -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2 triton==3.9.0
fi
