#!/bin/bash
# Alone on the machine, from a checkout with .venv: ./run.sh OUT
# The compute floor beside Horovod fp32 and global_qsgd, 2 hosts at 1 Gbit/s, three rounds in rotating order.
set -u
PY=.venv/bin/python
O=${1:?OUT}
cd "$(dirname "$0")/../../.."
run() { $PY benchmarks/time_to_quality.py --settings 2x1-1gbit --steps 25 --eval-every 25 --methods "$2" --out "$O/$1" > "$O/$1.log" 2>&1; }
mkdir -p $O
run r1 local,horovod_fp32,global_qsgd
run r2 horovod_fp32,global_qsgd,local
run r3 global_qsgd,local,horovod_fp32

