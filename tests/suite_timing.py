"""Where the test suite's time goes: per file, per launched job, and process start-up.

    HVD_QUANT_TIMING=/tmp/t.jsonl ./scripts/test.sh --full    # record (conftest + horovod_launch)
    .venv/bin/python tests/suite_timing.py /tmp/t.jsonl       # the tables (markdown)
    .venv/bin/python tests/suite_timing.py /tmp/t.jsonl --startup   # + start-up costs measured now

The record holds one line per test phase (setup, call, teardown; a module's horovodrun job
is timed in the setup of its first test) and one line per job launched through
``tests/horovod_launch.run_horovod``. ``--startup`` times, in fresh processes, what every
launched rank pays before doing any test work: Python with torch, TensorFlow, Horovod and
the kernels' cache load, and ``horovodrun`` itself, so that the share of the suite spent
starting processes can be estimated (jobs x start-up).
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
# A bare environment (none of the caller's thread or launcher settings); horovodrun's rank
# commands still need the system's tools on the path.
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "PATH": os.pathsep.join([str(BIN), "/usr/local/bin", "/usr/bin", "/bin"])}

#: What a rank imports before its first collective, in increasing order.
STARTUP = {
    "python": "pass",
    "+ torch + horovod.torch": "import torch, horovod.torch",
    "+ tensorflow + horovod.tensorflow": "import tensorflow, horovod.tensorflow",
    "+ torch, TF, Horovod, hvd_quant kernels loaded":
        "import torch, tensorflow, horovod.torch, horovod.tensorflow; from hvd_quant import kernels; kernels.warm_up()",
}


def load(path):
    tests, jobs = [], []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        (jobs if "job" in row else tests).append(row)
    return tests, jobs


def per_file(tests, jobs):
    files = collections.defaultdict(lambda: {"seconds": 0.0, "tests": set(), "jobs": 0, "job_s": 0.0})
    for t in tests:
        f = files[t["test"].split("::")[0]]
        f["seconds"] += t["seconds"]
        f["tests"].add(t["test"])
    for j in jobs:
        f = files[j["test"].split("::")[0]]
        f["jobs"] += 1
        f["job_s"] += j["seconds"]
    return files


def time_startup(repeats=2):
    out = {}
    for label, code in STARTUP.items():
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           env=ENV)
            times.append(time.perf_counter() - t)
        out[label] = statistics.median(times)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                        sys.executable, "-c", "import horovod.torch as hvd; hvd.init()"],
                       check=True, capture_output=True, env=ENV)
        times.append(time.perf_counter() - t)
    out["horovodrun -np 2, ranks import torch + horovod.torch and init"] = statistics.median(times)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("record")
    p.add_argument("--startup", action="store_true", help="also time process start-up now")
    p.add_argument("--top", type=int, default=15, help="slowest jobs to list")
    args = p.parse_args()
    tests, jobs = load(args.record)
    files = per_file(tests, jobs)
    total = sum(f["seconds"] for f in files.values())
    print(f"{len({t['test'] for t in tests})} tests, {total / 60:.1f} min of test time, "
          f"{len(jobs)} launched horovodrun jobs ({sum(j['seconds'] for j in jobs) / 60:.1f} min)\n")
    print("| file | tests | min | share | horovodrun jobs | job min |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["seconds"]):
        print(f"| {name} | {len(f['tests'])} | {f['seconds'] / 60:.1f} | {100 * f['seconds'] / total:.0f}% | "
              f"{f['jobs']} | {f['job_s'] / 60:.1f} |")
    print(f"\n| slowest jobs | seconds | test |\n|---|---:|---|")
    for j in sorted(jobs, key=lambda j: -j["seconds"])[:args.top]:
        print(f"| {j['job']} {' '.join(j['args'])} | {j['seconds']:.0f} | {j['test']} |")
    if args.startup:
        costs = time_startup()
        print("\n| process start-up (fresh process, median of 2) | seconds |\n|---|---:|")
        for label, s in costs.items():
            print(f"| {label} | {s:.1f} |")


if __name__ == "__main__":
    main()
