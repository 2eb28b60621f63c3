#!/bin/bash
# Issue 51, 2026-12-06: the library's global_qsgd with block=512 (one shared scale per block of
# 512 elements), against the diagnostic variant global_qsgd_block512 of ../ttq-qsgd-block-2026-12-06/
# and the one-scale global_qsgd. Run from the repository root. Losses on loopback first (they do
# not depend on the link), then, alone on the machine, step times on the emulated clusters.
set -eu
D=benchmarks/reference/ttq-global-qsgd-block-2026-12-06
P=".venv/bin/python benchmarks/time_to_quality.py"
O='--worker-arg=--compression-options={"block":512}'  # given explicitly: the default was None then
# 8 hosts, 200 steps, seed 0 (the setting where one scale ended +6.9% above fp32).
$P --settings 8x1-loopback --steps 200 --eval-every 25 --worker-arg=--freeze-step=40 --resume --seeds 0 \
   --out $D/loss --methods global_qsgd "$O"
# 2 hosts, 400 steps, seeds 0, 2 and 3 (one scale: +0.6/+2.8/+1.0%).
$P --settings 2x1-loopback --steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --seeds 0,2,3 \
   --out $D/loss --methods global_qsgd "$O"
