"""Calibrate the cost model's link figures on Gloo's own collectives, on the emulated cluster.

    sudo .venv/bin/python benchmarks/costmodel_calibrate.py --layouts 2x1,4x1,8x1,16x1,8x2 \\
        --rates 100mbit,1gbit --out-dir benchmarks/results/calibration --resume

For every layout (hosts x ranks per host) and link rate, one Horovod job runs
``benchmarks/scaling_probe.py chain``: chains of dependent collectives of each kind
(``allreduce``, ``allgather``, ``alltoall``, and the ring ``hop`` hvd_quant's multi-hop
methods make of an alltoall with one non-empty split), each at a small and a large
payload, each call timed on every rank (its slowest rank counts), with hvd_quant's own
collectives (``HorovodTorchComm``) waited for as the library waits by default. Then, per
(rate, layout, kind) (:func:`fit_point`):

* ``latency`` = the median time of the small payload (4 bytes): Horovod's negotiation and
  Gloo's messages, with nothing to move;
* ``efficiency`` = the wire bytes of the large payload (WireMeter's count: what one rank
  sends) over ``(its time - latency) * rate / 8``: the share of the link rate the kind
  reaches. Each kind is calibrated on its own: Gloo's allgather and alltoall were seen at
  about half the link rate on shaped links, its allreduce and single hops near the full.

and across the layouts with one rank per host, a fit ``latency = latency0 + latency1 (n - 1)``
per kind (least squares, both terms non-negative), the figures
:class:`hvd_quant.core.costmodel.LinkModel` takes. ``calibration.json`` holds both; the
validation (``costmodel_validate.py``) uses the per-layout figures at measured points,
the extrapolation (``costmodel_extrapolate.py``) the shares of the link rate.

Progress lines as each job runs; ``--resume`` reuses the raw results of jobs already done.
Timings taken while other work shares the machine say little; say so where they are used.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from hvd_quant.cluster import ClusterUnavailable, EmulatedCluster, JobTimeout, format_rate, parse_rate  # noqa: E402
from hvd_quant.core.costmodel import KINDS, LinkModel  # noqa: E402

#: The probe's name for each cost-model kind.
PROBE_KIND = {"allreduce": "allreduce", "allgather": "allgather", "alltoall": "alltoall", "sendrecv": "hop"}
SMALL, LARGE = 4, 1 << 20


def wire_bytes(kind, nbytes, n):
    """What one rank sends in the probe's collective of ``nbytes`` per rank (its alltoall
    sends ``nbytes`` to every rank, ``n * nbytes`` in all)."""
    return {"allreduce": 2.0 * (n - 1) / n * nbytes, "allgather": (n - 1) * nbytes,
            "alltoall": (n - 1) * nbytes, "sendrecv": float(nbytes)}[kind]


def fit_point(raw, rate_bps, n):
    """``{kind: {"latency_s", "efficiency", "small_s", "large_s"}}`` of one probe job."""
    out = {}
    for kind in KINDS:
        small = raw["results"].get(f"{PROBE_KIND[kind]}/{SMALL}/default")
        large = raw["results"].get(f"{PROBE_KIND[kind]}/{LARGE}/default")
        if small is None or large is None:
            continue
        lat, t = small["median_s"], large["median_s"]
        moving = max(t - lat, 1e-9)
        out[kind] = {"latency_s": lat, "small_s": lat, "large_s": t,
                     "efficiency": min(1.0, 8.0 * wire_bytes(kind, LARGE, n) / (moving * rate_bps))}
    return out


def fit_latency(points):
    """``(latency0, latency1)`` with ``latency = latency0 + latency1 (n - 1)``, least squares
    over ``points = [(n, latency)]`` with both terms non-negative."""
    import numpy as np
    from scipy.optimize import nnls

    a = np.array([[1.0, n - 1.0] for n, _ in points])
    b = np.array([lat for _, lat in points])
    (l0, l1), _ = nnls(a, b)
    return float(l0), float(l1)


def summarize(raws, memory_bps=None):
    """The calibration of every probe job in ``raws`` (``{(rate_bps, hosts, slots): raw}``):
    per-layout figures, and per rate a :class:`LinkModel` fitted across the layouts with
    one rank per host."""
    points, models = [], {}
    for (rate, hosts, slots), raw in sorted(raws.items()):
        n = hosts * slots
        fitted = fit_point(raw, rate, n)
        points.append({"rate_bps": rate, "hosts": hosts, "slots": slots, "ranks": n, "kinds": fitted,
                       "idle_cpu": raw["results"].get("idle", {}).get("cpu_s_per_s_mean_rank")})
    for rate in sorted({p["rate_bps"] for p in points}):
        flat = [p for p in points if p["rate_bps"] == rate and p["slots"] == 1]
        lat0, lat1, eff = {}, {}, {}
        for kind in KINDS:
            pts = [(p["ranks"], p["kinds"][kind]["latency_s"]) for p in flat if kind in p["kinds"]]
            if not pts:
                continue
            lat0[kind], lat1[kind] = fit_latency(pts) if len(pts) > 1 else (pts[0][1], 0.0)
            eff[kind] = statistics.median(p["kinds"][kind]["efficiency"] for p in flat if kind in p["kinds"])
        if len(lat0) == len(KINDS):
            models[format_rate(rate)] = LinkModel(rate, lat0, lat1, eff, memory_bps or 10e9,
                                                  "calibrated: benchmarks/costmodel_calibrate.py").to_dict()
    return {"points": points, "models": models}


def link_for(calibration, rate_bps, hosts, slots):
    """A :class:`LinkModel` for one measured layout: its own latencies and link shares
    where that layout was calibrated, else the fit across layouts."""
    for p in calibration["points"]:
        if p["rate_bps"] == rate_bps and p["hosts"] == hosts and p["slots"] == slots and \
                len(p["kinds"]) == len(KINDS):
            return LinkModel(rate_bps, {k: v["latency_s"] for k, v in p["kinds"].items()},
                             dict.fromkeys(KINDS, 0.0), {k: v["efficiency"] for k, v in p["kinds"].items()},
                             source=f"calibrated at {hosts}x{slots}")
    model = calibration["models"].get(format_rate(rate_bps))
    return LinkModel.from_dict(model) if model else None


def markdown(calibration):
    lines = ["| rate | layout | " + " | ".join(f"{k} latency ms / share of rate" for k in KINDS) + " |",
             "|---|---|" + "---:|" * len(KINDS)]
    for p in calibration["points"]:
        cells = [f"{1e3 * p['kinds'][k]['latency_s']:.1f} / {p['kinds'][k]['efficiency']:.2f}"
                 if k in p["kinds"] else "–" for k in KINDS]
        lines.append(f"| {format_rate(p['rate_bps'])} | {p['hosts']}x{p['slots']} | " + " | ".join(cells) + " |")
    for rate, m in calibration["models"].items():
        lines.append("")
        lines.append(f"{rate}, fit over one rank per host: " + "; ".join(
            f"{k} {1e3 * m['latency0'][k]:.1f} ms + {1e3 * m['latency1'][k]:.2f} ms x (n-1), "
            f"{m['efficiency'][k]:.2f} of the rate" for k in KINDS))
    return "\n".join(lines) + "\n"


def main(argv=None):
    sys.path.insert(0, str(HERE))
    from bench_cluster import ProgressFilter, log, parse_layouts, parse_list

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="2x1,4x1,8x1,16x1,8x2")
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--calls", type=int, default=8, help="collectives per chain (default 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--job-timeout", type=float, default=1800)
    p.add_argument("--out-dir", default="", help="default benchmarks/results/calibration-<date-time>")
    p.add_argument("--resume", action="store_true", help="reuse the raw results of jobs already done")
    args = p.parse_args(argv)
    layouts = parse_layouts(args.layouts)
    rates = [parse_rate(r) for r in parse_list(args.rates)]
    out_dir = Path(args.out_dir or HERE / "results" / f"calibration-{datetime.now():%Y%m%d-%H%M%S}")
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    raws, start = {}, time.monotonic()
    jobs = [(h, k, r) for h, k in layouts for r in rates]
    for i, (hosts, slots, rate) in enumerate(jobs, 1):
        path = out_dir / "raw" / f"{format_rate(rate)}_{hosts}h{slots}s.json"
        if args.resume and path.exists():
            log(f"job {i}/{len(jobs)}: {hosts}x{slots} {format_rate(rate)}: reusing {path}")
            raws[(rate, hosts, slots)] = json.loads(path.read_text())
            continue
        log(f"job {i}/{len(jobs)}: {hosts}x{slots} at {format_rate(rate)} "
            f"({(time.monotonic() - start) / 60:.1f} min elapsed)")
        cmd = [sys.executable, str(HERE / "scaling_probe.py"), "chain", "--kinds",
               ",".join(PROBE_KIND.values()), "--sizes", f"{SMALL},{LARGE}", "--calls", str(args.calls),
               "--repeats", str(args.repeats), "--waits", "default", "--out", str(path)]
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "HOROVOD_GLOO_TIMEOUT_SECONDS": "600"}
        try:
            with EmulatedCluster(hosts=hosts, slots=slots, rate=rate, log=lambda m: log(f"cluster: {m}")) as c:
                result = c.run_horovod(cmd, timeout=args.job_timeout, env=env, stream=ProgressFilter("[probe"))
        except ClusterUnavailable as exc:
            log(f"error: {exc}")
            return 3
        except JobTimeout:
            log(f"job {hosts}x{slots} {format_rate(rate)} timed out; going on")
            continue
        if result.returncode != 0 or not path.exists():
            log(f"job {hosts}x{slots} {format_rate(rate)} failed:\n{result.tail(20)}")
            continue
        raws[(rate, hosts, slots)] = json.loads(path.read_text())
    calibration = summarize(raws)
    (out_dir / "calibration.json").write_text(json.dumps(calibration, indent=1))
    (out_dir / "calibration.md").write_text(markdown(calibration))
    print(markdown(calibration))
    log(f"done in {(time.monotonic() - start) / 60:.1f} min: {out_dir / 'calibration.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
