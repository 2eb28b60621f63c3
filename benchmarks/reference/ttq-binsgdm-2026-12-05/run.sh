#!/bin/bash
# Issue 51: where BinSGDM's gap to Adam comes from (2026-12-05). Losses only: loopback, 2 ranks,
# 400 steps, lr 5e-4. Run from a clone of the repository, with this folder on PYTHONPATH for the
# no-bits rows (nobits.py). The runs were made by several such scripts, some side by side (losses
# do not depend on timing); this one gathers their commands. (--freeze-step, passed to every
# run, is ignored by BinSGDM and by the Horovod fp32 row.)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/runs}
P=".venv/bin/python benchmarks/time_to_quality.py"
W="--settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume"
# The warm-up schedule (80 steps, then a cosine to a tenth) on seeds 1 to 3: Adam and BinSGDM.
$P $W --out $OUT/warmup --seeds 2,1,3 --schedule warmup --methods horovod_fp32,binsgdm
# BinSGDM's rule without the bits (nobits.py), and with b over Adam's memory.
PYTHONPATH=$HERE $P $W --out $OUT/nobits --seeds 2,0 --methods horovod_fp32 \
    --worker-arg=--base-optimizer=nobits:normalised_momentum
PYTHONPATH=$HERE $P $W --out $OUT/nobits-longb --seeds 2,0 --methods horovod_fp32 \
    --worker-arg=--base-optimizer=nobits:normalised_momentum_long_b
# BinSGDM's one beta (default 0.9).
for B in 0.99 0.95 0.8; do
  $P $W --out $OUT/beta$B --seeds 2,0 --methods binsgdm "--worker-arg=--optimizer-options={\"beta\": $B}"
done
$P $W --out $OUT/beta0.8 --seeds 1,3 --methods binsgdm '--worker-arg=--optimizer-options={"beta": 0.8}'
$P $W --out $OUT/beta0.8-warmup --seeds 2 --schedule warmup --methods binsgdm '--worker-arg=--optimizer-options={"beta": 0.8}'
# Then: .venv/bin/python benchmarks/reference/ttq-binsgdm-2026-12-05/binsgdm.py (the tables, the figure).
