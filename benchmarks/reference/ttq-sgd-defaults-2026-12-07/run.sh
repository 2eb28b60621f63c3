#!/bin/bash
# Issue 51: Marsit against cascading_sign under plain SGD (Marsit's own setting), at the default
# buckets of 2026-12-07 (five of this model; two 25 MB buckets in ../ttq-sgd-2026-12-03/), loss
# only on loopback (deterministic), lr 1.0, 400 steps, seed 0, as there. fp32's SGD rows are
# Horovod's (no buckets): that folder's stand. Part 1 (4 ranks) ran first; part 2 (2 ranks)
# was added after it, as its own script with the same commands (run.log holds both).
# Run from a clone of the commit under test, with the main .venv.
set -u
P="/work/main/.venv/bin/python benchmarks/time_to_quality.py"
O=${O:-/work/main/benchmarks/reference/ttq-sgd-defaults-2026-12-07}
sgd() {  # sgd RANKS: both sign methods under plain SGD at lr 1.0 on RANKS loopback ranks
    git log --oneline -1
    echo "== loss, $1x1 loopback, plain SGD at 1.0 $(date)"
    $P --steps 400 --eval-every 25 --seeds 0 --resume --settings "$1x1-loopback" --out "$O/$1r-sgd-lr1.0" \
        --methods marsit,cascading_sign --lr adam=1.0 --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0
    echo "== done $(date)"
}
sgd 4   # 1.
sgd 2   # 2. (added after 1)
