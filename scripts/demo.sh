#!/usr/bin/env bash
# The main job: set up everything (first run builds Horovod), then train the digits MLP
# on 2 ranks for each method and print one comparison table: accuracy, bytes, step time
# and time to 95% test accuracy. As root it runs on an emulated 2-host cluster with
# 1 Gbit/s links (hvd_quant.cluster); elsewhere on loopback, saying so. Extra arguments go
# to examples/compare.py (e.g. --np 3, --framework tf, --epochs 10, --cluster 100mbit).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/bootstrap.sh"
export TF_CPP_MIN_LOG_LEVEL=3 NUMBA_NUM_THREADS=1
# A wider MLP (1024 hidden: 1.2M parameters, 4.8 MB of fp32 gradient per step) so that the
# network, not only the CPU, is part of the step.
exec "$root/.venv/bin/python" "$root/examples/compare.py" --np 2 --epochs 12 --hidden 1024 \
    --cluster 1gbit --out "$root/demo-results.json" "$@" \
    none fp16 ef_sign marsit global_qsgd onebit opt=adam opt=onebit_adam opt=zero_one_adam opt=binsgdm
