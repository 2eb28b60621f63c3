"""Side-by-side benchmark of gradient reduction on an emulated cluster (needs root, iproute2).

    sudo .venv/bin/python benchmarks/bench_cluster.py                  # the full matrix
    sudo .venv/bin/python benchmarks/bench_cluster.py --cases model --rates 1gbit,10gbit \
        --hosts 2 --slots 1,2                                          # the LM, as users run it
    sudo .venv/bin/python benchmarks/bench_cluster.py --rates 1gbit --hosts 2 \
        --numel 4000000 --repeats 3 --cases buffer --methods horovod_fp32,ef_sign,marsit
    sudo .venv/bin/python benchmarks/bench_cluster.py --cases scaling --rates 100mbit,1gbit \
        --layouts 2x1,4x1,8x1,16x1,8x2 --repeats 3 --resume --out-dir benchmarks/results/scaling
                                                                       # how cost grows with ranks

For every host count and ranks per host, one :class:`hvd_quant.cluster.EmulatedCluster`
is built (each host pinned to its own share of the machine's CPUs); for every link rate
its links are reshaped, and for every case one Horovod job runs
``benchmarks/cluster_worker.py``, which times every method (Horovod fp32/fp16 allreduce,
torch DDP over Gloo with no hook, ``fp16_compress_hook`` and PowerSGD, every hvd_quant
compressor, the 1-bit compressed allreduce and the 1-bit optimizers), each paired with the
fp32 baseline and the compute floor measured interleaved with it. See that file for the
cases, the timing protocol and the cost models.

Settings are a user's defaults: only public entry points, no environment the user would
not set. The one setting the worker makes, torch's intra-op threads per rank, is the
docs' recommendation (usable cores / ranks on this host, as in Horovod's examples;
docs/guide/tuning.md); ``--threads`` and ``--thp`` (the docs' transparent-huge-pages tip)
change that, and
every table prints the settings in effect, hvd_quant's kernel thread choice included.

Output (in ``--out-dir``):

* a markdown table per (rate, hosts, ranks per host, case), printed and saved in
  ``report.md``: median ms over repeats (a repeat counts as long as its slowest rank),
  speed-up against Horovod fp32 (the paired baseline) and against DDP + PowerSGD, MB sent
  per rank per step, the ideal time and the share of the ideal saving reached, the
  roofline as a percentage of the measured time, and (model case) the share of the ideal
  the roofline itself reaches;
* ``results.json``: configuration, every raw time (per rank, per repeat), the derived
  numbers, failed jobs;
* ``speedup.png``: speed-up against Horovod fp32 versus link rate, one line per method,
  one panel per (case, host count, ranks per host);
* with the ``scaling`` case: a table per link rate of every method's step time and
  speed-up at every layout, with the bytes each rank sent (wire meter) and the bytes that
  left and entered its host's link (the link counters), in ``report.md``, and
  ``scaling.png``: speed-up against Horovod fp32 versus the number of ranks, one panel per
  link rate.

Ideal and roofline per method (see :func:`summarize`)::

    ideal    = compute floor + bytes one rank sends / link rate          (model case)
             = bytes one rank sends / link rate + bytes touched / copy bandwidth  (buffer)
    % of ideal = (baseline - measured) / (baseline - ideal)
    roofline = link term + bytes touched / copy bandwidth (+ compute floor)
    % of roofline = roofline / measured
    roofline's % of ideal = (baseline - roofline) / (baseline - ideal)    (model case)

The last is the ceiling a compressor's own passes over memory put on its share of the
ideal: a method at 100% of its roofline reaches that share and no more.

with the copy bandwidth measured in the same job (``dst.copy_(src)`` of a buffer of the
same size, bytes read + written per second).
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

from hvd_quant.cluster import (ClusterUnavailable, EmulatedCluster, JobTimeout,  # noqa: E402
                               format_rate, parse_rate)

BASELINE, POWERSGD = "horovod_fp32", "ddp_powersgd"
DEFAULT_RATES = "100mbit,1gbit,10gbit"
#: Cases that time a model's step (with the ``local`` compute floor).
MODEL_CASES = ("model", "scaling")
CASES = ("buffer",) + MODEL_CASES


# --- summarising one job ------------------------------------------------------------------------
def slowest_per_repeat(times_by_rank):
    """``[rank][repeat]`` seconds -> per repeat the slowest rank's seconds."""
    return [max(col) for col in zip(*times_by_rank)]


def summarize(raw, rate_bps):
    """Derived numbers of one job's raw results: ``{method: {...}}`` plus copy bandwidth.

    Each method is compared with the baseline (and, in the model case, the compute floor)
    measured *interleaved with it* (``paired_s``, see cluster_worker's "Timing"); raw
    results of the older all-interleaved protocol, which have no pairs, use the job's
    single baseline and floor. Per method:

    * ``speedup_vs_horovod_fp32``: its paired baseline's median over its own median;
    * ``ideal_s``: the time it would take if only its unavoidable costs remained: the
      paired compute floor plus its own wire time (bytes sent / link rate) in the model
      case; wire time plus its memory passes at the measured copy bandwidth in the buffer
      case (nothing else is timed there);
    * ``pct_of_ideal``: the share of the ideal saving reached, ``(baseline - t) /
      (baseline - ideal)`` in percent (100: as fast as the ideal; 0: no faster than fp32);
    * ``roofline_s`` / ``pct_of_roofline``: wire + memory passes (+ floor), over the
      measured time;
    * ``ceiling_pct_of_ideal`` (model case, compressors): the share of the ideal saving
      the roofline itself reaches, ``(baseline - roofline) / (baseline - ideal)``: the
      most this method can reach with its passes over memory at the measured copy
      bandwidth. ``None`` for the 1-bit optimizers, whose byte model counts the update's
      passes that the floor's Adam step also holds.
    """
    copy_s = statistics.median(slowest_per_repeat(raw["copy_s"]))
    copy_bw = 2 * raw["copy_bytes"] / copy_s if copy_s > 0 else float("inf")  # read + write
    methods = raw["methods"]
    model = raw["config"]["case"] in MODEL_CASES
    medians = {name: statistics.median(slowest_per_repeat(m["times_s"])) for name, m in methods.items()}

    def paired(name, kept):
        pairs = methods[name].get("paired_s") or {}
        if kept in pairs:
            return statistics.median(slowest_per_repeat(pairs[kept]))
        return medians.get(kept)

    floor = medians.get("local", 0.0) if model else 0.0
    rows = {}
    for name, m in methods.items():
        measured = medians[name]
        base = paired(name, BASELINE)
        own_floor = (paired(name, "local") or 0.0) if model else 0.0
        link_s = m["sent_bytes"] * 8 / rate_bps if rate_bps else 0.0
        memory_s = (m["touched_bytes"] or 0.0) / copy_bw
        bound = link_s + memory_s + (own_floor if name != "local" else measured)
        ideal = own_floor + link_s if model else link_s + memory_s
        comparable = base is not None and name not in (BASELINE, "local") and base > ideal
        # A compressor's passes come on top of the floor's step; an optimizer's replace
        # part of it (its step kinds are recorded), so its roofline is no ceiling.
        additive = comparable and model and not m.get("kinds")
        rows[name] = {
            "median_s": measured,
            "baseline_s": base,
            "floor_s": own_floor if model else None,
            "speedup_vs_horovod_fp32": base / measured if base is not None else None,
            "speedup_vs_ddp_powersgd": medians[POWERSGD] / measured if POWERSGD in medians else None,
            "sent_mb": m["sent_bytes"] / 1e6,
            "touched_mb": (m["touched_bytes"] or 0.0) / 1e6,
            "ideal_s": ideal,
            "pct_of_ideal": 100.0 * (base - measured) / (base - ideal) if comparable else None,
            "roofline_s": bound,
            "link_s": link_s,
            "memory_s": memory_s,
            "pct_of_roofline": 100.0 * bound / measured if measured > 0 else None,
            "ceiling_pct_of_ideal": 100.0 * (base - bound) / (base - ideal) if additive else None,
            "kinds": m.get("kinds", []),
            "skipped_steps": m.get("skipped_steps", 0),
            "link_mb": ({k: v / 1e6 for k, v in m["link_bytes"].items()} if m.get("link_bytes") else None),
        }
    return {"copy_s": copy_s, "copy_gbps": copy_bw / 1e9, "compute_floor_s": floor, "methods": rows}


def skipped_label(count):
    """What a table row's name gets when ``count`` of its timed steps were skipped by the
    optimizer (values not finite): such a step does less work, so the row is not
    comparable. Empty for none."""
    return f" **{count} timed step(s) skipped, not finite**" if count else ""


def markdown_table(run):
    """One markdown table for one job (``run`` as stored in results.json)."""
    s, cfg = run["summary"], run["raw"]["config"]
    what = (f"{cfg['numel']:,} floats" if run["case"] == "buffer" else
            f"model step, {cfg['numel']:,} parameters, batch {cfg['batch']}")
    settings = [f"torch {cfg['threads']} intra-op thread(s) per rank" if cfg.get("threads") else None,
                cfg.get("kernel_threads"), "THP_MEM_ALLOC_ENABLE=1" if cfg.get("thp") else None,
                "torch Adam with fused=True (--adam-fused)" if cfg.get("adam_fused") else None,
                f"CPUs per host {cfg['cpus']}" if cfg.get("cpus") else None]
    lines = [f"### {run['rate']}, {run['hosts']} hosts x {run['slots']} rank(s), {run['case']} ({what})", "",
             f"median of {cfg['repeats']} repeats (slowest rank per repeat); copy bandwidth "
             f"{s['copy_gbps']:.1f} GB/s (read + write)"
             + (f"; step without communication (`local`) {1e3 * s['compute_floor_s']:.0f} ms"
                if run["case"] in MODEL_CASES else "")
             + (f". Settings: {'; '.join(x for x in settings if x)}" if any(settings) else ""), "",
             "| method | median ms | vs horovod_fp32 | vs DDP+PowerSGD | MB sent/rank | ideal ms | % of ideal | "
             "% of roofline | roofline's % of ideal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def x(v):
        return f"{v:.2f}x" if v is not None else "–"

    def pct(v):
        return f"{v:.0f}%" if v is not None else "–"
    for name, r in s["methods"].items():
        kinds = (f" ({'/'.join(r['kinds'])})" if r["kinds"] else "") + skipped_label(r.get("skipped_steps"))
        lines.append(f"| {name}{kinds} | {1e3 * r['median_s']:.1f} | {x(r['speedup_vs_horovod_fp32'])} | "
                     f"{x(r['speedup_vs_ddp_powersgd'])} | {r['sent_mb']:.2f} | {1e3 * r['ideal_s']:.1f} | "
                     f"{pct(r['pct_of_ideal'])} | {pct(r['pct_of_roofline'])} | "
                     f"{pct(r.get('ceiling_pct_of_ideal'))} |")
    return "\n".join(lines) + "\n"


def layout_key(run):
    return (run["hosts"] * run.get("slots", 1), run.get("slots", 1))


def scaling_tables(runs):
    """Markdown, one table per link rate of the ``scaling`` runs: per method and layout the
    step time (ms, median of the slowest rank) with its speed-up against Horovod fp32 (the
    paired baseline), then per layout the MB per rank per step: sent (wire meter) and
    what left / entered the host's link (its counters, per rank)."""
    mine = [r for r in runs if r["case"] == "scaling"]
    if not mine:
        return []
    out = ["## Scaling: step time and bytes per rank, by layout", "",
           "Cells: step ms (speed-up vs Horovod fp32, paired); bytes: MB per rank per step, "
           "sent by the wire meter / left the host's link / entered it (link counters, per rank).", ""]
    for rate in sorted({r["rate_bps"] for r in mine}):
        at = sorted((r for r in mine if r["rate_bps"] == rate), key=layout_key)
        heads = [f"{r['hosts']}x{r.get('slots', 1)}" for r in at]
        names = []
        for r in at:
            names += [n for n in r["summary"]["methods"] if n not in names]
        def table(title, cell, skip=()):
            rows = [f"| {title} | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
            for name in names:
                if name in skip:
                    continue
                found = [r["summary"]["methods"].get(name) for r in at]
                rows.append(f"| {name} | " + " | ".join("–" if row is None else cell(name, row)
                                                          for row in found) + " |")
            return rows

        def step(name, row):
            x = row["speedup_vs_horovod_fp32"]
            return f"{1e3 * row['median_s']:.0f}" + (f" ({x:.2f}x)" if x and name != BASELINE else "")

        def sent(name, row):
            link = row.get("link_mb")
            return f"{row['sent_mb']:.2f}" + (f" / {link['tx']:.2f} / {link['rx']:.2f}" if link else "")

        out += [f"### {format_rate(rate)}", ""] + table("method", step) + [""]
        out += table("MB/rank/step: sent / link out / link in", sent, skip=("local",))
        out.append("")
    return out


def plot_scaling(runs, path):
    """Speed-up against Horovod fp32 versus ranks (``scaling`` runs), one panel per rate;
    layouts with several ranks per host are drawn as separate points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in runs if r["case"] == "scaling"]
    rates = sorted({r["rate_bps"] for r in mine})
    if not rates:
        return False
    fig, axes = plt.subplots(1, len(rates), figsize=(6.0 * len(rates) + 1.8, 4.8), squeeze=False)
    markers = "os^vD<>ph*xP+Xd1234"
    # A dozen methods: tab10's colours would repeat. tab20's dark shades first, then its light.
    colors = plt.get_cmap("tab20").colors
    for ax, rate in zip(axes[0], rates):
        at = sorted((r for r in mine if r["rate_bps"] == rate), key=layout_key)
        names = []
        for r in at:
            names += [n for n in r["summary"]["methods"] if n not in names and n not in ("local", BASELINE)]
        for i, name in enumerate(names):
            for slots, style in ((1, "-"), (2, ":")):
                pts = [(r["hosts"] * slots, r["summary"]["methods"][name]["speedup_vs_horovod_fp32"])
                       for r in at if r.get("slots", 1) == slots and name in r["summary"]["methods"]
                       and r["summary"]["methods"][name]["speedup_vs_horovod_fp32"]]
                if pts:
                    ax.plot(*zip(*pts), marker=markers[i % len(markers)], linestyle=style,
                            color=colors[(2 * i) % 20 + (2 * i) // 20], label=name if slots == 1 else None)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (dotted, or a lone marker: 2 ranks per host)")
        ax.set_ylabel("speed-up vs Horovod fp32 (step)")
        ax.set_title(f"scaling model, {format_rate(rate)}")
        ax.grid(True, which="both", alpha=0.3)
    # one legend beside the panels, where it hides no point
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1 - 1.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- the plot -------------------------------------------------------------------------------------
def plot(runs, path):
    """Speed-up vs Horovod fp32 against link rate; one panel per (case, hosts, ranks per host)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (used as matplotlib.ticker below)

    panels = sorted({(r["case"], r["hosts"], r.get("slots", 1)) for r in runs})
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.8), squeeze=False)
    for ax, (case, hosts, slots) in zip(axes[0], panels):
        mine = sorted((r for r in runs if r["case"] == case and r["hosts"] == hosts and r.get("slots", 1) == slots),
                      key=lambda r: r["rate_bps"])
        names = []
        for r in mine:
            names += [n for n in r["summary"]["methods"] if n not in names and n != "local"]
        markers = "os^vD<>ph*xP+Xd1234"
        for i, name in enumerate(names):
            pts = [(r["rate_bps"], r["summary"]["methods"][name]["speedup_vs_horovod_fp32"]) for r in mine
                   if name in r["summary"]["methods"]
                   and r["summary"]["methods"][name]["speedup_vs_horovod_fp32"]]
            if pts:
                ax.plot(*zip(*pts), marker=markers[i % len(markers)], label=name,
                        linestyle="--" if name.startswith(("horovod", "ddp")) else "-")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({r["rate_bps"] for r in mine})
        ax.set_xticks(rates, [format_rate(r) for r in rates])
        ax.set_xticks([], minor=True)
        low, high = ax.get_ylim()  # labelled ticks inside the range (a log axis from 0.7x
        ax.set_yticks([v for v in (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)
                       if low <= v <= high])  # to 4x would otherwise label only 1x)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if len(rates) == 1:
            ax.set_xlim(rates[0] / 3, rates[0] * 3)
        ax.set_xlabel("link rate per host (bit/s)")
        ax.set_ylabel("speed-up vs Horovod fp32 allreduce")
        ax.set_title(f"{case}, {hosts} hosts x {slots} rank{'s' * (slots > 1)}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # one legend for all panels: methods missing from panel 0 too
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    width = 5.0 * len(panels)
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(width / (width + 2.2), 0.5), fontsize=8)
    fig.set_size_inches(width + 2.2, 4.8)
    fig.tight_layout(rect=(0, 0, width / (width + 2.2), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- running the matrix ---------------------------------------------------------------------------
def estimate_job_s(case, numel, hosts, slots, rate_bps, repeats, n_methods):
    """Rough seconds for one job (orders of magnitude measured on a 2-core machine): every
    method runs its warm-up and repeats paired with the fp32 baseline (and the compute
    floor in the model case), plus start-up."""
    n = hosts * slots
    d = {"buffer": numel, "model": 31.7e6, "scaling": 3.7e6}[case]
    fp32_link = slots * 2 * (n - 1) / n * 4 * d * 8 / rate_bps if rate_bps else 0.0
    compute = {"buffer": 0.04 * d / 1e6, "model": 0.6, "scaling": 0.15}[case] * max(1.0, n / 2)
    per_repeat = (fp32_link + compute) + (fp32_link / 8 + 1.5 * compute) + (compute if case in MODEL_CASES else 0)
    return 60 + n_methods * (repeats + 3) * per_repeat


def parse_list(text, kind=str):
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_layouts(text):
    """``"2x1,8x2"`` -> ``[(2, 1), (8, 2)]`` (hosts, ranks per host)."""
    out = []
    for item in parse_list(text):
        hosts, sep, slots = item.lower().partition("x")
        if not sep or not hosts.isdigit() or not slots.isdigit():
            raise ValueError(f"--layouts: {item!r} is not HOSTSxRANKS, e.g. 8x2")
        out.append((int(hosts), int(slots)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default=DEFAULT_RATES, help=f"link rates (default {DEFAULT_RATES})")
    p.add_argument("--hosts", default="2,3", help="host counts (default 2,3)")
    p.add_argument("--slots", default="1", help="ranks per host, one or several (e.g. 1,2; default 1)")
    p.add_argument("--layouts", default="",
                   help="hosts x ranks per host, e.g. 2x1,4x1,8x1,16x1,8x2 (instead of --hosts and --slots)")
    p.add_argument("--delay", default=None, help="one-way delay, e.g. 0.1ms (needs tc netem)")
    p.add_argument("--cases", default="buffer,model",
                   help="buffer, model and/or scaling (default buffer,model; scaling: a 3.7M-parameter "
                        "model of 101 tensors, small enough for 16 ranks on one machine)")
    p.add_argument("--numel", type=int, default=25_000_000, help="buffer case size in floats (default 25M)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default="", help="comma-separated (default: all; see cluster_worker.py --list)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per rank (default 0: the README's recommendation, the "
                        "usable cores / ranks on this host)")
    p.add_argument("--thp", action="store_true",
                   help="set THP_MEM_ALLOC_ENABLE=1 for every rank (the README's tip: torch backs large "
                        "tensors with transparent huge pages); off by default, as for a user")
    p.add_argument("--job-timeout", type=float, default=0, help="seconds per job (default: from an estimate)")
    p.add_argument("--out-dir", default="", help="default benchmarks/results/cluster-<date-time>")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for cluster_worker.py (repeatable), e.g. --worker-arg=--batch=8")
    p.add_argument("--resume", action="store_true",
                   help="reuse the raw results already in --out-dir of jobs with the same configuration "
                        "(an interrupted run goes on where it stopped; the report and plot cover all)")
    args = p.parse_args(argv)

    rates = [parse_rate(r) for r in parse_list(args.rates)]
    if any(r is None for r in rates):
        p.error("--rates: every rate must be a real rate (the speed-up plot needs it)")
    try:
        layouts = parse_layouts(args.layouts) if args.layouts else [
            (h, k) for h in parse_list(args.hosts, int) for k in parse_list(args.slots, int)]
    except ValueError as exc:
        p.error(str(exc))
    cases = parse_list(args.cases)
    if not set(cases) <= set(CASES) or not cases:
        p.error(f"--cases: one or more of {', '.join(CASES)}")
    if args.repeats < 1 or not layouts or min(min(h, k) for h, k in layouts) < 1:
        p.error("--repeats, --hosts and --slots must be >= 1")
    out_dir = Path(args.out_dir or HERE / "results" / f"cluster-{datetime.now():%Y%m%d-%H%M%S}")
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    n_methods = len(parse_list(args.methods)) or 12
    jobs = [(h, k, r, c) for h, k in layouts for r in rates for c in cases]
    estimates = {j: estimate_job_s(j[3], args.numel, j[0], j[1], j[2], args.repeats, n_methods)
                 for j in jobs}
    total_est = sum(estimates.values())
    log(f"{len(jobs)} jobs ({', '.join(format_rate(r) for r in rates)}; layouts "
        f"{', '.join(f'{h}x{k}' for h, k in layouts)}; {', '.join(cases)}); rough estimate "
        f"{total_est / 60:.0f} min; results in {out_dir}")

    runs, failures = [], []
    start = time.monotonic()
    for hosts, slots in layouts:
        status = run_layout(args, hosts, slots, rates, cases, estimates, jobs, out_dir, runs, failures, start)
        if status:
            return status

    write_outputs(out_dir, args, runs, failures, start)
    png = out_dir / "speedup.png"
    if runs and plot(runs, png):
        log(f"plot: {png}")
    if any(r["case"] == "scaling" for r in runs) and plot_scaling(runs, out_dir / "scaling.png"):
        log(f"plot: {out_dir / 'scaling.png'}")
    log(f"done in {(time.monotonic() - start) / 60:.1f} min: {len(runs)} jobs ok, {len(failures)} failed; "
        f"{out_dir / 'report.md'}, {out_dir / 'results.json'}")
    return 1 if failures else 0


def run_layout(args, hosts, slots, rates, cases, estimates, jobs, out_dir, runs, failures, start):
    """Every (rate, case) job on one cluster of ``hosts`` x ``slots``; appends to ``runs``
    and ``failures``. Returns 3 when the cluster cannot run here."""
    try:
        cluster = EmulatedCluster(hosts=hosts, slots=slots, rate=rates[0], delay=args.delay,
                                  log=lambda m: log(f"cluster: {m}"))
        cluster.start()
    except ClusterUnavailable as exc:
        log(f"error: {exc}")
        return 3
    with cluster:
        for rate in rates:
            cluster.set_link(rate, args.delay)
            for case in cases:
                job = (hosts, slots, rate, case)
                done = jobs.index(job) + 1
                label = f"{format_rate(rate)} {hosts}h x {slots} {case}"
                timeout = args.job_timeout or max(900.0, 3 * estimates[job])
                raw_path = out_dir / "raw" / f"{format_rate(rate)}_{hosts}h{slots}s_{case}.json"
                earlier = reusable(raw_path, args, hosts, slots, rate, case) if args.resume else None
                if earlier is not None:
                    log(f"job {done}/{len(jobs)}: {label}: reusing {raw_path}")
                    runs.append({"rate": format_rate(rate), "rate_bps": rate, "hosts": hosts, "slots": slots,
                                 "case": case, "elapsed_s": None, "raw": earlier,
                                 "summary": summarize(earlier, rate)})
                    continue
                log(f"job {done}/{len(jobs)}: {label} (estimate {estimates[job] / 60:.1f} min, "
                    f"limit {timeout / 60:.0f} min; {(time.monotonic() - start) / 60:.1f} min elapsed)")
                cmd = [sys.executable, str(HERE / "cluster_worker.py"), "--case", case,
                       "--numel", str(args.numel), "--repeats", str(args.repeats),
                       "--threads", str(args.threads), "--label", label, "--out", str(raw_path),
                       *(["--methods", args.methods] if args.methods else []), *args.worker_arg]
                env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "HOROVOD_GLOO_TIMEOUT_SECONDS": "600",
                       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
                if args.thp:  # every method of the job runs with it alike
                    env["THP_MEM_ALLOC_ENABLE"] = "1"
                try:
                    result = cluster.run_horovod(cmd, timeout=timeout, env=env, stream=ProgressFilter("[bench"))
                except JobTimeout as exc:
                    failures.append({"rate": format_rate(rate), "hosts": hosts, "slots": slots, "case": case,
                                     "error": str(exc)})
                    log(f"job {label} timed out after {timeout:.0f} s; going on")
                    continue
                if result.returncode != 0 or not raw_path.exists():
                    failures.append({"rate": format_rate(rate), "hosts": hosts, "slots": slots, "case": case,
                                     "error": f"exit {result.returncode}\n{result.tail(40)}"})
                    log(f"job {label} failed (rank {result.failed_rank}, exit {result.returncode}):\n"
                        + result.tail(25))
                    continue
                raw = json.loads(raw_path.read_text())
                run = {"rate": format_rate(rate), "rate_bps": rate, "hosts": hosts, "slots": slots,
                       "case": case, "elapsed_s": result.elapsed, "raw": raw,
                       "summary": summarize(raw, rate)}
                runs.append(run)
                print("\n" + markdown_table(run), flush=True)
                write_outputs(out_dir, args, runs, failures, start)
    return 0


def reusable(raw_path, args, hosts, slots, rate, case):
    """The raw results at ``raw_path`` if an earlier run left them for this very job
    (same case, size, repeats, thread setting, THP, hosts, ranks per host, link rate,
    timing protocol and methods)."""
    if not raw_path.exists() or args.worker_arg:  # worker arguments change the job: run it again
        return None
    try:
        raw = json.loads(raw_path.read_text())
        cfg = raw["config"]
    except (ValueError, KeyError):
        return None
    wanted = {"case": case, "repeats": args.repeats, "threads_arg": args.threads, "hosts": hosts,
              "slots": slots, "rate_bps": rate, "thp": bool(args.thp), "protocol": "paired"}
    if case == "buffer":
        wanted["numel"] = args.numel
    if any(cfg.get(k) != v for k, v in wanted.items()):
        return None
    if args.methods and set(parse_list(args.methods)) != set(raw["methods"]):
        return None
    return raw


def write_outputs(out_dir, args, runs, failures, start):
    """results.json and report.md, rewritten after every job (a crash keeps what is done)."""
    meta = {"argv": sys.argv, "args": vars(args), "started": datetime.now().isoformat(timespec="seconds"),
            "elapsed_s": time.monotonic() - start, "cpu_count": os.cpu_count()}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "runs": runs, "failures": failures},
                                                     indent=1))
    report = ["# Emulated-cluster benchmark", "", f"`{' '.join(sys.argv)}`", ""]
    report += scaling_tables(runs)
    report += [markdown_table(r) for r in runs]
    if failures:
        report += ["## Failed jobs", ""] + [f"- {f['rate']} {f['hosts']} hosts x {f.get('slots', 1)} {f['case']}: "
                                            f"{f['error'].splitlines()[0]}" for f in failures]
    (out_dir / "report.md").write_text("\n".join(report) + "\n")


class ProgressFilter:
    """Stream for the job's output: rank 0's progress lines (those holding one of
    ``progress``) and anything that looks like an error from any rank; the rest stays in the
    job's captured output."""

    ERRORS = ("Error", "error", "Traceback", "Exception", "Killed", "WARNING")

    def __init__(self, *progress):
        self.keep = progress + self.ERRORS

    def write(self, line):
        if any(k in line for k in self.keep):
            sys.stdout.write(line)

    def flush(self):
        sys.stdout.flush()


def log(msg):
    print(f"[cluster-bench {datetime.now():%H:%M:%S}] {msg}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
