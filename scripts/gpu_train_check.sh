#!/usr/bin/env bash
# The GPU check's training job: 2 Horovod ranks on the one GPU over Gloo, training the LM
# with every compressor and 1-bit optimizer (benchmarks/gpu_train.py). On a machine without
# Horovod (the GPU machine we test on has none, and no network), Horovod is built first,
# torch only, from the source distribution carried in .gpu_carry/, with
# scripts/build_horovod.sh.
#
#   scripts/gpu_train_check.sh --fetch          # here, with network: fill .gpu_carry/ (3.9 MB)
#   scripts/gpu_train_check.sh OUTDIR           # on the GPU machine: build if needed, run the job
#   scripts/gpu_train_check.sh OUTDIR --cpu     # the same job on the CPU with a tiny model
#   scripts/gpu_train_check.sh OUTDIR -- --methods ef_sign --steps 4   # arguments for the job
#   scripts/gpu_train_check.sh OUTDIR --build-only   # only install or build Horovod (gpu_check.sh
#                                                    # runs this in the background from its start)
#   scripts/gpu_train_check.sh OUTDIR --nccl [--build-only]   # issue 56: Horovod built with NCCL
#       (HOROVOD_GPU_OPERATIONS=NCCL, build_horovod.sh's nccl_env) into a folder of its own, and
#       the job at 1 rank (NCCL refuses two ranks on one GPU): every method's GPU tensors go to
#       Horovod directly, each step's bits against the CPU twin, as the staged job's are
#
# Writes OUTDIR/gpu_train.json, OUTDIR/gpu_train.md and OUTDIR/gpu_train.log. When it
# built Horovod, also OUTDIR/horovod-build.log and the wheel it built, cut into parts of at
# most 15 MiB (OUTDIR/horovod-wheel.part-*, with its file name in horovod-wheel.name):
# `cat horovod-wheel.part-* > .gpu_carry/$(cat horovod-wheel.name)` carries it to the
# next run, which then installs it instead of building (seconds instead of minutes).
# Time limits, in seconds: HVD_QUANT_GPU_BUILD_S for the build (default 300),
# HVD_QUANT_GPU_TRAIN_S for the job (default 240). Exit status: the job's (124 when a
# limit was reached).
#
# HVD_QUANT_GPU_CLUSTER_RATES="1gbit 10gbit" (default: none) also times the methods (no
# bit checks) with each rank in an emulated host of its own, linked at that rate
# (python -m hvd_quant.cluster: network namespaces, root), into OUTDIR/cluster-RATE/, each
# under the job's time limit; a machine without namespaces says so in OUTDIR/gpu_train.md.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
carry="$root/.gpu_carry"
PY=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
# Build-time needs of Horovod's setup.py that the GPU machine's image lacks (cffi and its
# pycparser; cloudpickle, psutil, pyyaml, packaging, cmake are there), for its Python 3.12.
CFFI=cffi==2.0.0
PYCPARSER=pycparser==2.23

if [ "${1:-}" = --fetch ]; then
    mkdir -p "$carry"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$carry" "horovod==$HOROVOD_VERSION"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$carry" "$CFFI" "$PYCPARSER"
    ls -l "$carry"
    exit 0
fi

out=${1:?usage: scripts/gpu_train_check.sh OUTDIR [--nccl] [--build-only | --cpu] [-- job arguments] | --fetch}
shift
job=(--out "$out")
build_only=0
nccl=0
if [ "${1:-}" = --nccl ]; then
    nccl=1
    shift
fi
if [ "${1:-}" = --build-only ]; then
    build_only=1
    shift
fi
if [ "${1:-}" = --cpu ]; then
    job+=(--device cpu --size tiny --bits-steps 3 --warmup 2 --steps 3)
    shift
fi
if [ "${1:-}" = -- ]; then
    shift
    job+=("$@")
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
job[1]=$out
cd "$root"  # python -m hvd_quant.cluster finds this checkout's hvd_quant
log="$out/gpu_train.log"
say() { echo "[gpu_train_check] $*" | tee -a "$log"; }

# The Horovod this job runs with: the active Python's, or (--nccl) the NCCL build's folder.
build_env=(HVD_QUANT_HOROVOD_CUDA=0)
ranks=2
wants="import horovod.torch"
if [ "$nccl" = 1 ]; then
    nccl_site=${TMPDIR:-/tmp}/hvd_quant_horovod_nccl
    export PYTHONPATH="$nccl_site${PYTHONPATH:+:$PYTHONPATH}"
    build_env=(HVD_QUANT_HOROVOD_CUDA=nccl HVD_QUANT_HOROVOD_TARGET="$nccl_site"
               HVD_QUANT_CACHE="${TMPDIR:-/tmp}/hvd_quant_cache_nccl")
    ranks=1
    wants="import horovod.torch as h; assert h.nccl_built(), 'Horovod without NCCL'"
fi

built=$(ls "$carry"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ "$nccl" = 0 ] && [ -n "$built" ] && ! "$PY" -c "$wants" 2>/dev/null; then
    say "installing the carried $(basename "$built") (built by an earlier run)"
    "$PY" -m pip install --quiet --no-deps --no-index "$built" || say "it does not install here: building"
fi
if ! "$PY" -c "$wants" 2>/dev/null; then
    sdist="$carry/horovod-$HOROVOD_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        say "no Horovod here and no $sdist: run scripts/gpu_train_check.sh --fetch where there is network"
        exit 2
    fi
    # cffi for Horovod's setup.py, into a folder of its own (nothing of the image changes).
    site=${TMPDIR:-/tmp}/hvd_quant_site
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$carry"/cffi-*.whl \
        "$carry"/pycparser-*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    say "building Horovod $HOROVOD_VERSION (torch only, Gloo, ${build_env[0]}) from $sdist on $(nproc) cores"
    start=$SECONDS
    export HVD_QUANT_CACHE=${HVD_QUANT_CACHE:-${TMPDIR:-/tmp}/hvd_quant_cache}
    status=0
    # Torch only, Gloo only, no CUDA parts (build_horovod.sh's Fix 6): the staged wire needs
    # no more, and that build neither waits on nvcc nor depends on the machine's toolkit.
    # --nccl: the CUDA parts and NCCL, into a folder and a cache of their own.
    env HVD_QUANT_HOROVOD_SDIST="$sdist" HOROVOD_WITHOUT_TENSORFLOW=1 HVD_QUANT_HOROVOD_MPI=0 \
        "${build_env[@]}" PYTHON="$PY" \
        timeout "${HVD_QUANT_GPU_BUILD_S:-300}" bash "$root/scripts/build_horovod.sh" 2>&1 | tee -a "$log" \
        || status=$?
    cp "$HVD_QUANT_CACHE/horovod-build.log" "$out/horovod-build.log" 2>/dev/null || true
    if [ "$status" != 0 ]; then
        say "the Horovod build failed or ran out of time (status $status) after $((SECONDS - start)) s"
        exit "$status"
    fi
    say "Horovod built and installed in $((SECONDS - start)) s"
    wheel=$(ls "$HVD_QUANT_CACHE"/wheels/*/horovod-*.whl 2>/dev/null | head -1 || true)
    if [ "$nccl" = 0 ] && [ -n "$wheel" ]; then  # for the next run (files that come back: 16 MiB at most)
        basename "$wheel" > "$out/horovod-wheel.name"
        split -b 15M "$wheel" "$out/horovod-wheel.part-"
    fi
fi
if [ "$build_only" = 1 ]; then
    "$PY" -c "$wants" && say "Horovod is importable"
    exit
fi

say "$ranks rank$([ "$ranks" = 1 ] || echo s): benchmarks/gpu_train.py ${job[*]}"
start=$SECONDS
status=0
HOROVOD_GLOO_TIMEOUT_SECONDS=${HOROVOD_GLOO_TIMEOUT_SECONDS:-120} PYTHONUNBUFFERED=1 \
    timeout "${HVD_QUANT_GPU_TRAIN_S:-240}" "$PY" -m horovod.runner.launch -np "$ranks" -H localhost:"$ranks" --gloo \
    "$PY" "$root/benchmarks/gpu_train.py" "${job[@]}" 2>&1 | tee -a "$log" || status=$?
say "job finished with status $status in $((SECONDS - start)) s"

for rate in ${HVD_QUANT_GPU_CLUSTER_RATES:-}; do
    say "the emulated cluster: 2 hosts x 1 rank at $rate"
    start=$SECONDS
    cstatus=0
    PYTHONUNBUFFERED=1 "$PY" -m hvd_quant.cluster run --hosts 2 --slots 1 --rate "$rate" \
        --timeout "${HVD_QUANT_GPU_TRAIN_S:-240}" -- \
        "$PY" "$root/benchmarks/gpu_train.py" "${job[@]}" --out "$out/cluster-$rate" --bits-steps 0 \
        2>&1 | tee -a "$log" || cstatus=$?
    say "emulated cluster at $rate finished with status $cstatus in $((SECONDS - start)) s"
    [ "$status" != 0 ] || status=$cstatus
done
exit "$status"
