#!/usr/bin/env bash
# The project's test command (README and .ci/run): start a private PostgreSQL for the fleet tests,
# then run pytest with any arguments given. Where PostgreSQL cannot be had (no package, not root),
# the fleet tests are skipped with that reason and everything else runs.
#
# The tests run in ATTNBENCH_TEST_WORKERS pytest-xdist processes (default 2; 1 runs them in this
# process), a test file per process (--dist loadfile: a module's fixtures are made once). Much of the
# suite waits on single-threaded work (the Triton interpreter, child processes importing torch), so
# two processes finish it in about half the time on a 2-core machine. No test times a speed target
# (benchmarks do, on a quiet machine). A test that crashes its process or outlives the per-test
# timeout (pyproject.toml: 900 s, the thread method, so a test stuck in C code is ended too) fails the
# run at once with its name.
set -euo pipefail
cd "$(dirname "$0")/.."

workers="${ATTNBENCH_TEST_WORKERS:-2}"
case "$workers" in
    '' | *[!0-9]* | 0)
        echo "ATTNBENCH_TEST_WORKERS=$workers: expected a whole number of processes, 1 or more" >&2
        exit 2
        ;;
esac
if [ "$workers" -gt 1 ] && ! python -c "import xdist" 2>/dev/null; then
    echo "ATTNBENCH_TEST_WORKERS=$workers needs pytest-xdist, which this environment lacks:" \
        "install the test extra again (pip install -e \".[test]\") or set ATTNBENCH_TEST_WORKERS=1" >&2
    exit 2
fi

if bash scripts/postgres.sh install; then
    pg_dir="$(mktemp -d -t attnbench-pg.XXXXXX)"
    trap 'bash scripts/postgres.sh stop "$pg_dir" || true; rm -rf "$pg_dir"' EXIT
    if url="$(bash scripts/postgres.sh start "$pg_dir")"; then
        export ATTNBENCH_TEST_POSTGRES="$url"
        echo "PostgreSQL for the fleet tests: $url"
    else
        export ATTNBENCH_TEST_POSTGRES_UNAVAILABLE="the PostgreSQL server did not start (see scripts/postgres.sh)"
    fi
else
    export ATTNBENCH_TEST_POSTGRES_UNAVAILABLE="PostgreSQL is not installed and could not be installed here"
fi
if [ "$workers" -gt 1 ]; then
    # --max-worker-restart=0: a worker that crashes (a segfault in a kernel, or pytest-timeout's
    # per-test limit, which ends a hung test's process: pyproject's timeout and timeout_method) fails
    # the run with the test's name; it is not replaced, so its test file is not run again and again
    python -m pytest -n "$workers" --dist loadfile --max-worker-restart=0 "$@"
else
    python -m pytest "$@"
fi
