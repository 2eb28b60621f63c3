#!/bin/bash
# For time: the warm-up schedule's compressor rows (global_qsgd, ef_sign) are cut when they begin.
until grep -q "2x1-loopback global_qsgd s0 warmup (" /work/runs/m57/run.log; do sleep 5; done
echo "cut at $(date)"
pkill -f "time_to_quality.py --settings 2x1-loopback .*--schedule warmup"
sleep 2
pkill -f "ttq_worker.py.*warmup"; pkill -f "horovodrun.*warmup"
sleep 5; pgrep -af "ttq_worker|horovodrun" | head
