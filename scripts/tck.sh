#!/usr/bin/env bash
# Run the official A2A conformance suite (a2aproject/a2a-tck, 1.0-dev) at MUST level against
# a `mesh serve` started here on the tiny model, from a pinned commit of the suite.
#
#   scripts/tck.sh /path/to/a2a-tck-checkout [extra run_tck.py args...]
#
# With TCK_SUMMARY=FILE (e.g. bench/tck/results/tck.txt) the run's summary is also written
# there: a header naming the commit and the server's flags, the suite's compatibility
# report, each failure's assertion message, each failed test and the pass/fail/skip counts. If the server died during the
# run, the end of its log is printed (failures after that point are not the suite's).
#
# The checkout must contain commit $TCK_COMMIT (git fetch it first); its Python deps
# (pytest, pytest-asyncio, httpx, grpcio, protobuf, googleapis-common-protos, jsonschema,
# pytest-html, gherkin-official, Jinja2) must be importable by $TCK_PYTHON (default: python3).
# The server runs with --allow-private-push: the suite's push webhook listens on loopback.
# It also runs with --plan never (override with MESH_SERVE_ARGS): the suite's prerequisite
# tasks must reach COMPLETED within its 30 s read timeout, and the tiny random-weight
# model's plans are noise (an `ask` plan ends a task in INPUT_REQUIRED instead).
set -euo pipefail

TCK_COMMIT="${TCK_COMMIT:-357c4a87afa2818731590647cccbea31c31733a2}"  # 1.0-dev, 2026-05-05
TCK_DIR="${1:?usage: scripts/tck.sh /path/to/a2a-tck [run_tck.py args...]}"
shift
TCK_PYTHON="${TCK_PYTHON:-python3}"
MESH="${MESH:-mesh}"
PORT="${TCK_PORT:-8791}"
read -r -a SERVE_ARGS <<<"${MESH_SERVE_ARGS:---plan never}"
WORK="$(mktemp -d)"
SUMMARY="${TCK_SUMMARY:-}"
[ -z "$SUMMARY" ] || SUMMARY="$(realpath -m "$SUMMARY")"
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT

git -C "$TCK_DIR" worktree add --detach "$WORK/tck" "$TCK_COMMIT" >/dev/null

"$MESH" serve --model tiny --port "$PORT" --data-dir "$WORK/data" --allow-private-push \
    --threads 2 "${SERVE_ARGS[@]}" >"$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve.log"; exit 1; }
    sleep 0.5
done

cd "$WORK/tck"
set +e
"$TCK_PYTHON" run_tck.py --sut-host "http://127.0.0.1:$PORT" --level must "$@" \
    2>&1 | tee "$WORK/run.txt"
rc=${PIPESTATUS[0]}
set -e
if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "tck.sh: mesh serve exited during the run; the end of its log:" >&2
    tail -n 60 "$WORK/serve.log" >&2
fi
if [ -n "$SUMMARY" ]; then
    counts="$(grep -E '^[0-9]+ (passed|failed)' "$WORK/run.txt" | tail -n 1)"
    {
        echo "# scripts/tck.sh at TCK commit ${TCK_COMMIT:0:8}, MUST level, against mesh serve" \
            "--model tiny --allow-private-push --threads 2 ${SERVE_ARGS[*]} ($(date -u +%F))"
        echo "# $counts"
        awk '/A2A TCK Compatibility Report/ {on = 1} on {print}
             on && /^═══/ {if (++n == 2) exit}' "$WORK/run.txt"
        echo "Each failure's assertion, in run order:"
        grep -E '^E +AssertionError' "$WORK/run.txt" || true
        grep -E '^FAILED tests/' "$WORK/run.txt" || true
        echo "$counts"
    } >"$SUMMARY"
fi
git -C "$TCK_DIR" worktree remove --force "$WORK/tck" >/dev/null 2>&1 || true
exit "$rc"
