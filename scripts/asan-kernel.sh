#!/usr/bin/env bash
# The cpu_decode kernel's tests under AddressSanitizer: every build the tests load (native and
# amx-emulated, whose tile loads and stores are memcpy calls ASan sees) is compiled with
# -fsanitize=address (ATTNBENCH_CPU_DECODE_SANITIZE=address), the sanitizer's runtime is preloaded
# into the Python process that loads the libraries, and the kernel's tests run in that one process.
# A heap read or write past a buffer — a scratch buffer (allocated at its exact size under ASan),
# q, the cache's pages or scales — stops the run with ASan's report and a non-zero exit.
#
#   bash scripts/asan-kernel.sh                  # the kernel tests; exit 0 only when ASan is silent
#   bash scripts/asan-kernel.sh --plant fp8      # the same tree with an off-by-one read planted in
#   bash scripts/asan-kernel.sh --plant latent   #   an AMX item; exit 0 only when ASan reports it
#   bash scripts/asan-kernel.sh -- -k variants   # pytest arguments after --
#
# Leak checking is off (Python and torch keep their allocations to the end); CI runs the first form
# (.ci/run). Needs gcc's or clang's libasan.so (gcc -print-file-name=libasan.so).
set -euo pipefail
cd "$(dirname "$0")/.."

plant=""
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --plant)
            plant="${2:-}"
            shift 2 || { echo "--plant needs a value: fp8 or latent" >&2; exit 2; }
            case "$plant" in
                fp8 | latent) ;;
                *) echo "--plant $plant: expected fp8 or latent" >&2; exit 2 ;;
            esac
            ;;
        --)
            shift
            pytest_args=("$@")
            break
            ;;
        -h | --help)
            sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

cc="${CC:-cc}"
libasan="$("$cc" -print-file-name=libasan.so)"
libstdcxx="$("$cc" -print-file-name=libstdc++.so.6)"
if [ ! -e "$libasan" ]; then
    echo "$cc has no AddressSanitizer runtime (libasan.so): install gcc's (libasan) or use CC=clang" >&2
    exit 2
fi

work="$(mktemp -d -t attnbench-asan.XXXXXX)"
trap 'rm -rf "$work"' EXIT
tests=(tests/backends/test_cpu_decode.py tests/backends/test_cpu_decode_fp8.py
    tests/backends/test_cpu_decode_mla.py tests/backends/test_cpu_decode_scratch.py)
if [ -n "$plant" ]; then
    # a copy of the source tree with one line changed: an off-by-one read the tests' shapes reach, in
    # the file of the tree that holds that form's items
    cp -r backends/csrc "$work/csrc"
    python - "$work/csrc" "$plant" <<'PY'
import sys
from pathlib import Path
tree, plant = Path(sys.argv[1]), sys.argv[2]
edits = {
    # the AMX fp8 item's q tile: each head's row read from 64 bytes on (the last head's runs past q)
    "fp8": ("decode_fp8.h", "_tile_loadd(4, (const char *)it->q + k * 64, D * 2);",
            "_tile_loadd(4, (const char *)it->q + (k + 1) * 64, D * 2);"),
    # the latent items' Q^T: one head past the sequence's last (the last sequence's runs past q)
    "latent": ("decode_latent.h", "if (h < H) v = q[(size_t)h * Dk + 2 * r]",
               "if (h <= H) v = q[(size_t)h * Dk + 2 * r]"),
}
name, old, new = edits[plant]
src = (tree / name).read_text()
if src.count(old) != 1:
    sys.exit(f"the plant {plant!r} no longer matches one line of csrc/{name}: update scripts/asan-kernel.sh")
(tree / name).write_text(src.replace(old, new))
PY
    export ATTNBENCH_CPU_DECODE_SOURCE_DIR="$work/csrc"
    if [ "$plant" = fp8 ]; then
        tests=(tests/backends/test_cpu_decode_fp8.py -k "AmxEmulated and gate")
    else
        tests=(tests/backends/test_cpu_decode_mla.py -k "AmxEmulated and gate")
    fi
fi

export ATTNBENCH_CPU_DECODE_SANITIZE=address
export ATTNBENCH_REQUIRE_CPU_DECODE=1
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# the libraries are built first, without the runtime preloaded (the compiler need not run under it)
python -c 'from attnbench.backends.cpu_kernel import BUILDS, build_library
for b in BUILDS: print(f"asan-kernel: {b} build at {build_library(b)}")'
log="$work/pytest.log"
set +e
# --capture=sys: ASan writes its report to file descriptor 2, which pytest's default capture would
# hold until the test ends: the process ends first
# libstdc++ beside the runtime: ASan's __cxa_throw interceptor needs it loaded when ASan starts, or
# the first C++ exception torch throws (and Python catches) stops the process
LD_PRELOAD="$libasan:$libstdcxx${LD_PRELOAD:+:$LD_PRELOAD}" python -m pytest -p no:xdist -p no:cacheprovider -q \
    --capture=sys "${tests[@]}" "${pytest_args[@]}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
reported=0
grep -q "ERROR: AddressSanitizer" "$log" && reported=1
if [ -n "$plant" ]; then
    if [ "$reported" = 1 ]; then
        echo "asan-kernel: the planted $plant read was reported (exit $rc)"
        exit 0
    fi
    echo "asan-kernel: the planted $plant read was NOT reported (pytest exit $rc)" >&2
    exit 1
fi
if [ "$reported" = 1 ]; then
    echo "asan-kernel: AddressSanitizer reported a memory error (above)" >&2
    exit 1
fi
exit "$rc"
