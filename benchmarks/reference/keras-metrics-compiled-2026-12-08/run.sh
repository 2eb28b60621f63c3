#!/bin/bash
# Issue 54: what Keras metrics cost once the reduction stays compiled and the graph times
# its own collectives (probe steps alone run the eager code), each row against a
# metrics-off twin (ef_sign) run next to it in every round (keras_bench_worker.py
# --paired), 2 emulated hosts at 1 Gbit/s, alone on the machine; two jobs, one after the
# other (the second without the probe row). ef_sign: (the twin's own setting under a
# second label) is the control.
#   ./run.sh OUT
set -u
OUT=${1:?OUT}
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
mkdir -p "$OUT"
job() {  # NAME ROWS
    .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit --timeout 2400 -- \
        .venv/bin/python benchmarks/keras_bench_worker.py --paired ef_sign --methods "$2" \
        --repeats 10 --chunk 10 --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
}
job paired ef_sign@probe0,ef_sign@probe100,ef_sign:
job paired2 ef_sign@probe0,ef_sign:
for job in paired paired2; do
    .venv/bin/python "$here/../keras-metrics-paired-2026-12-07/paired_cost.py" "$OUT/$job.json"
done > "$OUT/tables.txt"
