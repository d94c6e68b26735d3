#!/usr/bin/env bash
# Install from this repository's own files, then run the tests (exactly what CI runs).
# Use a virtual environment: this installs into whatever Python is active. torch is installed only
# when missing (torch==2.13.0, what CI runs); an existing torch >= 2.9 (CPU or CUDA build) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_torch.sh
python -m pip install --quiet -e ".[test,rtx,serve,ray]"
python -m pytest -q "$@"
