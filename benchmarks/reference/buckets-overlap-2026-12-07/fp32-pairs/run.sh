#!/bin/bash
# After the default changed: hvd_quant's fp32 path (`none`, default buckets, no option) against
# Horovod's own fp32 DistributedOptimizer, 2 hosts at 1 Gbit/s, six pairs in alternating order.
set -u
cd /work/main
O=/work/runs/fp32pairs
one() { .venv/bin/python benchmarks/time_to_quality.py --settings 2x1-1gbit --steps 400 --eval-every 100 \
          --seeds 0 --worker-arg=--stop-after=30 --out $O/p$1/$2 --methods $2; }
one 1 horovod_fp32; one 1 none
one 2 none; one 2 horovod_fp32
one 3 horovod_fp32; one 3 none
one 4 none; one 4 horovod_fp32
one 5 horovod_fp32; one 5 none
one 6 none; one 6 horovod_fp32
echo "== done $(date)"
