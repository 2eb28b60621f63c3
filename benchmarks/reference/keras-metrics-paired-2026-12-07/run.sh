#!/bin/bash
# Issue 54: what metrics and probes cost in Keras, each row against a metrics-off twin
# (ef_sign) run next to it in every round (keras_bench_worker.py --paired), 2 emulated
# hosts at 1 Gbit/s, alone on the machine. ef_sign: (the same setting as the twin, a
# second label) is the control: it shows what two identical rows differ by.
#   ./run.sh OUT
set -u
OUT=${1:?OUT}
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
mkdir -p "$OUT"
.venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit --timeout 2400 -- \
    .venv/bin/python benchmarks/keras_bench_worker.py --paired ef_sign \
    --methods ef_sign@probe0,ef_sign@probe100,ef_sign@pyfunc,ef_sign: \
    --repeats 10 --chunk 10 --out "$OUT/paired.json" > "$OUT/paired.log" 2>&1
.venv/bin/python "$here/paired_cost.py" "$OUT/paired.json" > "$OUT/tables.txt"
