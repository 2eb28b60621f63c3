#!/usr/bin/env bash
# The main job: set up everything (first run builds Horovod), then train the digits MLP on
# 2 ranks once per method and print one comparison table: accuracy, bytes and communication
# rounds per step, time per step and training time to 95% test accuracy, for plain Horovod
# (fp32 allreduce) and torch DDP with PowerSGD against hvd_quant's compressors and 1-bit
# optimizers. As root it runs on an emulated cluster of 2 hosts with 100 Mbit/s links
# (hvd_quant.cluster: network namespaces, tbf-shaped veth links, each host on its own share
# of the CPUs); where that cannot be made (not root, no ip/tc) it runs on loopback and says so.
#
# Every run uses the library's defaults: no thread or environment settings (each rank sets
# torch's threads to hvd_quant.threads_per_rank(), as docs/guide/tuning.md recommends).
#
# About 1 min 40 s on 2 cores after set-up. Progress goes to the terminal; the table
# (markdown), a plot and the raw results go to benchmarks/results/demo.{md,png,json} (and
# demo.log). Extra arguments go to examples/compare.py (e.g. --np 3, --framework tf,
# --epochs 20, --cluster 1gbit, --configs horovod,ef_sign for fewer runs); later options win.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/bootstrap.sh"
export TF_CPP_MIN_LOG_LEVEL=3
out="$root/benchmarks/results"
mkdir -p "$out"
# The MLP with 1024 hidden units: 132k parameters, 0.53 MB of fp32 gradient per step, about
# 45 ms of a 100 Mbit/s link for Horovod's ring against a few ms of compute: the network
# is most of the step, as for a large model on a slow network.
configs=(horovod ddp_powersgd ef_sign marsit global_qsgd onebit opt=adam opt=onebit_adam opt=zero_one_adam
         opt=binsgdm)
if [[ " $* " == *" --framework tf "* ]]; then
    configs=(horovod ef_sign marsit global_qsgd onebit opt=adam opt=onebit_adam opt=zero_one_adam opt=binsgdm)
fi
"$root/.venv/bin/python" "$root/examples/compare.py" --np 2 --epochs 12 --hidden 1024 \
    --cluster 100mbit --out "$out/demo.json" --plot "$out/demo.png" "$@" "${configs[@]}" \
    2>&1 | tee "$out/demo.log"
status=${PIPESTATUS[0]}
# The table alone, for pasting.
sed -n '/^| config /,/^$/p' "$out/demo.log" | sed '/^$/d' >"$out/demo.md" || true
echo "results: $out/demo.md, $out/demo.png, $out/demo.log, $out/demo.json"
exit "$status"
