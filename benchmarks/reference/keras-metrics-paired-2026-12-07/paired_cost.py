"""Issue 54: what metrics and probes cost in Keras, each row against its paired twin
(``keras_bench_worker.py --paired LABEL``), ``python paired_cost.py RESULT.json...``.

A step's time is the slower rank's. Each chunk's first step is left out of both rows (the
twin's first step after a new row was built took 0.7-1.6 s in ``paired.json``, before
the worker ran it once untimed). Per row, against its twin over the same rounds:

* the cost on the means, and without the row's probe steps (with a probe every N steps
  of T timed, its T / N slowest steps);
* the cost on the medians;
* the median over rounds of each round's median ratio, with the rounds' range;
* the probe steps' mean excess over the row's median, and that excess per step as a
  share of the row's median step: what a probe every N steps costs by its own time."""
import json
import statistics as st
import sys


def slower(per_rank, label, key):
    series = [r[label][key] for r in per_rank]
    return [max(s[i] for s in series) for i in range(len(series[0]))]


def pct(x):
    return f"{100 * x:+.1f}%"


def report(path):
    data = json.load(open(path))
    per_rank, cfg = data["per_rank"], data["config"]
    c, twin = cfg["chunk"], cfg["paired"]
    print(f"\n{path}: each row against `{twin}` next to it, {cfg['repeats']} rounds of {c} steps "
          f"(each chunk's first step left out)")
    print("| row | median ms | twin's median ms | cost on the means | without the probe steps | on the medians "
          "| rounds' median ratios: median (range) | probe steps | their excess, ms | per step |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for label in per_rank[0]:
        t_all, p_all = slower(per_rank, label, "times_s"), slower(per_rank, label, "paired_s")
        t = [x for i, x in enumerate(t_all) if i % c]
        p = [x for i, x in enumerate(p_all) if i % c]
        every = int(label.split("@probe")[1]) if "@probe" in label else 0
        k = min(len(t_all) // every, len(t) - 1) if every else 0  # a short run keeps one step
        med = st.median(t)
        top = sorted(t)[-k:] if k else []
        rest = sorted(t)[:-k] if k else t
        rounds = [st.median(t_all[i + 1:i + c]) / st.median(p_all[i + 1:i + c]) - 1 for i in range(0, len(t_all), c)]
        excess = st.mean(top) - med if k else None
        cols = [f"`{label}`", f"{1e3 * med:,.0f}", f"{1e3 * st.median(p):,.0f}", pct(st.mean(t) / st.mean(p) - 1),
                pct(st.mean(rest) / st.mean(p) - 1), pct(med / st.median(p) - 1),
                f"{pct(st.median(rounds))} ({pct(min(rounds))} to {pct(max(rounds))})", str(k or "-"),
                "-" if excess is None else f"{1e3 * excess:,.0f}",
                "-" if excess is None else f"{100 * excess / every / med:.1f}%"]
        print("| " + " | ".join(cols) + " |")
    print("losses (train / held-out): " + "; ".join(
        f"{k} {v['loss']['train_loss']:.4f} / {v['loss']['val_loss']:.4f}" for k, v in per_rank[0].items()))


for p in sys.argv[1:]:
    report(p)
