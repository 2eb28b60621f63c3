#!/bin/bash
# Issue 51: the 2-rank plain-SGD rows of ../ttq-sgd-2026-12-03/2r-sgd-lr1.0/ (marsit and
# cascading_sign, lr 1.0, 400 steps, seed 0) at the default buckets of 2026-12-07, loss only on
# loopback, after the 4-rank rows of run.sh. Run from a clone of the commit under test.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
O=${O:-/work/main/benchmarks/reference/ttq-sgd-defaults-2026-12-07}
git log --oneline -1
echo "== loss, 2x1 loopback, plain SGD at 1.0 $(date)"
$P --steps 400 --eval-every 25 --seeds 0 --resume --settings 2x1-loopback --out $O/2r-sgd-lr1.0 \
    --methods marsit,cascading_sign --lr adam=1.0 --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0
echo "== done $(date)"
