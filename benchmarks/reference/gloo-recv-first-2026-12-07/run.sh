#!/bin/bash
# Issue 54: Gloo's alltoall and allgather with each receive posted first (Fix 10 of
# scripts/build_horovod.sh, Horovod wheel p7) against as released (p6), 2 emulated hosts at
# 1 Gbit/s, alone on the machine, in one session: p7, then p6, then p7 again.
#   ./run.sh OUT
# Each part: the collectives (collectives.sh), the time-to-quality LM's first 25 steps
# with the methods that allgather (qsgd, ef_sign) beside two that do not, and (p7, then
# p6) Keras's probe cost by the protocol of ../monitoring-probe-2026-12-05/.
set -u
OUT=${1:?OUT}
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
wheels=${HVD_QUANT_CACHE:-$HOME/.cache/hvd_quant}/wheels
use() { .venv/bin/python -m pip install --quiet --no-deps --force-reinstall \
            "$wheels"/horovod-0.28.1-cp311-torch2.13.0-tf2.21.0-gloo-mpi-"$1"/horovod-*.whl; }
ttq() { .venv/bin/python benchmarks/time_to_quality.py --settings 2x1-1gbit --steps 25 --eval-every 25 \
            --methods horovod_fp32,qsgd,ef_sign,global_qsgd --out "$OUT/ttq-$1" > "$OUT/ttq-$1.log" 2>&1; }
keras() { .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 1gbit --timeout 1800 -- \
            .venv/bin/python benchmarks/keras_bench_worker.py --methods ef_sign,ef_sign@probe10,ef_sign@probe100 \
            --repeats 5 --chunk 20 --out "$OUT/keras-$1.json" > "$OUT/keras-$1.log" 2>&1; }
part() {  # wheel label keras?
    echo "== $2 (Horovod $1) $(date)"
    use "$1"
    "$here/collectives.sh" "$OUT" "$2" > /dev/null 2>&1
    ttq "$2"
    [ "$3" = 1 ] && keras "$2"
}
part p7 p7a 1
part p6 p6b 1
part p7 p7b 0
echo "== done $(date)"
