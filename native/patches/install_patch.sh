#!/usr/bin/env bash
# Put mesh's shared-prefix attention patch (issue 32) into a venv's llama-cpp-python.
#
#   native/patches/install_patch.sh [VENV]        # scripts/install.sh runs this; VENV=.venv
#
# What it does, quickest path first:
#   1. the venv's libggml-cpu already exports ggml_cpu_shared_prefix_attn_version: done;
#   2. a patched libggml-cpu built earlier for this llama-cpp-python version and this patch
#      (~/.cache/mesh/patched-ggml/<version>-<patch sha>/): copied into the venv (a second);
#   3. otherwise: the llama-cpp-python sdist of the installed version is fetched from the
#      package index (pip download), the patch applied to its vendored llama.cpp and
#      libggml-cpu built (build_patched_ggml.sh; ~40 s on 2 cores), cached, copied in.
# Only libggml-cpu changes (ggml-cpu's internals; no public header, no ABI change), so the
# wheel's other libraries and mesh's native step stay as they are. A version the patch is
# not made for, or a failed build, is reported in one line and leaves the venv unpatched:
# mesh then runs llama.cpp's own attention (`--prefix-attention auto` resolves to off).
# MESH_PREFIX_ATTENTION_PATCH=0 skips all of it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="$(cd "${1:-$REPO/.venv}" 2>/dev/null && pwd)" || { echo "prefix-attention patch: no venv at ${1:-$REPO/.venv}" >&2; exit 1; }
PY="$VENV/bin/python"
PATCH="$HERE/llama.cpp-0.3.36-shared-prefix-attn.patch"
WANT_VERSION="0.3.36"

say() { echo "prefix-attention patch: $*" >&2; }

[ "${MESH_PREFIX_ATTENTION_PATCH:-1}" = 0 ] && { say "skipped (MESH_PREFIX_ATTENTION_PATCH=0)"; exit 0; }
[ -x "$PY" ] || { say "no python at $PY; run scripts/install.sh first"; exit 1; }

version="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
lib="$("$PY" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llama_cpp"); print(pathlib.Path(s.origin).parent / "lib")')"
target="$lib/libggml-cpu.so.0"
if [ ! -f "$target" ]; then
    say "$lib has no libggml-cpu.so.0 (a static or GPU build?); left unpatched"
    exit 0
fi
if nm -D "$target" 2>/dev/null | grep ' T ggml_cpu_shared_prefix_attn_version$' >/dev/null; then
    exit 0  # patched already
fi
if [ "$version" != "$WANT_VERSION" ]; then
    say "made for llama-cpp-python $WANT_VERSION, this venv has $version; left unpatched (prefix attention off)"
    exit 0
fi

sha="$(sha256sum "$PATCH" | cut -c1-16)"
cache="${MESH_CACHE_DIR:-$HOME/.cache/mesh}/patched-ggml/$version-$sha"
if [ ! -f "$cache/libggml-cpu.so.0" ]; then
    say "building libggml-cpu with the patch (first time for this version: about a minute on 2 cores)..."
    work="$(mktemp -d "${TMPDIR:-/tmp}/mesh-patch.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work/sdist" \
        || { say "could not fetch the llama-cpp-python $version sdist from the package index; left unpatched"; exit 1; }
    sdist="$(find "$work/sdist" -name 'llama_cpp_python-*.tar.gz' | head -n1)"
    "$HERE/build_patched_ggml.sh" "$sdist" --work "$work/build" --out "$work/lib" --python "$PY" \
        || { say "the build failed (see the lines above); left unpatched"; exit 1; }
    mkdir -p "$cache"
    cp -L "$work/lib/libggml-cpu.so.0" "$cache/libggml-cpu.so.0.tmp"
    mv "$cache/libggml-cpu.so.0.tmp" "$cache/libggml-cpu.so.0"
fi
# Every name of the library (so, so.0, so.X.Y.Z; links or copies) gets the patched file.
for f in "$lib"/libggml-cpu.so*; do
    rm -f "$f"
    cp "$cache/libggml-cpu.so.0" "$f"
done
nm -D "$target" | grep ' T ggml_cpu_shared_prefix_attn_version$' >/dev/null \
    || { say "$target still lacks the patch's symbol after copying; left as is"; exit 1; }
say "installed into $lib"
