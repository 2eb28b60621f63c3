#!/bin/bash
# Issue 55 at 8 hosts x 1 rank on 100 Mbit/s links: every torch.distributed row beside its
# Horovod twin, interleaved, per step (25 steps each; lr 5e-4, seed 0, as the 8-host runs of
# issue 51). 1. the compressors and the fp32 rows (freeze_step irrelevant to them); 2. the 1-bit
# optimizers with freeze_step 10, so that both kinds of step (fp32 round, 1-bit) are timed in
# 25 steps; their 200-step schedule (freeze_step 40) is then priced by kind.
set -u
cd /work/runs/d8/src
P=".venv/bin/python benchmarks/time_to_quality.py"
O=/work/runs/d8
echo "== compressors and fp32 rows, 25 steps, 8x1-100mbit $(date)"
$P --settings 8x1-100mbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 --out $O/step \
  --methods horovod_fp32,ddp_fp32,ddp_fp16,ddp_powersgd,ddp_ef_sign,ef_sign,ddp_marsit,marsit,ddp_global_qsgd,global_qsgd,ddp_onebit,onebit,local
echo "== 1-bit optimizers, 25 steps, freeze_step 10, 8x1-100mbit $(date)"
$P --settings 8x1-100mbit --steps 25 --eval-every 25 --worker-arg=--freeze-step=10 --resume --seeds 0 --out $O/step-optimizers \
  --methods onebit_adam,onebit_adam_dist,zero_one_adam,zero_one_adam_dist,binsgdm,binsgdm_dist
echo "== done $(date)"
