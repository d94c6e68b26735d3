#!/usr/bin/env bash
# The README's main command: install from this repository's own files, then run the
# embedded default pair end to end on this machine (ONNX Runtime, CPU is enough).
# Extra arguments go to `dflash-trt demo` (e.g. --count 8 --max-new-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install torch==2.13.0
python -m pip install -e .
dflash-trt demo "$@"
