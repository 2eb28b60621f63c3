#!/bin/sh
# The image's dependency layer: scripts/bootstrap.sh (the project's one install recipe)
# into /opt/venv, before the project itself is copied (so code changes keep this layer).
#   /wheels               build.sh's wheels (a bind mount): torch's CPU wheel,
#                         constraints.txt (the host environment's versions), ca-bundle.pem
#                         (the host's CA certificates, for pip's downloads here), and
#                         hvd_quant-cache/ (Horovod wheels as scripts/build_horovod.sh caches them)
#   /var/cache/hvd_quant  a build cache mount: a Horovod wheel compiled here is kept for the next build
# Horovod is always built with MPI here (the image has OpenMPI's runtime): a cached wheel with
# MPI is used as it is; compiling one installs OpenMPI's headers and mpicxx for the build only.
set -eu
log() { echo "[install-deps] $*"; }

export HVD_QUANT_CACHE=/var/cache/hvd_quant HVD_QUANT_HOROVOD_MPI=1
if [ -d /wheels/hvd_quant-cache/wheels ]; then
    mkdir -p "$HVD_QUANT_CACHE/wheels"
    cp -r /wheels/hvd_quant-cache/wheels/. "$HVD_QUANT_CACHE/wheels/"
fi
export PIP_FIND_LINKS=/wheels
[ -s /wheels/constraints.txt ] && export PIP_CONSTRAINT=/wheels/constraints.txt
[ -s /wheels/ca-bundle.pem ] && export PIP_CERT=/wheels/ca-bundle.pem
if [ -n "${TORCH_INDEX:-}" ]; then
    export PIP_EXTRA_INDEX_URL="$TORCH_INDEX"
elif ! ls /wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    # PyPI's torch==2.13.0 is the CUDA build (gigabytes): refuse rather than pull it.
    log "no TORCH_INDEX and no torch-2.13.0+cpu wheel in docker/wheels/: run docker/build.sh" >&2
    exit 1
fi

# Horovod compiles only when no cached wheel fits; then it needs a compiler and cmake.
toolchain=""
if ! ls "$HVD_QUANT_CACHE"/wheels/horovod-*-gloo-mpi/horovod-*.whl >/dev/null 2>&1; then
    log "no prebuilt Horovod wheel with MPI: installing a compiler to build it (about 5-10 minutes)"
    toolchain="g++ make cmake python3-dev libopenmpi-dev"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $toolchain >/dev/null
fi

# bootstrap.sh ends with an editable install of the project, which is not here yet:
# a placeholder package stands in and is removed again (the project layer installs the real one
# and compiles its kernels).
mkdir -p hvd_quant && : > hvd_quant/__init__.py
printf '[project]\nname = "hvd_quant"\nversion = "0"\n[tool.setuptools]\npackages = ["hvd_quant"]\n' > pyproject.toml
HVD_QUANT_NO_WARMUP=1 scripts/bootstrap.sh
"$HVD_QUANT_VENV/bin/python" -m pip uninstall --quiet -y hvd_quant
rm -rf hvd_quant pyproject.toml ./*.egg-info build

if [ -n "$toolchain" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq --auto-remove $toolchain >/dev/null
    rm -rf /var/lib/apt/lists/*
fi
