#!/usr/bin/env bash
# Install everything from this repository's own files, then run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test,rtx,serve]"
python -m pytest -q "$@"
