#!/bin/bash
# Issue 51, 2026-12-06: qsgd and global_qsgd with one norm per block of 512 elements instead
# of one per fused buffer (diagnostic variants in benchmarks/ttq_gap_variants.py). Run from
# the repository root. Losses only, on loopback (they do not depend on the link).
set -eu
D=benchmarks/reference/ttq-qsgd-block-2026-12-06
P=".venv/bin/python benchmarks/time_to_quality.py"
V="--worker-arg=--import=ttq_gap_variants --resume"
$P --settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --seeds 0,2,3 $V \
   --out $D/qsgd_block512 --methods qsgd --worker-arg=--compressor=qsgd_block512
$P --settings 8x1-loopback --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --seeds 0 $V \
   --out $D/global_qsgd_block512 --methods global_qsgd --worker-arg=--compressor=global_qsgd_block512
.venv/bin/python $D/table.py
