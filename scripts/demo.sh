#!/usr/bin/env bash
# The main job: set up everything (first run builds Horovod), then train the digits MLP
# on 2 ranks for each method and print one comparison table: accuracy, bytes and
# communication rounds per step, wall-clock time per step and training time to 95% test
# accuracy, for plain Horovod (fp32 allreduce) against hvd_quant's compressors and 1-bit
# optimizers. As root it runs on an emulated 2-host cluster with 1 Gbit/s links
# (hvd_quant.cluster: network namespaces, tbf-shaped veth links; no added delay); where
# that cannot be made (not root, no ip/tc) it runs on loopback and says so.
#
# About 8 minutes on 2 cores. Progress goes to the terminal; the table (markdown), a
# plot and the raw results go to benchmarks/results/demo.{md,png,json} (and demo.log).
# Extra arguments go to examples/compare.py (e.g. --np 3, --framework tf, --epochs 6,
# --cluster 100mbit); later options win.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/bootstrap.sh"
export TF_CPP_MIN_LOG_LEVEL=3 NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1
out="$root/benchmarks/results"
mkdir -p "$out"
# A wider MLP (1024 hidden units: 132k parameters, 0.53 MB of fp32 gradient per step, about
# 4 ms on a 1 Gbit/s link) so that the network is part of the step; on 2 shared cores the
# CPU still dominates, which the table shows honestly.
configs=(horovod fp16 ef_sign marsit global_qsgd onebit opt=adam opt=onebit_adam opt=zero_one_adam opt=binsgdm)
"$root/.venv/bin/python" "$root/examples/compare.py" --np 2 --epochs 12 --hidden 1024 \
    --cluster 1gbit --out "$out/demo.json" --plot "$out/demo.png" "$@" "${configs[@]}" \
    2>&1 | tee "$out/demo.log"
status=${PIPESTATUS[0]}
# The table alone, for pasting.
sed -n '/^| config /,/^$/p' "$out/demo.log" | sed '/^$/d' >"$out/demo.md" || true
echo "results: $out/demo.md, $out/demo.png, $out/demo.json, $out/demo.log"
exit "$status"
