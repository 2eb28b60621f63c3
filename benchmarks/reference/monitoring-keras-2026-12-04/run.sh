#!/bin/bash
# Issue 54, Keras: what metrics=True costs, before and after the py_function change, same session,
# 2 emulated hosts at 1 Gbit/s, the protocol of benchmarks/reference/monitoring-2026-12-03/.
set -u

for side in before after; do
  cd /work/runs/kpf/$side
  M=ef_sign,ef_sign@pyfunc,ef_sign@probe0
  [ $side = after ] && M=$M,ef_sign@probe100
  echo "== $side $(git log --oneline | head -1) $(date)"
  .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit --timeout 1800 -- \
    .venv/bin/python benchmarks/keras_bench_worker.py --methods $M --repeats 5 --chunk 20 --out /work/runs/kpf/$side.json
done
echo "== done $(date)"
