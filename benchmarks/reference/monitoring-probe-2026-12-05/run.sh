#!/bin/bash
# Issue 54, Keras: what a probe step costs, as an fp32 allreduce and as a reduce-scatter,
# 2 emulated hosts at 1 Gbit/s, the protocol of benchmarks/reference/monitoring-2026-12-03/
# (5 rounds of 20 timed steps per row, interleaved with the Horovod fp32 baseline and the
# compute floor). Each argument is a checkout (with .venv) whose rows run, one job after
# the other; the JSON goes to OUT/<checkout's last directory>.json.
#   ./run.sh OUT CHECKOUT...
# Session 1: aa2a344 (allreduce) and b9be3d3 (alltoall); session 2: aa2a344 and 3eac613
# (Horovod's reducescatter; the tree of bd9da13, which was reverted after this run).
set -u
out=$1; shift
for checkout in "$@"; do
  cd "$checkout"
  echo "== $checkout $(git log --oneline | head -1) $(date)"
  .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit --timeout 1800 -- \
    .venv/bin/python benchmarks/keras_bench_worker.py --methods ef_sign,ef_sign@probe10,ef_sign@probe100 \
    --repeats 5 --chunk 20 --out "$out/$(basename "$checkout").json"
done
echo "== done $(date)"
