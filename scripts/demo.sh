#!/usr/bin/env bash
# The main job: set up everything (first run builds Horovod), then train the PyTorch
# example on 2 ranks with horovodrun for each compressor and print one comparison table.
# Extra arguments go to examples/compare.py (e.g. --np 3, --framework tf, --epochs 10).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/bootstrap.sh"
export TF_CPP_MIN_LOG_LEVEL=3
exec "$root/.venv/bin/python" "$root/examples/compare.py" --np 2 --epochs 30 "$@" \
    none fp16 ef_sign marsit global_qsgd "global_qsgd:norm=l2" global_qsgd_exp
