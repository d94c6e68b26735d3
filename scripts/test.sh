#!/usr/bin/env bash
# Install from this repository's own files, then run the tests (exactly what CI runs).
# Use a virtual environment: this installs into whatever Python is active. torch is installed only
# when missing (torch==2.13.0, what CI runs); an existing torch >= 2.9 (CPU or CUDA build) is kept.
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
    python -m pip install --quiet torch==2.13.0
fi
python -m pip install --quiet -e ".[test,rtx,serve]"
python -m pytest -q "$@"
