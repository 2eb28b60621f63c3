#!/usr/bin/env bash
# Set up everything (first run builds Horovod), then run the whole test suite: unit tests
# against the numpy oracle and multi-process tests under horovodrun --gloo (2, 3, 4 ranks).
# Extra arguments go to pytest (e.g. -m "not multiprocess" for the fast part only).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/bootstrap.sh"
"$root/.venv/bin/horovodrun" --check-build 2>/dev/null | grep -E '\[X\] (TensorFlow|PyTorch|Gloo)'
cd "$root"
export TF_CPP_MIN_LOG_LEVEL=3
exec "$root/.venv/bin/python" -m pytest "$@"
