#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 from PyPI's source distribution into the
# active Python, with the fixes current frameworks need. The built wheel is cached,
# keyed by the Python, torch and TensorFlow versions and the controllers it has, so a
# second run takes seconds.
#
#   scripts/build_horovod.sh                 build (or take from the cache) and install
#   scripts/build_horovod.sh --controllers   print the controllers a build here would have
#
# Controllers: Gloo always; MPI as well where an MPI is installed (its C++ compiler wrapper
# mpicxx is on PATH; Debian: apt-get install openmpi-bin libopenmpi-dev).
# HVD_QUANT_HOROVOD_MPI=0 builds without MPI anyway; =1 wants MPI (a cached wheel with MPI
# needs only MPI's runtime, as in the container image; compiling one needs mpicxx).
# CPU operations (the data path of allreduce, allgather, ... on CPU tensors) follow the
# launch: horovodrun --gloo and the emulated cluster set HOROVOD_CPU_OPERATIONS=gloo;
# under mpirun or horovodrun --mpi the MPI build's default is MPI (Horovod's own default
# with MPI): Horovod 0.28.1 builds the Gloo contexts of process sets, the global one
# included, only under the Gloo controller, so Gloo operations under the MPI controller
# crash (seen: a segmentation fault in GlooAlgorithms<float>::Allreduce, every rank, at the
# first allreduce; docs/cluster.md, "MPI and Gloo"). A compiled-in Gloo default would
# crash every plain mpirun launch.
#
# Why patch: the 0.28.1 sdist (2023) predates torch >= 2.1 and TF 2.21.
#   1. torch >= 2.1 headers need C++17; the sdist pins C++14 for the torch library
#      (upstream horovod issues #3996/#4014, fixed on master, never released).
#   2. The vendored gloo adds -std=c++11; linking against a C++17 torch then fails with a
#      duplicate gloo::rendezvous::Store::kDefaultTimeout.
#   3. TF 2.21 headers break the optional XLA MPI ops (missing highwayhash/farmhash
#      includes); we leave that one source file out of the TF build.
#   4. cmake 4.x refuses gloo's cmake_minimum_required; CMAKE_POLICY_VERSION_MINIMUM=3.5
#      keeps any cmake working (the system cmake 3.25 needs nothing).
#   5. horovodrun's rendezvous server clears the finished-lists of every scope when one
#      scope completes (finished_list.clear() in horovod/runner/http/http_server.py), so
#      a scope whose ranks finished out of order keeps its addresses, and hvd.init()
#      after hvd.shutdown() can read a peer's old address and abort (gloo Connect timeout;
#      upstream's own test_horovod_reinit flakes so, horovod PR #2839). We clear that
#      scope's list only (docs/guide/failure.md, "Recovery after an error").
#   6. Only with HVD_QUANT_HOROVOD_CUDA=0 (scripts/gpu_train_check.sh sets it): a CUDA build
#      of torch makes the torch library add Horovod's CUDA parts (horovod/torch/CMakeLists.txt
#      calls add_cuda() when cmake/Modules/FindPytorch.cmake finds torch.version.cuda and a
#      CUDA_HOME), compiled by nvcc for every architecture it knows, in C++11. We make that
#      probe say no CUDA: a CPU-operations Horovod, which is all hvd_quant's staged wire
#      needs (GPU tensors then go to Horovod through pinned host buffers), built in a
#      fraction of the time and without depending on the machine's CUDA toolkit.
#      HVD_QUANT_HOROVOD_CUDA=nccl builds the other way: GPU operations by NCCL (nccl_env
#      below says from where), for one architecture.
#   7. GCC 13 (the GPU machine's /opt/gcc) no longer includes <string> and <stdexcept>
#      through other standard headers, which horovod/common/group_table.h and common.h
#      rely on ("'string' in namespace 'std' does not name a type", "'logic_error' is not
#      a member of 'std'"). We force-include them, and <cstdint>, the other header GCC 13
#      stopped pulling in, into every C++ file (CXXFLAGS); nothing changes for GCC 12.
#   9. Gloo has an fp16 sum with F16C's vector conversions (third_party/gloo/gloo/math.cc),
#      used where GLOO_USE_AVX is 1 in every file that includes gloo/math.h; nothing in
#      Horovod's build defines it (gloo's config.h would, from a USE_AVX nobody sets, but
#      math.h does not include config.h), and the vendored gloo does not even compile
#      math.cc. So the sum of every fp16 allreduce on the CPU (Horovod's Compression.fp16,
#      hvd_quant's fp16) converted each element in software and took 2.5 to 4 times as long
#      as fp32's (docs/benchmarks/time-to-quality.md, 8 hosts). Where the compiler flags
#      hold -mf16c and -mavx (Horovod adds them when -march=native has them,
#      cmake/Utilities.cmake) we define it for the whole build, compile math.cc, and set
#      gloo's config.h to match. Both sums add in float32 and round to nearest even: the
#      finite sums' bits do not change (a NaN keeps its payload instead of 0x7fff).
#  10. Gloo's alltoall and allgather (third_party/gloo/gloo/alltoallv.cc, allgatherv.cc)
#      post each send before its receive. The TCP transport holds a send until the peer
#      has said it is ready to receive, and that notice leaves on the same socket behind
#      any data already being sent: when one rank arrives first (the usual case), the
#      other sends its whole share before its notice reaches the first, and the exchange
#      runs one way and then the other, at twice the bytes' time on a full-duplex link
#      (benchmarks/reference/alltoall-pieces-2026-12-06/). Gloo's allreduce posts the
#      receive first. We do the same in both: the same bytes to the same places, in both
#      directions at once (benchmarks/reference/gloo-recv-first-2026-12-07/). The build
#      says so in horovod/hvd_quant_build.py (GLOO_RECEIVES_FIRST), and hvd_quant's torch
#      communicator then sends a large alltoall whole instead of in pieces.
set -euo pipefail

HOROVOD_VERSION=0.28.1
# Bump when a patch below changes: it is part of the wheel cache's key, so a machine
# that cached a wheel built without it builds again.
PATCH_LEVEL=p7
PY=${PYTHON:-python}

# Which controllers: "Gloo" or "Gloo, MPI" (as the bootstrap's summary line names them).
case ${HVD_QUANT_HOROVOD_MPI:-auto} in
    auto) if command -v mpicxx >/dev/null 2>&1; then with_mpi=1; else with_mpi=0; fi ;;
    1) with_mpi=1 ;;
    0) with_mpi=0 ;;
    *) echo "[build_horovod] HVD_QUANT_HOROVOD_MPI must be auto, 0 or 1, not '$HVD_QUANT_HOROVOD_MPI'" >&2; exit 2 ;;
esac
if [ "$with_mpi" = 1 ]; then controllers="Gloo, MPI"; key=gloo-mpi; else controllers=Gloo; key=gloo; fi
nccl=0
case ${HVD_QUANT_HOROVOD_CUDA:-auto} in
    auto) no_cuda=0 ;;
    0) no_cuda=1; key=$key-nocuda ;;
    nccl) no_cuda=0; nccl=1; key=$key-nccl ;;
    *) echo "[build_horovod] HVD_QUANT_HOROVOD_CUDA must be auto, 0 or nccl, not '$HVD_QUANT_HOROVOD_CUDA'" >&2; exit 2 ;;
esac
# Where to install (pip --target), instead of the active Python: HVD_QUANT_HOROVOD_TARGET.
target=${HVD_QUANT_HOROVOD_TARGET:-}
if [ "${1:-}" = --controllers ]; then
    echo "$controllers"
    exit 0
fi

# The probe's stderr (TensorFlow's start-up lines: no CUDA drivers, absl) is shown only if it fails.
probe_err=$(mktemp)
versions=$(TF_CPP_MIN_LOG_LEVEL=3 "$PY" - 2>"$probe_err" <<'PYEOF'
import importlib.util, os, sys, torch
tf = "none"  # torch only: no TensorFlow here, or HOROVOD_WITHOUT_TENSORFLOW=1
if os.environ.get("HOROVOD_WITHOUT_TENSORFLOW") != "1" and importlib.util.find_spec("tensorflow"):
    import tensorflow; tf = tensorflow.__version__
print(f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.split('+')[0]}-tf{tf}")
PYEOF
) || { cat "$probe_err" >&2; rm -f "$probe_err"; exit 1; }
rm -f "$probe_err"
with_tf=1; case $versions in *-tfnone) with_tf=0 ;; esac
cache_root=${HVD_QUANT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_quant}
wheel_dir="$cache_root/wheels/horovod-$HOROVOD_VERSION-$versions-$key-$PATCH_LEVEL"
# Caches written before the key named the controllers hold Gloo-only wheels.
legacy="$cache_root/wheels/horovod-$HOROVOD_VERSION-$versions-$PATCH_LEVEL"
if [ "$key" = gloo ] && ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1 \
        && ls "$legacy"/horovod-*.whl >/dev/null 2>&1; then
    wheel_dir=$legacy
fi

# HVD_QUANT_HOROVOD_CUDA=nccl: GPU operations by NCCL (issue 56), for the machine's GPU
# architecture only (HOROVOD_BUILD_CUDA_CC_LIST, default 90: Hopper), with the CUDA toolkit
# of the nvcc on PATH and the NCCL of the nvidia-nccl wheel torch depends on (its folder has
# libnccl.so.2 but no libnccl.so for the linker: $1/nccl gets the headers and that link).
nccl_env() {
    local nvcc pkg cuda
    nvcc=$(command -v nvcc) || { echo "[build_horovod] HVD_QUANT_HOROVOD_CUDA=nccl needs nvcc on PATH" >&2; exit 1; }
    # The toolkit's folder: nvcc says where it runs from (the one on PATH may be a wrapper script).
    cuda=$("$nvcc" --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=${HOROVOD_CUDA_HOME:-$(dirname "${cuda:-$(dirname "$nvcc")}")} \
           HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-90} HOROVOD_NCCL_LINK=SHARED
    pkg=$("$PY" -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null) || pkg=""
    if [ -z "${HOROVOD_NCCL_HOME:-}" ] && [ -n "$pkg" ] && [ -f "$pkg/include/nccl.h" ]; then
        mkdir -p "$1/nccl/lib"
        ln -s "$pkg/include" "$1/nccl/include"
        ln -s "$pkg"/lib/libnccl.so.2 "$1/nccl/lib/libnccl.so"
        export HOROVOD_NCCL_HOME="$1/nccl"
    fi
    echo "[build_horovod] NCCL: CUDA at $HOROVOD_CUDA_HOME, NCCL at ${HOROVOD_NCCL_HOME:-its default search}, architectures $HOROVOD_BUILD_CUDA_CC_LIST"
}

if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    echo "[build_horovod] using cached wheel in $wheel_dir"
else
    echo "[build_horovod] no cached wheel for $versions with $controllers; building Horovod $HOROVOD_VERSION from source (about 10 minutes on 2 cores)"
    if [ "$with_mpi" = 1 ] && ! command -v mpicxx >/dev/null 2>&1; then
        echo "[build_horovod] HVD_QUANT_HOROVOD_MPI=1 but no MPI compiler wrapper (mpicxx) on PATH; Debian: apt-get install openmpi-bin libopenmpi-dev" >&2
        exit 1
    fi
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    if [ -n "${HVD_QUANT_HOROVOD_SDIST:-}" ]; then  # no network: the sdist carried along
        cp "$HVD_QUANT_HOROVOD_SDIST" "$work/horovod-$HOROVOD_VERSION.tar.gz"
    else
        "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
    fi
    tar -C "$work" -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz"
    src="$work/horovod-$HOROVOD_VERSION"

    # Fix 1: C++17 for the whole project and for the torch library.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    # Fix 2: the vendored gloo in C++17 as well.
    sed -i 's/-std=c++11 -fPIC/-std=c++17 -fPIC/' "$src/third_party/gloo/CMakeLists.txt"
    # Fix 9: Gloo's vector fp16 sum where the build targets F16C and AVX.
    sed -i 's/^set_build_arch_flags("${ARCH_FLAGS}")$/&\nif(CMAKE_CXX_FLAGS MATCHES "-mf16c" AND CMAKE_CXX_FLAGS MATCHES "-mavx")\n    add_definitions(-DGLOO_USE_AVX=1)\nendif()/' \
        "$src/CMakeLists.txt"
    sed -i 's/^set(GLOO_USE_AVX ${USE_AVX})$/if(CMAKE_CXX_FLAGS MATCHES "-mf16c" AND CMAKE_CXX_FLAGS MATCHES "-mavx")\n  set(GLOO_USE_AVX 1)\nelse()\n  set(GLOO_USE_AVX 0)\nendif()/' \
        "$src/third_party/gloo/gloo/CMakeLists.txt"
    sed -i 's|^  "${CMAKE_CURRENT_SOURCE_DIR}/types.cc"$|&\n  "${CMAKE_CURRENT_SOURCE_DIR}/math.cc"|' \
        "$src/third_party/gloo/gloo/CMakeLists.txt"
    grep -qF '/math.cc"' "$src/third_party/gloo/gloo/CMakeLists.txt" \
        || { echo "[build_horovod] patch did not apply: math.cc not among gloo's sources" >&2; exit 1; }
    grep -qF 'add_definitions(-DGLOO_USE_AVX=1)' "$src/CMakeLists.txt" \
        || { echo "[build_horovod] patch did not apply: no GLOO_USE_AVX definition in $src/CMakeLists.txt" >&2; exit 1; }
    # Fix 10: Gloo's alltoall and allgather post each receive before its send.
    "$PY" - "$src/third_party/gloo/gloo" <<'PATCH'
import sys
root = sys.argv[1]
swaps = {
    "alltoallv.cc": [(
        "    in->send(\n        sendRank, slot, inOffsetPerRank[sendRank], inLengthPerRank[sendRank]);\n",
        "    out->recv(\n        recvRank, slot, outOffsetPerRank[recvRank], outLengthPerRank[recvRank]);\n")],
    "allgatherv.cc": [(
        indent + "out->send(sendRank, slot, byteOffsets[sendIndex], byteCounts[sendIndex]);\n",
        indent + "out->recv(recvRank, slot, byteOffsets[recvIndex], byteCounts[recvIndex]);\n")
        for indent in ("      ", "    ")],
}
for name, pairs in swaps.items():
    path = f"{root}/{name}"
    text = open(path).read()
    for send, recv in pairs:
        if text.count(send + recv) != 1:
            sys.exit(f"[build_horovod] patch did not apply: no single send-then-receive pair in {path}")
        text = text.replace(send + recv, recv + send)
    open(path, "w").write(text)
PATCH
    # What this build holds, for hvd_quant to read (horovod.hvd_quant_build): with Fix 10 its
    # torch communicator sends a large alltoall whole (hvd_quant/torch/comm.py).
    cat > "$src/horovod/hvd_quant_build.py" <<MARKER
"""Written by hvd_quant's scripts/build_horovod.sh into the Horovod it built."""
PATCH_LEVEL = "$PATCH_LEVEL"
#: Fix 10: Gloo's alltoall and allgather post each receive before its send.
GLOO_RECEIVES_FIRST = True
MARKER
    # Fix 3: drop the optional XLA MPI ops that do not compile against TF 2.21.
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    # Fix 5: the rendezvous server clears the finished scope's list, not every scope's.
    sed -i 's/self\.server\.finished_list\.clear()/self.server.finished_list[scope].clear()/' \
        "$src/horovod/runner/http/http_server.py"
    # Fix 6 (opt-in): the torch probe reports no CUDA.
    if [ "$no_cuda" = 1 ]; then
        sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' \
            "$src/cmake/Modules/FindPytorch.cmake"
        if grep -qF "torch.version.cuda is not None" "$src/cmake/Modules/FindPytorch.cmake"; then
            echo "[build_horovod] patch did not apply: the CUDA probe is still in cmake/Modules/FindPytorch.cmake" >&2
            exit 1
        fi
    fi
    # Fix 8 (with HVD_QUANT_HOROVOD_CUDA=nccl): Horovod's CUDA kernels in C++17, as the rest of
    # the build (Fix 1), not C++11 (horovod/common/ops/cuda/CMakeLists.txt): CUDA 13's CCCL
    # headers need C++17. Built so on an H200 (CUDA 13.0, 2026-12-04); C++11 was not tried.
    if [ "$nccl" = 1 ]; then
        sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
    fi
    for check in "CMAKE_CXX_STANDARD 14:$src/CMakeLists.txt" \
                 "CMAKE_CXX_STANDARD 14:$src/horovod/torch/CMakeLists.txt" \
                 "-std=c++11 -fPIC:$src/third_party/gloo/CMakeLists.txt" \
                 "xla_mpi_ops.cc:$src/horovod/tensorflow/CMakeLists.txt" \
                 "set(GLOO_USE_AVX \${USE_AVX}):$src/third_party/gloo/gloo/CMakeLists.txt" \
                 "self.server.finished_list.clear():$src/horovod/runner/http/http_server.py"; do
        if grep -qF -- "${check%%:*}" "${check#*:}"; then
            echo "[build_horovod] patch did not apply: '${check%%:*}' still in ${check#*:}" >&2
            exit 1
        fi
    done

    mkdir -p "$wheel_dir"
    log="$cache_root/horovod-build.log"
    echo "[build_horovod] compiling; log in $log"
    (
        cd "$src"
        # Torch only: this wins over HOROVOD_WITH_TENSORFLOW (horovod/tensorflow/CMakeLists.txt).
        [ "$with_tf" = 1 ] || export HOROVOD_WITHOUT_TENSORFLOW=1
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
               HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j"$(nproc)"
        # Fix 7: GCC 13's missing transitive includes.
        export CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept"
        unset HOROVOD_WITH_MPI HOROVOD_WITHOUT_MPI HOROVOD_CPU_OPERATIONS
        if [ "$nccl" = 1 ]; then nccl_env "$work"; fi
        if [ "$with_mpi" = 1 ]; then
            # CPU operations default to MPI (Horovod's own default when it has MPI): see the top.
            export HOROVOD_WITH_MPI=1
        else
            export HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
        fi
        "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$wheel_dir.tmp" . >"$log" 2>&1 &
        pid=$!
        # Progress on a long build: one line a minute.
        start=$SECONDS
        while kill -0 "$pid" 2>/dev/null; do
            sleep 60 &
            wait $! || true
            kill -0 "$pid" 2>/dev/null && echo "[build_horovod] still compiling ($(( (SECONDS-start)/60 )) min): $(grep -o '\[ *[0-9]*%\]' "$log" | tail -1)"
        done
        wait "$pid" || { echo "[build_horovod] build failed; last lines of $log:" >&2; tail -40 "$log" >&2; exit 1; }
    )
    mv "$wheel_dir.tmp"/horovod-*.whl "$wheel_dir"/ && rmdir "$wheel_dir.tmp"
    echo "[build_horovod] cached $(ls "$wheel_dir")"
fi

if [ -n "$target" ]; then
    "$PY" -m pip install --quiet --no-deps --force-reinstall --target "$target" "$wheel_dir"/horovod-*.whl
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
else
    "$PY" -m pip install --quiet --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
fi
# A wheel from the cache must be what its key says (a hand-copied one may not be).
has_mpi=$("$PY" -c "import horovod.torch as h; print(int(h.mpi_built()))" 2>/dev/null) || has_mpi=?
if [ "$has_mpi" != "$with_mpi" ]; then
    echo "[build_horovod] the installed wheel from $wheel_dir has MPI=$has_mpi, expected $with_mpi ($controllers): remove that directory and run again" >&2
    exit 1
fi
