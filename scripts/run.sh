#!/usr/bin/env bash
# The main job: install (first time only) and run mesh on the embedded default model.
# Extra arguments go to `mesh`; with none, it serves the A2A coordinator (mesh serve).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    set -- serve "$@"   # no command, or only options: they are mesh serve's
fi
exec .venv/bin/mesh "$@"
