#!/bin/bash
# Alone on the machine, from a checkout with .venv: ./run.sh OUT
set -eu
OUT=${1:?OUT}
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
for fw in torch tf; do
    echo "== collectives $fw $(date)"
    .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- \
        .venv/bin/python benchmarks/reference/alltoall-pieces-2026-12-06/collectives.py $fw 2>&1 \
        | grep -v response_cache | tee "$OUT/collectives-$fw.txt"
done
echo "== probe cost $(date)"
.venv/bin/python benchmarks/reference/alltoall-pieces-2026-12-06/probe_cost.py "$OUT/probe" 2>&1 | tee "$OUT/probe_cost.log"
echo "== done $(date)"
