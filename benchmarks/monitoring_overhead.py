"""What the metrics cost (issue 54's targets): ``hq.DistributedOptimizer`` with metrics off,
on with probes off, and on with a probe every 100 steps, side by side in one run.

The model, data and step are the time-to-quality benchmark's (``benchmarks/ttq_worker.py``:
the 7.4M-parameter word-level LM on the standard library's source, Adam, 2 ranks). Each
setting trains ``--steps`` steps (at least 100, so that one probe falls in the probing
run); the settings take turns, ``--rounds`` times (A B C, A B C, ...), so that a drift of
the machine falls on all of them. The figure is each run's mean step time
(``step_time_s``: forward, backward and ``step()``, evaluation left out); the result is
each setting's median over the rounds, and its cost against metrics off.

``--setting`` chooses where the ranks run: ``2x-loopback`` (the default: ``--ranks``
ranks under ``horovodrun`` on this machine, where the step is compute-bound and shorter
than on a slow link, so a cost is a larger share of it), or a setting of the
time-to-quality benchmark such as ``2x1-1gbit`` (an emulated cluster of 2 hosts on
1 Gbit/s links, root needed: the step issue 54's target names).

    python benchmarks/monitoring_overhead.py --out benchmarks/reference/monitoring-2026-12-02
    python benchmarks/monitoring_overhead.py --setting 2x1-1gbit --rounds 5 --out overhead-1gbit
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from time_to_quality import ROOT, loopback_job, parse_setting  # noqa: E402

from hvd_quant.cluster import EmulatedCluster  # noqa: E402

#: name -> hq.DistributedOptimizer keywords.
SETTINGS = {
    "metrics off": {"metrics": False},
    "probes off": {"probe_every": 0},
    "probe every 100": {"probe_every": 100},
}


def run_one(args, cluster, name, options, index):
    out = Path(args.out) / "runs" / f"{args.method}_{name.replace(' ', '_')}_{index}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "ttq_worker.py"), "--method", args.method, "--steps", str(args.steps),
           "--eval-every", str(args.steps), "--optimizer-options", json.dumps({**options, "report_after": 0}),
           "--setting", args.setting, "--label", f"{args.method} {name}", "--out", str(out)]
    if cluster is None:
        job = loopback_job(cmd, args.ranks, args.timeout, {})
    else:
        env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "HOROVOD_GLOO_TIMEOUT_SECONDS": "600"}
        job = cluster.run_horovod(cmd, timeout=args.timeout, env=env)
    if job.returncode != 0:
        raise SystemExit(f"{name} (round {index}) failed with exit code {job.returncode}:\n{job.tail(40)}")
    result = json.loads(out.read_text())
    return {"setting": name, "round": index, "step_time_s": result["step_time_s"],
            "bytes_per_step": result["bytes_per_step"], "probes": (result.get("metrics") or {}).get("probes"),
            "wall_s": job.elapsed}


def summarise(runs):
    by = {}
    for r in runs:
        by.setdefault(r["setting"], []).append(r["step_time_s"])
    base = statistics.median(by["metrics off"])
    rows = []
    for name in SETTINGS:
        med = statistics.median(by[name])
        rows.append({"setting": name, "median_step_ms": 1e3 * med, "steps_ms": [1e3 * t for t in by[name]],
                     "cost_vs_off_pct": 100 * (med - base) / base})
    return rows


def markdown(rows, args):
    where = (f"{args.ranks} ranks on loopback" if args.setting.endswith("loopback")
             else f"the emulated cluster `{args.setting}`")
    lines = [f"`{args.method}`, {where}, {args.steps} steps per run, {args.rounds} rounds "
             "(settings in turn); median of the runs' mean step times.", "",
             "| setting | median ms/step | runs (ms/step) | cost vs metrics off |", "|---|---:|---|---:|"]
    for r in rows:
        runs = ", ".join(f"{t:.1f}" for t in r["steps_ms"])
        lines.append(f"| {r['setting']} | {r['median_step_ms']:.1f} | {runs} | {r['cost_vs_off_pct']:+.2f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="ef_sign", help="a compressor row of ttq_worker.py")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="ranks on loopback (a cluster setting names its own)")
    p.add_argument("--setting", default="", help="<hosts>x<ranks per host>-<rate> (time_to_quality.py's "
                                                 "settings) or loopback (default)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.steps < 100:
        p.error("--steps must be at least 100: the probing setting must probe once")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.setting:
        hosts, slots, rate = parse_setting(args.setting)
    else:
        hosts, slots, rate = args.ranks, 1, "loopback"
        args.setting = f"{args.ranks}x-loopback"  # the name earlier runs recorded
    cluster = None
    if rate != "loopback":
        args.ranks = hosts * slots
        cluster = EmulatedCluster(hosts=hosts, slots=slots, rate=rate, log=lambda m: print(f"[overhead] cluster: {m}"))
        cluster.start()
    runs, began = [], time.monotonic()
    try:
        for index in range(args.rounds):
            for name, options in SETTINGS.items():
                runs.append(run_one(args, cluster, name, options, index))
                print(f"[overhead] round {index + 1}/{args.rounds} {name}: {1e3 * runs[-1]['step_time_s']:.1f} "
                      f"ms/step ({time.monotonic() - began:.0f} s elapsed)", flush=True)
    finally:
        if cluster is not None:
            cluster.close()
    rows = summarise(runs)
    (Path(args.out) / "overhead.json").write_text(json.dumps({"args": vars(args), "runs": runs, "summary": rows},
                                                             indent=1))
    (Path(args.out) / "overhead.md").write_text(markdown(rows, args))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
