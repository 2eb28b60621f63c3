#!/usr/bin/env bash
# Set up everything (the first run builds Horovod), then run the tests.
#
#   ./scripts/test.sh            the quick tier (10 minutes at most): every single-process unit and
#                                oracle test but the few marked "full", plus the multi-process runs
#                                of every compressor and 1-bit optimizer (torch at 2 and 3 ranks, TF
#                                at 3) and the cheap emulated-cluster tests (tests marked "quick")
#   ./scripts/test.sh --full     everything (what CI runs: .ci/run), the documented-commands check,
#                                the container tests and the GPU kernels under Triton's interpreter
#                                included
#
# Other arguments go to pytest (e.g. -k marsit, -x, or -m "not multiprocess" for the
# single-process part only; a -m of yours replaces the tier's).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tier=quick
args=()
for a in "$@"; do
    case "$a" in
        --full) tier=full ;;
        --quick) tier=quick ;;
        *) args+=("$a") ;;
    esac
done
# --with-triton: the GPU kernels' tests (full tier) run them under Triton's interpreter (no GPU
# needed); the quick tier has none, so it does not install Triton's 1 GB.
if [ "$tier" = full ]; then
    "$root/scripts/bootstrap.sh" --with-triton
else
    "$root/scripts/bootstrap.sh"
fi
cd "$root"
export TF_CPP_MIN_LOG_LEVEL=3
# The documented-commands check (full tier) starts at collection and runs beside the
# single-process tests, which run first; the tests that launch processes come after it
# (tests/conftest.py).
export HVD_QUANT_DOCS_CHECK_EARLY=1
if [ "$tier" = quick ]; then
    echo "[test] quick tier (./scripts/test.sh --full runs everything)"
    exec "$root/.venv/bin/python" -m pytest -m "quick or not (multiprocess or cluster or slow or full)" "${args[@]}"
fi
echo "[test] full tier"
# The slowest tests, listed at the end: what to look at when the tier nears CI's budget.
exec "$root/.venv/bin/python" -m pytest --durations=30 "${args[@]}"
