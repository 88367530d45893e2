#!/usr/bin/env bash
# The main job: install (first time only) and run mesh on the embedded default model.
# Extra arguments go to `mesh`; with none, it runs the shared-pool demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ "$#" -eq 0 ]; then
    set -- demo
fi
exec .venv/bin/mesh "$@"
