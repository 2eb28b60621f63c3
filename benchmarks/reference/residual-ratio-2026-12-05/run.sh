#!/bin/bash
# Issue 54: the error-feedback residual ratio in healthy training (SGD, the methods' papers'
# setting) and in unhealthy training (Adam) of the time-to-quality LM, a probe every 10 steps.
# Losses and probes only (loopback, 2 ranks, 400 steps, seed 0). Run from a clone of the repository.
set -u
P=".venv/bin/python benchmarks/time_to_quality.py"
W="--settings 2x1-loopback --steps 400 --eval-every 25 --resume --worker-arg=--record-probes"
PR='--worker-arg=--optimizer-options={"probe_every": 10}'
$P $W "$PR" --out sgd --methods ef_sign,marsit --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0 --worker-arg=--lr=1.0
$P $W "$PR" --out adam --methods ef_sign,marsit
# Do probes change bits? The same SGD marsit run without probes, 25 steps (its validation loss
# at step 25 equals the probed run's: 4.798714637756348).
$P --settings 2x1-loopback --steps 25 --eval-every 25 --out noprobe25 --methods marsit \
    --worker-arg=--base-optimizer=sgdm --worker-arg=--momentum=0 --worker-arg=--lr=1.0
