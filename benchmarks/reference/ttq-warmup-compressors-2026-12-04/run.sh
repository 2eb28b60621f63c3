#!/bin/bash
# Issue 51, 2 hosts, lr 5e-4, warm-up schedule (linear to step 80, cosine to a tenth at 400), seed 0:
# the compressors' loss curves on loopback (deterministic at 2 ranks, so equal to the cluster's),
# against the warm-up fp32 twin of benchmarks/reference/ttq-5e-4-2026-12-03/loss/.
set -u
cd /work/runs/w2/src
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0 --schedule warmup"
O=/work/runs/w2
echo "== loss, warmup, seed 0 $(date)"
$P --settings 2x1-loopback $C --out $O/loss --methods global_qsgd,global_qsgd_exp,ef_sign,qsgd,cascading_sign,marsit,ddp_powersgd,fp16
echo "== done $(date)"
