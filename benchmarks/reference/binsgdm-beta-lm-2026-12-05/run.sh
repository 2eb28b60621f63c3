#!/bin/bash
# Issue 51: BinSGDM's beta 0.8 on a second workload, the convergence page's byte-level LM
# (examples/lm_torch.py, 438k parameters, 600 steps, cosine schedule with a 150-step
# warm-up), at its default lr 1e-3 and at 3e-3, 2 and 3 ranks, beside the default beta 0.9.
set -u
cd "${1:-.}"
echo "== $(git log --oneline | head -1) $(date)"
.venv/bin/python benchmarks/convergence.py --workloads lm_torch --np 2 3 --optimizers binsgdm \
  --variant "binsgdm+beta0.8=--beta 0.8" --variant "binsgdm+lr3e-3=--lr 3e-3" \
  --variant "binsgdm+lr3e-3,beta0.8=--lr 3e-3 --beta 0.8" --out "${2:-conv.json}"
echo "== done $(date)"
