#!/usr/bin/env bash
# The device check of issue 13: llama-cpp-python built with CUDA, native/ rebuilt against
# it, then the overhead and pool benchmarks on one GPU, JSON under $OUT (or
# bench/results/gpu). Sized for about 8 minutes on one H200 (the CUDA build is most of it).
#
# The device machine reaches nothing outside, so what it lacks travels in .whl/ (ignored by
# git; name it in the device tool's `carry`). Prepare it here once, from the repo root:
#
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download --no-deps --no-binary :all: -d .whl llama-cpp-python==0.3.36
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl \
#       diskcache==5.6.3 gguf==0.18.0 pydantic pydantic-core annotated-types typing-inspection
#
# (keep pydantic and pydantic-core at versions that match each other). Then run there:
#   bash bench/gpu_check.sh
# The default model (Gemma 3 270M, 240 MB) does not travel in one call: set MESH_MODEL to
# a GGUF already on the machine to add its rows; without it only the tiny model runs (its
# decode is as fast as a GPU's would be, so it shows the host's share).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/gpu}"
mkdir -p "$out"
py="${PYTHON:-python3}"
site="${SITE:-/tmp/mesh-site}"
log="$out/gpu_check.log"
: >"$log"
say() { echo "[gpu_check $(date -u +%T)] $*" | tee -a "$log" >&2; }

nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv \
    >"$out/gpu.txt" 2>&1 || say "nvidia-smi failed (no GPU?)"
cat "$out/gpu.txt" >&2

if [ -d .whl ]; then
    say "installing the carried wheels into $site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
        .whl/*.whl >>"$log" 2>&1 || say "wheel install failed (see $log)"
fi
export PYTHONPATH="$site:$PWD"

# GPU_CHECK_SKIP_BUILD=1: use whatever llama_cpp imports (a CPU dry run of this script).
if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ] && [ ! -e "$site/llama_cpp/lib/libggml-cuda.so" ]; then
    sdist="$(ls .whl/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)"
    if [ -z "$sdist" ]; then
        say "no llama-cpp-python sdist in .whl/ (see the header); stopping"; exit 2
    fi
    say "building $sdist with CUDA (sm_${CUDA_ARCH:-90})"
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAMA_BUILD_TESTS=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        timeout 420 "$py" -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-compile --upgrade --target "$site" "$sdist" >>"$log" 2>&1 \
        || { say "CUDA build failed (tail of $log follows)"; tail -30 "$log" >&2; exit 3; }
fi
"$py" -m native.build 2>&1 | tee -a "$log"

run() {  # name, timeout, command...
    local name="$1" limit="$2"; shift 2
    say "$name"
    PYTHONUNBUFFERED=1 timeout "$limit" "$@" 2>&1 | tee -a "$log" || say "$name: exit $?"
}
# The host's share with a GPU-fast decode: N = 8, 32, 128, a 32K-token heavy prefix.
run "overhead, tiny, 32K heavy prefix" 150 "$py" bench/overhead_bench.py --model tiny \
    --template heavy --prefix 32000 --ns 8,32,128 --tokens 64 --flash-attn on \
    --out "$out/overhead_tiny_32k.json"
run "overhead, tiny, P=512 (the CPU table's shape)" 60 "$py" bench/overhead_bench.py \
    --model tiny --ns 1,16,64,128,255 --tokens 64 --out "$out/overhead_tiny.json"
run "pool bench, tiny, quick" 90 "$py" bench/pool_bench.py --model tiny --quick \
    --out "$out/pool_tiny.json"
if [ -n "${MESH_MODEL:-}" ] && [ -f "${MESH_MODEL}" ]; then
    run "overhead, $MESH_MODEL, 32K heavy prefix" 150 "$py" bench/overhead_bench.py \
        --model "$MESH_MODEL" --template heavy --prefix 30000 --ns 8,32,128 --tokens 32 \
        --flash-attn on --out "$out/overhead_model_32k.json"
fi
# The auto-tier for this GPU's free memory (what `mesh serve --kv-memory auto` prints).
run "kv tier for this GPU" 30 "$py" - <<'EOF'
from mesh.cli.engine_flags import free_gpu_bytes
from mesh.engine.tiers import GIB, KVShape, choose_tier
free = free_gpu_bytes()
print(f"free GPU memory: {free / GIB if free else 0:.1f} GiB")
gemma = KVShape(layers=18, kv_heads=1, head_k=256, head_v=256)  # Gemma 3 270M
for budget, want in ((2048, 128), (4096, 255)):
    if free:
        print(choose_tier(gemma, int(free - 2 * GIB), prefix_tokens=28672,
                          session_budget=budget, want_sessions=want).describe())
EOF
say "done; results in $out"
