#!/usr/bin/env bash
# The README's main command: install from this repository's own files, then run the embedded
# default pair end to end on this machine (ONNX Runtime, CPU is enough).
# Use a virtual environment: this installs into whatever Python is active. torch is installed only
# when missing (torch==2.13.0; on Linux prefer the CPU build: see README, Install); an existing
# torch >= 2.9 (CPU or CUDA build) is kept.
# Extra arguments go to `dflash-trt demo` (e.g. --count 8 --max-new-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_torch.sh
python -m pip install -e .
dflash-trt demo "$@"
