#!/usr/bin/env bash
# Create (or reuse) the project-local environment .venv with everything hvd_quant needs:
# torch 2.13.0 (CPU), tensorflow-cpu 2.21.0, tf-keras, numpy, numba (fused CPU kernels),
# pytest, hypothesis, scikit-learn (the examples' bundled data), matplotlib (benchmark plots),
# tensorboard (the monitoring writer)
# and Horovod 0.28.1 built from source with Gloo, and with MPI too where an MPI is installed
# (scripts/build_horovod.sh).
# These exact pins are the project's tested environment. The library itself accepts ranges
# (pyproject.toml: numpy, numba; hvd_quant/_requirements.py: the frameworks and Horovod,
# checked at import).
# Safe to run again: it installs only what is missing.
#
#   scripts/bootstrap.sh                 the library, its tests' and docs' tools, Horovod
#   scripts/bootstrap.sh --with-triton   also Triton 3.9.0 (about 1 GB) into .venv/triton, off
#                                        the environment's path: the GPU kernels' tests run
#                                        it as an interpreter on the CPU in processes of their
#                                        own (tests/triton_env.py says why; scripts/test.sh
#                                        asks for it; HVD_QUANT_WITH_TRITON=1 does the same)
set -euo pipefail
with_triton=${HVD_QUANT_WITH_TRITON:-0}
for arg in "$@"; do
    case "$arg" in
        --with-triton) with_triton=1 ;;
        *) echo "[bootstrap] unknown option $arg (known: --with-triton)" >&2; exit 2 ;;
    esac
done
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVD_QUANT_VENV:-$root/.venv}
py="$venv/bin/python"

TORCH=torch==2.13.0          # always pinned: an unpinned torch pulls the CUDA build
# Triton, for the GPU kernels' interpreter tests only (the CPU torch build has no Triton;
# the library imports it only when CUDA tensors arrive, and a GPU machine's torch brings its
# own). Not on the environment's path: torch imports Triton whenever it finds it, and a
# process that loaded TensorFlow first then aborts (both bundle LLVM).
TRITON_VERSION=3.9.0
TF=tensorflow-cpu==2.21.0
TFK=tf-keras==2.21.0
NUMBA=numba==0.68.1          # the fused CPU kernels (hvd_quant/kernels); llvmlite comes with it
# The docs site (mkdocs.yml, docs/; tests/test_docs.py runs its strict build): pinned, so that
# the build warns the same everywhere. pymdown-extensions stays on 12.x: 13.x needs Python
# >= 3.11.5, and Debian bookworm (the container image's base) has 3.11.2.
DOCS=(mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
      griffelib==2.4.1 pymdown-extensions==12.3)

if [ ! -x "$py" ]; then
    echo "[bootstrap] creating $venv"
    python3 -m venv "$venv"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

have() { "$py" - "$@" <<'PYEOF' 2>/dev/null
import importlib.metadata as md, sys
for req in sys.argv[1:]:
    name, _, ver = req.partition("==")
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if ver and got.split("+")[0] != ver:
        sys.exit(1)
PYEOF
}

# build: tests/test_packaging.py builds the wheel and sdist (python -m build).
# tensorboard: hq.monitoring.TensorBoardWriter and its test (tensorflow-cpu does not pull it in).
deps=("$TORCH" "$TF" "$TFK" "$NUMBA" numpy pytest pytest-timeout hypothesis scikit-learn matplotlib \
      setuptools wheel psutil pyyaml cloudpickle packaging cffi build tensorboard==2.21.0 "${DOCS[@]}")
if ! have "${deps[@]}"; then
    echo "[bootstrap] installing torch, TensorFlow and test dependencies (a few minutes on a new machine)"
    # pip's local find-links config warns about every package it cannot find there.
    "$py" -m pip install --quiet "${deps[@]}" 2> >(grep -v "^WARNING: Location" >&2)
fi

if [ "$with_triton" = 1 ] && ! compgen -G "$venv/triton/triton-$TRITON_VERSION.dist-info" >/dev/null; then
    echo "[bootstrap] installing Triton $TRITON_VERSION into $venv/triton (off the path) for the GPU kernels' tests under its interpreter (about 1 GB)"
    rm -rf "$venv/triton"
    "$py" -m pip install --quiet --no-deps --target "$venv/triton" "triton==$TRITON_VERSION" \
        2> >(grep -v "^WARNING: Location" >&2)
fi

# One line on the Horovod build found (what `horovodrun --check-build` says, 18 s sooner).
# A build without the controllers this machine supports (an MPI installed since) is replaced.
horovod_build() { "$py" -c "import horovod, horovod.torch as h, horovod.tensorflow
built = [name for name, has in (('Gloo', h.gloo_built()), ('MPI', h.mpi_built())) if has]
print(horovod.__version__, 'with torch and TensorFlow ops, controllers:', ', '.join(built) or 'none')" 2>/dev/null; }
# A Horovod installed before scripts/build_horovod.sh's Fix 5 (horovodrun's rendezvous race:
# hvd.init() after hvd.shutdown() could abort) is replaced by the patched build.
horovod_patched() {
    local server
    server=$("$py" -c "import horovod.runner.http.http_server as m; print(m.__file__)" 2>/dev/null) &&
        grep -q 'finished_list\[scope\]\.clear()' "$server"
}
want=$("$root/scripts/build_horovod.sh" --controllers)
if ! built=$(horovod_build) || [ "${built##*controllers: }" != "$want" ] || ! horovod_patched; then
    PYTHON="$py" "$root/scripts/build_horovod.sh"
    built=$(horovod_build) || { echo "[bootstrap] Horovod was built but does not import" >&2; exit 1; }
fi
echo "[bootstrap] Horovod $built"

# Checked from / so that the checkout itself does not shadow a missing install.
# Real paths: a checkout reached through a symlink (scripts/check_docs.py links the package)
# is the same install.
if ! (cd / && "$py" -c "import hvd_quant, os, sys; sys.exit(0 if os.path.realpath(hvd_quant.__file__) == os.path.realpath('$root/hvd_quant/__init__.py') else 1)") >/dev/null 2>&1; then
    echo "[bootstrap] installing hvd_quant (editable)"
    "$py" -m pip install --quiet --no-deps --no-build-isolation -e "$root"
fi
# Compile the fused kernels now (both the serial and the parallel twins, so that no rank ever
# compiles whatever its thread count): numba caches the machine code on disk, so a fresh machine
# pays for it here, once, and training processes only load it. The twins are cached under their
# own names, so two processes compile them at once (19 s instead of 26 on 2 cores, measured).
# (The container image's dependency layer has no project yet and sets HVD_QUANT_NO_WARMUP=1;
# its project layer warms up.)
warm() { (cd / && TF_CPP_MIN_LOG_LEVEL=3 "$py" -c "
from hvd_quant import kernels
print(f'{kernels.warm_up(\"$1\"):.0f}' if kernels.enabled() else 'off: ' + kernels.why_disabled())"); }
# The compiled kernels are also kept per kernel source in the cache the Horovod wheel lives
# in, so that a new checkout of the same kernels (CI's clean clone) loads them: 2 s instead
# of 58 (2026-12-06). numba accepts a cached index only while the source file's mtime and
# size are the ones it was compiled from, so the cache holds those mtimes and gives them
# back to the files, whose content is the same (the key is its hash). Only where numba
# caches beside the source (no NUMBA_CACHE_DIR) and this checkout holds no cache of its own;
# HVD_QUANT_KERNEL_CACHE=0 turns it off (the container image: its layer keeps its own).
kernels_dir="$root/hvd_quant/kernels"
kernel_cache() {
    local key
    key=$( (cd "$kernels_dir" && for f in ./*.py; do echo "$f"; cat "$f"; done
            "$py" -c "import numba, sys; print(numba.__version__, sys.version)") | sha256sum | cut -c1-16)
    echo "${HVD_QUANT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_quant}/kernels/$key"
}
restore_kernels() {
    local cache=$1 name mtime
    [ -z "${NUMBA_CACHE_DIR:-}" ] && [ -f "$cache/stamps" ] || return 0
    compgen -G "$kernels_dir/__pycache__/*.nbi" >/dev/null && return 0
    mkdir -p "$kernels_dir/__pycache__"
    cp "$cache"/*.nb[ic] "$kernels_dir/__pycache__/" || return 0
    while read -r name mtime; do touch -c -m -d "@$mtime" "$kernels_dir/$name"; done < "$cache/stamps"
    restored=1
}
keep_kernels() {
    local cache=$1 tmp
    [ -z "${NUMBA_CACHE_DIR:-}" ] && [ ! -d "$cache" ] || return 0
    compgen -G "$kernels_dir/__pycache__/*.nbi" >/dev/null || return 0
    tmp=$(mktemp -d "$cache.new.XXXXXX") || return 0
    cp "$kernels_dir"/__pycache__/*.nb[ic] "$tmp/" &&
        (cd "$kernels_dir" && stat -c '%n %.9Y' ./*.py | sed 's|^\./||') > "$tmp/stamps" &&
        mv -T "$tmp" "$cache" 2>/dev/null || rm -rf "$tmp"  # another bootstrap may have kept it first
}
restored=0
if [ "${HVD_QUANT_NO_WARMUP:-0}" != 1 ]; then
    if [ "${HVD_QUANT_KERNEL_CACHE:-1}" != 0 ]; then
        kernels_cache=$(kernel_cache)
        mkdir -p "$(dirname "$kernels_cache")"
        restore_kernels "$kernels_cache"
    fi
    start=$SECONDS
    warm serial > "$venv/.warm-serial.log" 2>&1 & serial_pid=$!
    parallel=$(warm parallel 2>&1) || { echo "$parallel" >&2; exit 1; }
    wait "$serial_pid" || { cat "$venv/.warm-serial.log" >&2; exit 1; }
    if [ "${parallel#off: }" != "$parallel" ]; then
        echo "[bootstrap] fused kernels unavailable: ${parallel#off: }"
    elif [ "$restored" = 1 ]; then
        echo "[bootstrap] fused kernels loaded in $((SECONDS - start)) s from $kernels_cache"
    elif [ $((SECONDS - start)) -gt 5 ]; then
        echo "[bootstrap] fused kernels compiled in $((SECONDS - start)) s (cached for later runs)"
    fi
    rm -f "$venv/.warm-serial.log"
    if [ "${HVD_QUANT_KERNEL_CACHE:-1}" != 0 ]; then keep_kernels "$kernels_cache"; fi
fi
echo "[bootstrap] environment ready: $venv"
