#!/bin/bash
# Issue 51: Marsit against cascading_sign under SGD, loss only, on loopback. As run on
# 2026-12-03 (a clone of 9ffcc41; some scripts ran two at a time, which cannot change the
# bits). lr by family: the compressors take the 'adam' family's rate, SGD's here.
set -u
cd <a clone of 9ffcc41>
ttq() { .venv/bin/python benchmarks/time_to_quality.py --steps 400 --eval-every 25 --seeds 0 --resume "$@"; }
# 2 ranks, SGD with momentum 0.9 at 0.1 (a run at 0.2 was stopped for time, not recorded)
ttq --settings 2x1-loopback --out 2r-sgdm-lr0.1 --methods horovod_fp32,marsit,cascading_sign \
    --lr adam=0.1 --worker-arg=--base-optimizer=sgdm
# 2 ranks, plain SGD (the reconstructed Marsit update) at 1.0; fp32 diverges there, so also at 0.5
ttq --settings 2x1-loopback --out 2r-sgd-lr1.0 --methods horovod_fp32,marsit,cascading_sign \
    --lr adam=1.0 --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0
ttq --settings 2x1-loopback --out 2r-sgd-lr0.5 --methods horovod_fp32 \
    --lr adam=0.5 --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0
# 4 ranks: the sign methods under plain SGD at 1.0, Marsit's hop rule alone, fp32 at its best SGD setting
ttq --settings 4x1-loopback --out 4r-sgd-lr1.0 --methods marsit,cascading_sign \
    --lr adam=1.0 --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0
ttq --settings 4x1-loopback --out 4r-sgd-lr1.0-nocomp --methods marsit \
    --lr adam=1.0 --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0 \
    '--worker-arg=--compression-options={"compensation": false}'
ttq --settings 4x1-loopback --out 4r-sgdm-lr0.1 --methods horovod_fp32 \
    --lr adam=0.1 --worker-arg=--base-optimizer=sgdm
