#!/bin/bash
# Alone on the machine, from a checkout with .venv: ./collectives.sh OUT LABEL
set -eu
OUT=${1:?OUT}; LABEL=${2:?LABEL}
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
for fw in torch tf; do
    .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- \
        .venv/bin/python benchmarks/reference/gloo-recv-first-2026-12-07/collectives.py $fw 2>&1 \
        | grep -v response_cache | tee "$OUT/collectives-$fw-$LABEL.txt"
done
