#!/usr/bin/env bash
# The one command for a GPU machine (issue 39): check the Triton kernels on the GPU itself
# and benchmark them, writing the results into OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR          on a machine with a CUDA GPU, torch, Triton, numba
#   scripts/gpu_check.sh --cpu OUTDIR    the same steps on a CPU, the kernels under Triton's
#                                        interpreter and the benchmark at tiny sizes (to check
#                                        this script where no GPU is; the GPU tests skip)
#
# No network and no Horovod needed: hvd_quant runs from this checkout (PYTHONPATH), the GPU
# tests use the Horovod stand-in of tests/gpu_standin when horovod.torch does not import,
# and a Python package missing there can travel as wheels in .whl/ of the checkout (an
# ignored folder; docs/development.md#a-gpu-check says how to download them), installed
# here into a temporary folder without an index.
#
# Steps, each under its own time limit, in order (a failed step does not stop the next):
#   prepare  versions; carried wheels; the numba kernels and every Triton kernel variant
#            compiled (in parallel processes; both cache on disk for the later steps)
#   tune     benchmarks/bench_gpu.py --tune: the launch settings (warps, elements per program) of
#            the kernel families of hvd_quant.kernels.gpu.LAUNCH timed on the device; the fastest
#            whose outputs equal the defaults' go to OUTDIR/launch.json, and every later step
#            runs with them (HVD_QUANT_GPU_LAUNCH), so the tests check their bits
#   tests    tests/test_cuda.py: every Triton primitive against the numba kernels, bit for
#            bit, on the GPU; whole methods against the numpy oracle; dispatch; no host sync
#   bench    benchmarks/bench_gpu.py: primitives and methods against the host path, torch
#            ops, DeepSpeed's CuPy recipe and PowerSGD; the issue's targets
#   train    scripts/gpu_train_check.sh: 2 Horovod ranks on the GPU train the LM with every
#            method (the shortest job), each step's bits against a CPU twin, then timed;
#            Horovod comes from .gpu_carry/ where it is missing: its carried wheel, else
#            built there (torch only, Gloo, no CUDA parts), in the background from the start
#   nccl     scripts/gpu_train_check.sh --nccl: Horovod built with NCCL (in the background from
#            the start, beside the other build, into a folder of its own), the same job at 1
#            rank on the direct path (GPU tensors to Horovod), bits against the CPU twin; the
#            step fails, with the build's log, where that build failed (GPU machine only;
#            HVD_QUANT_GPU_NCCL=0 skips the build and the step)
#
# Budget: 8 minutes from a bare machine with every step (HVD_QUANT_GPU_CHECK_S, seconds);
# the train step gets what is left, at least 150 s. On an H200 (2026-11-28): 258 s with
# Horovod built beside prepare and tests (133 s on 16 cores), 165 s with its wheel carried.
# A run that built it returns the wheel in OUTDIR/train (horovod-wheel.part-*); joined into
# .gpu_carry/, the next run installs it in seconds.
#
# OUTDIR receives gpu_check.log (all
# output), launch.json, tune.json, tune.md, tests.xml (JUnit), bench_gpu.json, bench_gpu.md,
# summary.json, summary.md, and train/
# (the training job's files, and a Horovod wheel it built).
# Exit status 0 when every step passed (a target missed is reported, not a failure).
# shellcheck disable=SC2317  # the step functions run through bash -c "step_$name"
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cpu=0
out=""
for arg in "$@"; do
    case "$arg" in
        --cpu) cpu=1 ;;
        -h|--help) sed -n '2,42p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
        *) out=$arg ;;
    esac
done
if [ -z "$out" ]; then
    echo "usage: scripts/gpu_check.sh [--cpu] OUTDIR" >&2
    exit 2
fi
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ "$cpu" = 1 ] && [ -x "$root/.venv/bin/python" ]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi

# Step names and their time limits (seconds), in order; train's is set when it starts.
STEPS=(prepare tune tests bench train nccl)
declare -A LIMIT=([prepare]=120 [tune]=90 [tests]=150 [bench]=140 [train]=150 [nccl]=100)
BUDGET=${HVD_QUANT_GPU_CHECK_S:-480}  # seconds for every step together (the train step gets what is left)
# The benchmark stops timing the (slow) host path after this many seconds, to end in its limit.
BENCH_HOST_BUDGET=90
# The methods the benchmark also profiles (kernels by time), where the targets were missed.
BENCH_PROFILE=onebit,ef_sign,global_qsgd

wheels=${TMPDIR:-/tmp}/gpu_check_site.$$   # the carried wheels, installed here
state=${TMPDIR:-/tmp}/gpu_check_steps.$$
trap 'rm -rf "$wheels" "$state"' EXIT
site=$wheels
export root out cpu PYTHON wheels BENCH_HOST_BUDGET BENCH_PROFILE
# --cpu: Triton from the folder beside the test environment (scripts/bootstrap.sh --with-triton;
# tests/triton_env.py says why it is not on that environment's path).
triton_dir=${HVD_QUANT_TRITON_PATH:-$root/.venv/triton}
if [ "$cpu" = 1 ] && [ -f "$triton_dir/triton/__init__.py" ]; then site="$site:$triton_dir"; fi
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
exec > >(tee -a "$out/gpu_check.log") 2>&1
cd "$root" || exit 2

say() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
export -f say

step_prepare() {
    "$PYTHON" - <<'PYEOF' || return 1
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
for name in ("triton", "numba", "numpy", "cupy", "pytest", "hypothesis"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
PYEOF
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    if compgen -G "$root/.whl/*.whl" >/dev/null; then
        say "installing the carried wheels: $(cd "$root/.whl" && echo ./*.whl)"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$wheels" "$root"/.whl/*.whl || return 1
    fi
    # Compile everything now, in parallel processes: the numba CPU kernels (the flavour this
    # machine's thread policy picks) and the Triton kernel variants in 4 parts.
    local pids=() part
    "$PYTHON" -c "from hvd_quant import kernels
print(f'numba kernels compiled in {kernels.warm_up():.0f} s' if kernels.enabled() else 'numba kernels off: ' + kernels.why_disabled())" &
    pids+=($!)
    for part in 0 1 2 3; do
        if [ "$cpu" = 1 ]; then
            "$PYTHON" -c "from hvd_quant import kernels
print('Triton interpreter: part $part,', kernels.gpu_interpreted().warm_up('cpu', $part, 4), 'calls')" &
        else
            "$PYTHON" -c "import time, torch
from hvd_quant import kernels
gpu = kernels.gpu_module()
assert gpu is not None, kernels.why_gpu_disabled()
t = time.perf_counter(); n = gpu.warm_up('cuda', $part, 4); torch.cuda.synchronize()
print(f'Triton part $part: {n} calls compiled in {time.perf_counter() - t:.0f} s')" &
        fi
        pids+=($!)
    done
    local pid failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    return "$failed"
}

# The Horovod stand-in's folder for PYTHONPATH (with a colon) on a GPU: the tests and the
# benchmark run in one process and issue no collective, so they take the stand-in whether or
# not, and whenever, this machine's Horovod got built or installed beside them (nothing
# imports a half-installed package). With --cpu, nothing: this machine's Horovod.
standin() {
    if [ "$cpu" = 0 ]; then
        say "the tests and the benchmark use the Horovod stand-in of tests/gpu_standin" >&2
        echo "$root/tests/gpu_standin:"
    fi
}
export -f standin

step_tests() {
    local standin
    standin=$(standin)
    PYTHONPATH="$standin$PYTHONPATH" "$PYTHON" -m pytest tests/test_cuda.py -q -rfEs -p no:cacheprovider \
        --timeout=120 --junitxml="$out/tests.xml" -o junit_family=xunit2
    local rc=$?
    if [ "$cpu" = 1 ] && [ "$rc" = 5 ]; then  # pytest's "no test ran": the file skips without CUDA
        say "no CUDA here: tests/test_cuda.py skipped, as expected with --cpu"
        return 0
    fi
    return "$rc"
}

step_tune() {
    if [ "$cpu" = 1 ]; then  # the interpreter: two families, the harness only
        "$PYTHON" benchmarks/bench_gpu.py --interpret --tune "$out/launch.json" --only sums,quantize_lanes \
            --out "$out"
    else
        PYTHONPATH="$(standin)$PYTHONPATH" "$PYTHON" benchmarks/bench_gpu.py --tune "$out/launch.json" --out "$out"
    fi
}

step_bench() {
    if [ "$cpu" = 1 ]; then
        "$PYTHON" benchmarks/bench_gpu.py --interpret --layouts 1 --repeats 1 --host-repeats 1 --profile onebit \
            --out "$out"
    else
        PYTHONPATH="$(standin)$PYTHONPATH" "$PYTHON" benchmarks/bench_gpu.py --repeats 10 --host-repeats 1 \
            --budget-s "$BENCH_HOST_BUDGET" --profile "$BENCH_PROFILE" --out "$out"
    fi
}
step_nccl() {
    if [ "$cpu" = 1 ]; then say "nccl: a GPU machine's step (nvcc, NCCL); nothing to do here"; return 0; fi
    if [ "${HVD_QUANT_GPU_NCCL:-1}" = 0 ]; then say "nccl: skipped (HVD_QUANT_GPU_NCCL=0)"; return 0; fi
    local status
    status=$(cat "$out/nccl/build.status" 2>/dev/null || echo "unfinished")
    if [ "$status" != 0 ]; then
        say "nccl: the NCCL build did not succeed (status $status); last lines of its output:"
        tail -25 "$out/nccl/build.out"
        return 1
    fi
    bash scripts/gpu_train_check.sh "$out/nccl" --nccl -- --bits-steps 3 --warmup 2 --steps 3
}
step_train() {
    if [ "$cpu" = 1 ]; then
        bash scripts/gpu_train_check.sh "$out/train" --cpu
    else
        bash scripts/gpu_train_check.sh "$out/train" -- --bits-steps 3 --warmup 2 --steps 3
    fi
}
export -f step_prepare step_tune step_tests step_bench step_train step_nccl

status=0
start=$SECONDS
: >"$state"
# The training step needs Horovod; a bare GPU machine has none, and building it takes minutes
# of CPU (133 s on the H200 machine's 16 cores). So it is built from the start, beside the
# compiling and the tests (which use few cores), and the benchmark waits for it so that its
# timings see a quiet machine.
BUILD_PID=""
building() { [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; }
if [ "$cpu" = 0 ] && ! "$PYTHON" -c "import horovod.torch" >/dev/null 2>&1; then
    say "no horovod.torch here: installing the carried wheel or building it, in the background (log: train/gpu_train.log, train/horovod-build.log)"
    mkdir -p "$out/train"
    bash scripts/gpu_train_check.sh "$out/train" --build-only >"$out/train/build.out" 2>&1 &
    BUILD_PID=$!
fi
# Horovod with NCCL (issue 56), for the nccl step: built beside the other, from the start.
NCCL_PID=""
if [ "$cpu" = 0 ] && [ "${HVD_QUANT_GPU_NCCL:-1}" != 0 ]; then
    say "building Horovod with NCCL in the background too (log: nccl/build.out)"
    mkdir -p "$out/nccl"
    (bash scripts/gpu_train_check.sh "$out/nccl" --nccl --build-only >"$out/nccl/build.out" 2>&1
     echo $? >"$out/nccl/build.status") &
    NCCL_PID=$!
fi
nccl_building() { [ -n "$NCCL_PID" ] && kill -0 "$NCCL_PID" 2>/dev/null; }
wait_for_build() {  # $1: at most this many seconds; $2: also the NCCL build
    local t0=$SECONDS
    building || { [ "${2:-}" = nccl ] && nccl_building; } || return 0
    say "waiting for the Horovod build(s) (at most $1 s)"
    while { building || { [ "${2:-}" = nccl ] && nccl_building; }; } && [ $((SECONDS - t0)) -lt "$1" ]; do
        sleep 2
    done
    if building; then say "the Horovod build is still running after $1 s"
    elif [ -n "$BUILD_PID" ]; then wait "$BUILD_PID"; say "the Horovod build ended (status $?)"; BUILD_PID=""; fi
    if [ "${2:-}" = nccl ]; then
        if nccl_building; then say "the NCCL build is still running after $1 s"
        elif [ -n "$NCCL_PID" ]; then say "the NCCL build ended (status $(cat "$out/nccl/build.status"))"; NCCL_PID=""; fi
    fi
    say "waited $((SECONDS - t0)) s"
}
for step in "${STEPS[@]}"; do
    case "$step" in
        # The benchmark's host path times CPU work: both builds done first (a quiet machine).
        bench) wait_for_build 150 nccl ;;
        train) wait_for_build $((BUDGET - (SECONDS - start) - 60 - LIMIT[nccl])) ;;
        nccl) wait_for_build $((BUDGET - (SECONDS - start) - 60)) nccl ;;
    esac
    limit=${LIMIT[$step]}
    # The train step gets what is left, less the nccl step's share; the nccl step what is left.
    left=$((BUDGET - (SECONDS - start)))
    if [ "$step" = train ] && [ $((left - LIMIT[nccl])) -gt "$limit" ]; then
        limit=$((left - LIMIT[nccl]))
    elif [ "$step" = nccl ] && [ "$left" -gt "$limit" ]; then
        limit=$left
    fi
    say "step $step (limit ${limit} s)"
    t0=$SECONDS
    timeout -k 10 "$limit" bash -c "step_$step"
    rc=$?
    took=$((SECONDS - t0))
    case "$rc" in
        0) verdict=passed ;;
        124|137) verdict="timed out"; status=1 ;;
        *) verdict="failed (exit $rc)"; status=1 ;;
    esac
    say "step $step $verdict in ${took} s"
    if [ "$step" = tune ] && [ "$rc" = 0 ] && [ -s "$out/launch.json" ]; then
        export HVD_QUANT_GPU_LAUNCH="$out/launch.json"  # the later steps run with the tuned settings
        say "the later steps run with HVD_QUANT_GPU_LAUNCH=$HVD_QUANT_GPU_LAUNCH: $(tr -d ' \n' <"$out/launch.json")"
    fi
    printf '%s\t%s\t%s\t%s\n' "$step" "$verdict" "$took" "$limit" >>"$state"
done

"$PYTHON" - "$state" "$out" "$((SECONDS - start))" "$cpu" <<'PYEOF' || status=1
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

state, out, total, cpu = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
steps = [dict(zip(("step", "result", "seconds", "limit_s"), line.split("\t")))
         for line in state.read_text().splitlines() if line]
summary = {"mode": "cpu (Triton interpreter)" if cpu else "gpu", "total_s": total, "steps": steps}
xml = out / "tests.xml"
if xml.exists():
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["tests"]["seconds"] = float(suite.get("time", 0))
    summary["tests"]["failed"] = failed
tune = out / "tune.json"
if tune.exists():
    summary["tune"] = {f: {k: r[k] for k in ("default", "default_ms", "best", "best_ms")}
                       for f, r in json.loads(tune.read_text())["tune"].items()}
bench = out / "bench_gpu.json"
if bench.exists():
    report = json.loads(bench.read_text())
    summary["versions"] = report["versions"]
    summary["targets"] = [{"target": t, "measured": m, "passed": p}
                          for layout in report["layouts"] for t, m, p in layout["targets"]]
lines = [f"# GPU check ({summary['mode']})", "", f"Total {total} s.", "", "| step | result | s | limit s |",
         "|---|---|---:|---:|"]
lines += [f"| {s['step']} | {s['result']} | {s['seconds']} | {s['limit_s']} |" for s in steps]
if "tests" in summary:
    t = summary["tests"]
    lines += ["", f"tests/test_cuda.py: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped, {t['seconds']:.0f} s."]
    lines += [f"* FAILED {name}" for name in t["failed"]]
if "tune" in summary:
    lines += ["", "Launch settings tuned (tune.md has every timing; the later steps ran with the best):", "",
              "| family | default | ms | best | ms |", "|---|---|---:|---|---:|"]
    ms = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines += [f"| {f} | `{json.dumps(r['default'])}` | {ms(r['default_ms'])} | `{json.dumps(r['best'])}` | "
              f"{ms(r['best_ms'])} |" for f, r in summary["tune"].items()]
if "versions" in summary:
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items())]
if summary.get("targets"):
    judged = [t for t in summary["targets"] if t["passed"] is not None]
    lines += ["", f"The targets of issues 39 and 56: {sum(t['passed'] for t in judged)} of {len(judged)} met "
              "(bench_gpu.md has every measurement).", "", "| target | measured | result |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | "
              f"{'n/a' if t['passed'] is None else 'pass' if t['passed'] else 'FAIL'} |" for t in summary["targets"]]
(out / "summary.json").write_text(json.dumps(summary, indent=1))
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
say "done in $((SECONDS - start)) s: $([ "$status" = 0 ] && echo 'every step passed' || echo 'a step failed'); results in $out"
exit "$status"
