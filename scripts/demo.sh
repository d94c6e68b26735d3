#!/usr/bin/env bash
# The README's main command: install from this repository's own files, then run the embedded
# default pair end to end on this machine (ONNX Runtime, CPU is enough).
# Use a virtual environment: this installs into whatever Python is active. torch is installed only
# when missing (torch==2.13.0; on Linux prefer the CPU build: see README, Install); an existing
# torch >= 2.9 (CPU or CUDA build) is kept.
# Extra arguments go to `dflash-trt demo` (e.g. --count 8 --max-new-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY' || true
import sys
if sys.prefix == sys.base_prefix:
    print("note: no virtual environment is active; installing into", sys.prefix, file=sys.stderr)
PY
if ! python -c "import torch" 2>/dev/null; then
    echo "no torch in this Python: installing torch==2.13.0 (on Linux PyPI's build carries CUDA, several GB;" \
         "for the ~190 MB CPU build install it first: pip install torch --index-url https://download.pytorch.org/whl/cpu)" >&2
    python -m pip install torch==2.13.0
fi
python -m pip install -e .
dflash-trt demo "$@"
