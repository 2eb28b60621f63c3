#!/bin/bash
# Issue 51, 2026-12-06: what takes ef_sign's gap with Adam down, on the time-to-quality
# benchmark's own model (7.37M parameters), lr 5e-4, constant, seed 0, 400 steps, 2 ranks on
# loopback (losses do not depend on the link). The variants are in
# benchmarks/ttq_gap_variants.py. Run from the repository root; each variant's JSON lands in
# <variant>/2x1-loopback/ef_sign_s0_constant.json. The fp32 twin and plain ef_sign are the 5e-4
# matrix's (benchmarks/reference/ttq-5e-4-2026-12-03/loss/2x1-loopback/).
set -eu
D=benchmarks/reference/ttq-gap-precond-2026-12-06
P=".venv/bin/python benchmarks/time_to_quality.py"
C="--steps 400 --eval-every 25 --worker-arg=--freeze-step=80 --resume --settings 2x1-loopback --seeds 0"
for v in ef_sign_precond10 ef_sign_precond50 ef_sign_exact10 ef_sign_precond10_noef \
         ef_sign_precond50_noef ef_sign_noef ef_sign_precond10f3 ef_sign_precond10f3_noef \
         ef_sign_exact10_noef; do
  $P $C --worker-arg=--import=ttq_gap_variants --out $D/$v --methods ef_sign --worker-arg=--compressor=$v
done
$P $C --out $D/marsit_nocomp --methods marsit '--worker-arg=--compression-options={"compensation":false}'
.venv/bin/python $D/table.py
