# Sourced by demo.sh and test.sh: warn when no virtual environment is active, and install torch only
# when this Python has none (torch==2.13.0, what CI runs); an existing torch >= 2.9 (CPU or CUDA build) is kept.
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
