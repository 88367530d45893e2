#!/usr/bin/env bash
# Build mesh's shared-prefix flash-attention patch into libggml-cpu and assemble a library
# directory that llama-cpp-python loads with LLAMA_CPP_LIB_PATH (issue 32;
# docs/prefix-attention-kernel.md).
#
#   native/patches/build_patched_ggml.sh SRC [--out LIBDIR] [--work DIR] [--jobs N]
#                                            [--python PY] [--test]
#
# SRC is a pristine llama.cpp tree as vendored by llama-cpp-python 0.3.36 (e.g. the sdist's
# vendor/llama.cpp) or the sdist itself (llama_cpp_python-0.3.36.tar.gz). SRC is never
# modified: the tree is copied to --work (default: a temporary directory), the patch is
# applied there (with a clear error if it no longer applies), libggml-cpu is built (Release,
# GGML_NATIVE=ON and shared libs, as llama-cpp-python's own build), and --out (default
# native/build/patched-lib) becomes a copy of the installed wheel's llama_cpp/lib with the
# patched libggml-cpu.so* swapped in. The rest of the wheel's libraries are kept: the patch
# changes only ggml-cpu's internals, and libggml loads libggml-cpu.so.0 by its soname.
# --test also builds and runs native/patches/test_shared_prefix_attn.cpp (old vs shared
# kernel on random data, 2 threads).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PATCH="$HERE/llama.cpp-0.3.36-shared-prefix-attn.patch"

SRC=""
OUT="$REPO/native/build/patched-lib"
WORK=""
JOBS="$(nproc 2>/dev/null || echo 2)"
PY="$REPO/.venv/bin/python"
TEST=0

die() { echo "build_patched_ggml.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --out)    OUT="$2"; shift 2 ;;
        --work)   WORK="$2"; shift 2 ;;
        --jobs)   JOBS="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --test)   TEST=1; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *)  [ -z "$SRC" ] || die "one SRC only (got '$SRC' and '$1')"; SRC="$1"; shift ;;
    esac
done
[ -n "$SRC" ] || die "give the pristine llama.cpp 0.3.36 tree or the llama-cpp-python 0.3.36 sdist (see --help)"
[ -e "$SRC" ] || die "$SRC does not exist"
[ -f "$PATCH" ] || die "$PATCH is missing"
command -v cmake >/dev/null || die "cmake is not installed (apt-get install cmake)"
command -v patch >/dev/null || die "patch is not installed (apt-get install patch)"

if [ -z "$WORK" ]; then
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/mesh-llama-patched.XXXXXX")"
fi
mkdir -p "$WORK"
TREE="$WORK/llama.cpp"

# 1. a private copy of the tree (never the caller's)
if [ -f "$SRC" ]; then
    case "$SRC" in
        *.tar.gz|*.tgz) ;;
        *) die "$SRC is a file but not a .tar.gz sdist" ;;
    esac
    rm -rf "$WORK/sdist" && mkdir -p "$WORK/sdist"
    tar -xzf "$SRC" -C "$WORK/sdist"
    VENDORED="$(find "$WORK/sdist" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -n1)"
    [ -n "$VENDORED" ] || die "$SRC has no vendor/llama.cpp: is it llama-cpp-python's sdist?"
    rm -rf "$TREE" && mv "$VENDORED" "$TREE"
else
    [ -f "$SRC/ggml/src/ggml-cpu/ops.cpp" ] || die "$SRC is not a llama.cpp tree (no ggml/src/ggml-cpu/ops.cpp)"
    rm -rf "$TREE" && mkdir -p "$TREE"
    (cd "$SRC" && tar --exclude=./build --exclude=./.git -cf - .) | (cd "$TREE" && tar -xf -)
fi

# 2. the patch: applies cleanly, or was applied already, or stop with the reason
cd "$TREE"
if patch -p1 --dry-run --forward --silent < "$PATCH" >/dev/null 2>&1; then
    patch -p1 --forward --silent < "$PATCH"
    echo "applied $(basename "$PATCH")" >&2
elif patch -p1 --dry-run --reverse --silent < "$PATCH" >/dev/null 2>&1; then
    echo "the tree already carries the patch; building it as is" >&2
else
    patch -p1 --dry-run --forward < "$PATCH" >&2 || true
    die "the patch does not apply to $SRC: it is made for llama.cpp as vendored by
llama-cpp-python 0.3.36 (ggml/src/ggml-cpu/ops.cpp, ggml-cpu.c, ops.h). Another version needs
the patch ported (the hunks above failed); mesh runs unpatched meanwhile (prefix attention off)."
fi

# 3. build libggml-cpu (and libggml-base, its dependency) as llama-cpp-python builds them
cmake -S "$TREE" -B "$TREE/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF >"$WORK/cmake-configure.log" 2>&1 \
    || die "cmake configure failed; see $WORK/cmake-configure.log"
cmake --build "$TREE/build" --target ggml-cpu -j "$JOBS" >"$WORK/cmake-build.log" 2>&1 \
    || die "building ggml-cpu failed; see $WORK/cmake-build.log"
BUILT="$(find "$TREE/build" -name 'libggml-cpu.so.*.*' -type f | head -n1)"
[ -n "$BUILT" ] || die "no libggml-cpu.so.X.Y.Z under $TREE/build; see $WORK/cmake-build.log"

# 4. the library directory: the wheel's libraries, the patched ggml-cpu in place of its own
WHEEL_LIB="$("$PY" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llama_cpp"); print(pathlib.Path(s.origin).parent / "lib")' 2>/dev/null)" \
    || die "$PY cannot find llama_cpp; pass --python <the venv's python>"
[ -f "$WHEEL_LIB/libggml-cpu.so.0" ] || die "$WHEEL_LIB has no libggml-cpu.so.0 (a static or backend-DL build?); this script handles the shared-library wheel only"
rm -rf "$OUT" && mkdir -p "$OUT"
cp -a "$WHEEL_LIB"/. "$OUT"/
for f in "$OUT"/libggml-cpu.so*; do
    rm -f "$f" && cp -L "$BUILT" "$f"
done
if command -v nm >/dev/null; then
    nm -D "$OUT/libggml-cpu.so.0" | grep ' T ggml_cpu_shared_prefix_attn_version$' >/dev/null \
        || die "$OUT/libggml-cpu.so.0 does not export ggml_cpu_shared_prefix_attn_version"
fi
echo "patched library directory: $OUT  (use LLAMA_CPP_LIB_PATH=$OUT)" >&2

# 5. optional: the kernel test against this build
if [ "$TEST" = 1 ]; then
    command -v g++ >/dev/null || die "--test needs g++"
    LIBDIR="$(dirname "$BUILT")"
    g++ -O2 -std=c++17 -I"$TREE/ggml/include" "$HERE/test_shared_prefix_attn.cpp" \
        -L"$LIBDIR" -lggml-base -lggml-cpu -Wl,-rpath,"$LIBDIR" -o "$WORK/test_shared_prefix_attn"
    "$WORK/test_shared_prefix_attn" --threads 2 --reps 3
fi
