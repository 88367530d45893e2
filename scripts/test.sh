#!/usr/bin/env bash
# Install (first time only) with the test extras, then lint, type-check and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/pytest -q "$@"
