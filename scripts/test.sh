#!/usr/bin/env bash
# Install (first time only) with the test extras, then lint, type-check and run the tests.
# The browser test needs Debian's chromium: installed here when it is missing and we are
# root (CI is); elsewhere the test is skipped and pytest prints why (-rs in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test.sh: installing Debian's chromium for the browser test (tests/browser/)" >&2
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
            echo "test.sh: could not install chromium with apt-get; install it" \
                 "(apt-get install chromium) or fix apt, then re-run" >&2
            exit 1
        fi
        command -v chromium >/dev/null 2>&1 || {
            echo "test.sh: apt-get installed chromium but it is not on PATH" >&2; exit 1; }
    else
        echo "test.sh: chromium is missing and we are not root with apt-get: the browser" \
             "test will be skipped (sudo apt-get install chromium to run it)" >&2
    fi
fi
# The PostgreSQL tests (tests/postgres/) start a throwaway server with Debian's initdb and
# pg_ctl (/usr/lib/postgresql/N/bin): installed here when missing and we are root; elsewhere
# those tests fail, saying how to install it (they are never skipped).
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test.sh: installing Debian's postgresql for the task-store tests (tests/postgres/)" >&2
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -qq --no-install-recommends postgresql >/dev/null; }; then
            echo "test.sh: could not install postgresql with apt-get; install it" \
                 "(apt-get install postgresql) or fix apt, then re-run" >&2
            exit 1
        fi
        ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || {
            echo "test.sh: apt-get installed postgresql but initdb is not in" \
                 "/usr/lib/postgresql/*/bin" >&2; exit 1; }
    else
        echo "test.sh: PostgreSQL's initdb is missing and we are not root with apt-get: the" \
             "tests in tests/postgres/ will fail (sudo apt-get install postgresql)" >&2
    fi
fi
bash scripts/install.sh test
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/pytest -q "$@"
