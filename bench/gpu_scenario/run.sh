#!/usr/bin/env bash
# The source system's scenario on one GPU (issue 31), in one call with its own time budget:
# unpack the carried CUDA build of llama_cpp (as bench/gpu/check.sh does) and llama-server,
# write a random-weight GGUF of Llama 3.1 8B's geometry, then bench/gpu_scenario/: mesh's
# pool vs llama-server at P = 32K then 128K, every row into $OUT/gpu_scenario.json (and the
# table in gpu_scenario.md) the moment it finishes.
#
# Prepare here (no GPU; see docs/gpu-scenario.md):
#   bash bench/gpu/wheel.sh            # .whl/llama_cpp_cuda_site.tar.xz (~40 min, 2 cores)
#   bash bench/gpu/server_build.sh     # .whl/llama_server_bin.tar.xz    (~10 min)
#   + .whl/py/: gguf-0.18.0 and diskcache-5.6.3 wheels (the image lacks them)
# Run there (device tool: carry [".whl"], timeout_s 600):
#   bash bench/gpu_scenario/run.sh
# A CPU dry run (tiny twin of the geometry, tiny P, the venv's llama_cpp):
#   GPU_SCENARIO_DRY_RUN=1 PYTHON=.venv/bin/python bash bench/gpu_scenario/run.sh
#
# Knobs: GPU_SCENARIO_SECONDS (default 480: fits a 10-minute call and a 15-minute device
# budget with a start), GEOMETRY (llama-3.1-8b), WEIGHTS (q4_0), KV_TYPE (q8_0),
# SCENARIO_ARGS (more bench/gpu_scenario/ flags, e.g. "--prefixes 131072").
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${GPU_SCENARIO_DRY_RUN:-}"
if [ -n "$dry" ]; then
    out="${OUT:-bench/gpu_scenario/results/dryrun}"
else
    out="${OUT:-bench/gpu_scenario/results/gpu}"
fi
mkdir -p "$out"
py="${PYTHON:-python3}"
site="${SITE:-/tmp/mesh-site}"
log="$out/gpu_scenario.log"
deadline=$(( $(date +%s) + ${GPU_SCENARIO_SECONDS:-480} ))
: >"$log"
say() { echo "[gpu_scenario $(date -u +%T)] $*" | tee -a "$log" >&2; }
left() { echo $(( deadline - $(date +%s) )); }

nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv \
    >"$out/gpu.txt" 2>&1 || say "nvidia-smi failed (no GPU?)"

pythonpath="$PWD"
if [ -z "$dry" ]; then
    shopt -s nullglob
    wheels=(.whl/*.whl .whl/py/*.whl)
    shopt -u nullglob
    if [ "${#wheels[@]}" -gt 0 ]; then
        say "installing the carried wheels into $site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
            "${wheels[@]}" >>"$log" 2>&1 || say "wheel install failed (see $log)"
    fi
    if [ -f .whl/llama_cpp_cuda_site.tar.xz ]; then
        say "unpacking the carried CUDA build of llama_cpp into $site"
        mkdir -p "$site" && rm -rf "$site/llama_cpp" && tar xJf .whl/llama_cpp_cuda_site.tar.xz -C "$site"
        [ -f .whl/llama_cpp_dist_info.tar.gz ] && tar xzf .whl/llama_cpp_dist_info.tar.gz -C "$site"
    elif [ -d "$site/llama_cpp/lib" ]; then
        # two calls on one warm machine: an earlier one unpacked it (docs/gpu-scenario.md)
        say "using the CUDA build of llama_cpp an earlier call unpacked into $site"
    else
        say "no .whl/llama_cpp_cuda_site.tar.xz: run bench/gpu/wheel.sh here first; stopping"
        exit 2
    fi
    pythonpath="$site:$PWD"
    # libcudart / libcublas (.so.13) live in a Python environment's nvidia/*/lib there.
    libdirs="$(find /opt /usr/local /usr/lib \( -name 'libcublas.so.1*' -o -name 'libcudart.so.1*' \) \
        -printf '%h\n' 2>/dev/null | sort -u | tr '\n' ':')"
    export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
    say "cuda library folders: ${libdirs:-none found}"
fi
export PYTHONPATH="$pythonpath"
lib="$(PYTHONPATH="$pythonpath" "$py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')"
say "llama_cpp libraries: $lib"
if [ -z "$dry" ] && ! "$py" -c "import llama_cpp as l, sys; sys.exit(0 if l.llama_supports_gpu_offload() else 1)" >>"$log" 2>&1; then
    say "llama_cpp has NO GPU offload (see $log); stopping"
    exit 3
fi
"$py" -m native.build 2>&1 | tee -a "$log"

# llama-server: built without CUDA by bench/gpu/server_build.sh, it loads libllama and
# libggml* from llama_cpp's lib folder (the CUDA ones here) through LD_LIBRARY_PATH.
server_args=()
srv_dir=/tmp/mesh-llama-server
if [ -f .whl/llama_server_bin.tar.xz ] || [ -x "$srv_dir/llama-server-bin/llama-server" ]; then
    if [ -f .whl/llama_server_bin.tar.xz ]; then
        rm -rf "$srv_dir" && mkdir -p "$srv_dir" && tar xJf .whl/llama_server_bin.tar.xz -C "$srv_dir"
    fi
    bin="$srv_dir/llama-server-bin/llama-server"
    export LD_LIBRARY_PATH="$srv_dir/llama-server-bin:$lib:${LD_LIBRARY_PATH:-}"
    # on the device it must see the GPU: a CPU llama-server would spend the budget on 8B
    if timeout 60 "$bin" --list-devices >"$out/llama_server_devices.txt" 2>&1 \
        && { [ -n "$dry" ] || grep -q CUDA "$out/llama_server_devices.txt"; }; then
        say "llama-server runs: $(tr '\n' ' ' <"$out/llama_server_devices.txt" | cut -c1-300)"
        server_args=(--llama-server "$bin")
    else
        say "llama-server does not start or sees no CUDA device (see $out/llama_server_devices.txt); mesh rows only"
        ldd "$bin" >>"$out/llama_server_devices.txt" 2>&1
    fi
else
    say "no .whl/llama_server_bin.tar.xz (bench/gpu/server_build.sh): mesh rows only"
fi

# The model: Llama 3.1 8B's geometry, random weights, declaring a 262,144-token trained
# context so P = 128K plus S = 128K private tokens pass mesh's context check (the
# geometry is otherwise exact; a random model has no context quality to lose).
geometry="${GEOMETRY:-llama-3.1-8b}"
weights="${WEIGHTS:-q4_0}"
mdir="${MODEL_DIR:-/tmp/mesh-geometry}"
mkdir -p "$mdir"
if [ -n "$dry" ]; then
    model="$mdir/$geometry-16-$weights.gguf"
    geo_args=(--scale-down 16)
else
    model="$mdir/$geometry-$weights.gguf"
    geo_args=()
fi
if [ ! -f "$model" ]; then
    say "writing $model"
    timeout "$(left)" "$py" -m mesh.sim.geometry "$geometry" "$model.tmp" --type "$weights" \
        --n-ctx-train 262144 "${geo_args[@]}" 2>&1 | tee -a "$log" && mv "$model.tmp" "$model"
fi
[ -f "$model" ] || { say "no model written; stopping"; exit 4; }

if [ -n "$dry" ]; then
    # the same shape, ~64x smaller: budget 16K cells, P = S = budget / 8 (as 128K of 1M)
    scenario=(--kv-budget 16384 --agent-budget 2048 --prefixes 512,2048 --private 128
              --short-private 32 --turns 2 --gen 8 --tool-tokens 32 --task-tokens 32
              --n-batch 512 --cache-ram-mib 256 --min-row-s 5 --reserve-s 60 --dry-run)
else
    scenario=(--kv-budget auto)
fi
t=$(( $(left) - 10 ))
say "python -m bench.gpu_scenario, at most ${t}s"
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 timeout "$t" "$py" -m bench.gpu_scenario --model "$model" --out "$out" \
    --kv-type "${KV_TYPE:-q8_0}" --deadline-s $(( t - 15 )) "${scenario[@]}" \
    "${server_args[@]}" ${SCENARIO_ARGS:-} 2>&1 | tee -a "$log" || say "scenario exit $?"
[ -f "$out/gpu_scenario.json" ] && "$py" -m bench.gpu_scenario.report "$out/gpu_scenario.json" \
    >"$out/gpu_scenario.md"
say "done; results in $out"
