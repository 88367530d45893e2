#!/usr/bin/env bash
# The device check of issue 13: llama-cpp-python with CUDA, native/ rebuilt against it, then
# the overhead and pool benchmarks on one GPU, JSON under $OUT (or bench/gpu/results). Every
# step gets what is left of GPU_CHECK_SECONDS (default 540), so the whole run fits one
# 10-minute device call.
#
# The device machine reaches nothing outside, so what it lacks travels in .whl/ (ignored by
# git; name it in the device tool's `carry`). Prepare it here once, from the repo root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl \
#       diskcache==5.6.3 gguf==0.18.0 pydantic pydantic-core annotated-types typing-inspection
#
# and either a CUDA build of llama-cpp-python made here (bench/gpu/wheel.sh: nvcc and the
# cuBLAS wheel are enough, no GPU; ~40 min on 2 cores, 0 device minutes) or its sdist, slimmed
# below the 64 MiB a call carries (then the CUDA build runs there, ~4 of the 10 minutes).
# Then run there:   bash bench/gpu/check.sh
# The default model (Gemma 3 270M, 240 MB) does not travel in one call: set MESH_MODEL to
# a GGUF already on the machine to add its rows; without it only the tiny model runs (its
# decode is as fast as a GPU's would be, so it shows the host's share).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/gpu/results}"
mkdir -p "$out"
py="${PYTHON:-python3}"
site="${SITE:-/tmp/mesh-site}"
log="$out/gpu_check.log"
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-540} ))
: >"$log"
say() { echo "[gpu_check $(date -u +%T)] $*" | tee -a "$log" >&2; }
left() { echo $(( deadline - $(date +%s) )); }

nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv \
    >"$out/gpu.txt" 2>&1 || say "nvidia-smi failed (no GPU?)"
cat "$out/gpu.txt" >&2

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    say "installing the carried wheels into $site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
        .whl/*.whl >>"$log" 2>&1 || say "wheel install failed (see $log)"
fi
# A CUDA build of llama_cpp made here by bench/gpu/wheel.sh, as a tarball of the installed
# package (its libraries once each, with their symlinks; a wheel would hold each 8 times).
if [ -f .whl/llama_cpp_cuda_site.tar.xz ]; then
    say "unpacking the carried CUDA build of llama_cpp into $site"
    mkdir -p "$site" && rm -rf "$site/llama_cpp" && tar xJf .whl/llama_cpp_cuda_site.tar.xz -C "$site"
    [ -f .whl/llama_cpp_dist_info.tar.gz ] && tar xzf .whl/llama_cpp_dist_info.tar.gz -C "$site"
fi
export PYTHONPATH="$site:$PWD"

# A CUDA build links libcudart and libcublas (.so.13); on this image they live in the
# Python environment's nvidia/*/lib folders rather than on the loader's path.
libdirs="$(find /opt /usr/local /usr/lib -name 'libcublas.so.1*' -printf '%h\n' 2>/dev/null \
    | sort -u | tr '\n' ':')"
libdirs="$libdirs$(find /opt /usr/local /usr/lib -name 'libcudart.so.1*' -printf '%h\n' \
    2>/dev/null | sort -u | tr '\n' ':')"
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
say "cuda library folders: ${libdirs:-none found}"

cuda_ok() {
    "$py" -c "import llama_cpp as l, sys; sys.exit(0 if l.llama_supports_gpu_offload() else 1)" \
        >>"$log" 2>&1
}
# GPU_CHECK_SKIP_BUILD=1: use whatever llama_cpp imports (a CPU dry run of this script).
if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ] && ! cuda_ok; then
    sdist="$(ls .whl/llama_cpp_python-*.tar.gz 2>/dev/null | head -1)"
    if [ -z "$sdist" ]; then
        say "llama_cpp has no GPU offload and no sdist is in .whl/ (see the header); stopping"
        exit 2
    fi
    say "building $sdist with CUDA (sm_${CUDA_ARCH:-90})"
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        timeout $(( $(left) - 120 )) "$py" -m pip install -q --no-index --no-deps \
        --no-build-isolation --no-compile --upgrade --target "$site" "$sdist" >>"$log" 2>&1 \
        || { say "CUDA build failed (tail of $log follows)"; tail -30 "$log" >&2; exit 3; }
fi
cuda_ok && say "llama_cpp offloads to the GPU" || say "llama_cpp has NO GPU offload"
"$py" -m native.build 2>&1 | tee -a "$log"

run() {  # name, seconds at most, command...
    local name="$1" limit="$2" t; shift 2
    # GPU_CHECK_ROWS: a regex; only the runs whose names match (a re-run of a few rows)
    if [ -n "${GPU_CHECK_ROWS:-}" ] && ! [[ "$name" =~ $GPU_CHECK_ROWS ]]; then return; fi
    t=$(left); [ "$t" -lt "$limit" ] && limit="$t"
    if [ "$limit" -lt 15 ]; then say "$name: skipped, out of time"; return; fi
    say "$name (at most ${limit}s)"
    PYTHONUNBUFFERED=1 timeout "$limit" "$@" 2>&1 | tee -a "$log" || say "$name: exit $?"
}
# The auto-tier for this GPU's free memory (what `mesh serve --kv-memory auto` prints).
run "kv tier for this GPU" 30 "$py" - <<'EOF'
from mesh.cli.compose import free_gpu_bytes
from mesh.engine.config import GIB, KVShape, choose_tier
free = free_gpu_bytes()
print(f"free GPU memory: {free / GIB if free else 0:.1f} GiB")
gemma = KVShape(layers=18, kv_heads=1, head_k=256, head_v=256)  # Gemma 3 270M
for budget, want in ((2048, 128), (4096, 255)):
    if free:
        print(choose_tier(gemma, int(free - 2 * GIB), prefix_tokens=28672,
                          session_budget=budget, want_sessions=want).describe())
EOF
# The default tiny model has heads of 16, which CUDA's flash attention does not take (the
# op falls back to the CPU), and its non-flash path aborted at N >= 32 on the first run
# (bench/gpu/results/run1): so that abort is logged with llama.cpp's own message first, and
# the rows are measured on tiny:hd64 (heads of 64; the same vocabulary) and tiny:262k.
run "the N=64 abort of the default tiny model, with llama.cpp's log" 40 bash -c \
    "MESH_LLAMA_VERBOSE=1 $py -m bench.overhead --model tiny --ns 64 --modes python \
    --repeat 1 --tokens 8 --out /tmp/diag.json >$out/crash_diag.log 2>&1; \
    grep -n -i -E 'error|flash_attn|graph splits|fallback' $out/crash_diag.log | head -30"
# The issue's shape (a 32K-token heavy prefix at N = 8, 32, 128), then the CPU table's
# (P = 512, N up to 255), then Gemma 3's vocabulary size.
run "overhead, tiny:hd64, 32K heavy prefix" 150 "$py" -m bench.overhead \
    --model tiny:hd64 --template heavy --prefix 32000 --ns 8,32,128 --tokens 64 \
    --flash-attn on --out "$out/overhead_hd64_32k.json"
run "overhead, tiny:hd64, P=512" 110 "$py" -m bench.overhead --model tiny:hd64 \
    --ns 1,16,64,128,255 --tokens 64 --flash-attn on --out "$out/overhead_hd64.json"
run "overhead, tiny:262k (Gemma 3's vocabulary), P=512" 90 "$py" -m bench.overhead \
    --model tiny:262k --ns 8,32,128 --tokens 32 --flash-attn on --out "$out/overhead_262k.json"
if [ -n "${MESH_MODEL:-}" ] && [ -f "${MESH_MODEL}" ]; then
    run "overhead, $MESH_MODEL, 32K heavy prefix" 150 "$py" -m bench.overhead \
        --model "$MESH_MODEL" --template heavy --prefix 30000 --ns 8,32,128 --tokens 32 \
        --flash-attn on --out "$out/overhead_model_32k.json"
fi
say "done; results in $out"
