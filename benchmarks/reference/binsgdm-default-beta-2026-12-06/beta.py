"""BinSGDM's one beta, 0.9 against 0.8, on the four seeds of the time-to-quality LM, at a
constant lr and under the warm-up schedule (issue 51): the tables of README.md. Losses on
loopback, 2 ranks, 400 steps, lr 5e-4.

Two hosts ran these runs, and their CPUs round differently (``config.platform``; the runs of
2026-12-03 predate that record, and today's host gave their seed-0 curves again bit for
bit, so they are marked as its). Each cell says which: A, the AMD EPYC host of 2026-12-03
and 2026-12-06; I, the Intel Xeon 6 host of 2026-12-05. The runs of 2026-12-06 are this
folder's (``runs/``, ``loss/``); the others are ../ttq-binsgdm-2026-12-05/'s and the folders
it reads, whose loaders this reuses.

    .venv/bin/python benchmarks/reference/binsgdm-default-beta-2026-12-06/beta.py
"""
import importlib.util
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("gap", HERE.parent / "ttq-binsgdm-2026-12-05" / "binsgdm.py")
gap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gap)

#: This folder's runs: (method, beta, schedule) -> the folders its seeds are in. ``loss/`` holds
#: the curves the cluster timed: BinSGDM at its new default (0.8) and Adam, seed 0.
TODAY = {("binsgdm", 0.8, "warmup"): ["loss", "runs/warmup-beta0.8"],
         ("binsgdm", 0.8, "constant"): ["loss", "runs/constant-beta0.8"],
         ("binsgdm", 0.9, "warmup"): ["runs/warmup-beta0.9"],
         ("binsgdm", 0.9, "constant"): ["runs/constant-beta0.9"],
         ("horovod_fp32", None, "warmup"): ["loss", "runs/adam-warmup"],
         ("horovod_fp32", None, "constant"): ["loss"]}


def host(data):
    cpu = (data["config"].get("platform") or {}).get("cpu", "")
    return "I" if cpu.startswith("Intel") else "A"  # no record: a 2026-12-03 run (see above)


def runs(method, beta, seed, schedule):
    """Every recorded run of this configuration, today's first."""
    found = []
    for folder in TODAY.get((method, beta, schedule), []):
        path = HERE / folder / "2x1-loopback" / f"{method}_s{seed}_{schedule}.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    if method == "horovod_fp32" or beta == 0.9:  # the earlier folders' defaults
        earlier = gap.run(None, method, seed, schedule)
    else:
        earlier = gap.run("beta0.8" if schedule == "constant" else "beta0.8-warmup", method, seed, schedule)
    if earlier is not None:
        found.append(earlier)
    return [d for d in found if d.get("status") == "complete"]


def by_host(method, beta, seed, schedule):
    """host -> final loss; one run per host (a second run on a host must give the same bits)."""
    out = {}
    for data in runs(method, beta, seed, schedule):
        loss = gap.final(data)
        assert out.setdefault(host(data), loss) == loss, (method, beta, seed, schedule)
    return out


def table(schedule):
    lines = ["| seed | Adam | BinSGDM beta 0.9 | BinSGDM beta 0.8 |", "|---|---|---|---|"]
    gaps = {0.9: [], 0.8: []}
    on_a = {0.9: [], 0.8: []}  # host A ran every seed of both betas
    for seed in range(4):
        adam = by_host("horovod_fp32", None, seed, schedule)
        twin = next(iter(adam.values()))
        assert all(abs(v / twin - 1) < 1e-4 for v in adam.values()), adam  # Adam: the same on both hosts
        cells = [" / ".join(f"{v:.4f} ({h})" for h, v in sorted(adam.items()))]
        for beta in (0.9, 0.8):
            losses = by_host("binsgdm", beta, seed, schedule)
            cells.append(" / ".join(f"{v:.4f} ({100 * (v / twin - 1):+.1f}%, {h})"
                                    for h, v in sorted(losses.items())))
            gaps[beta] += [100 * (v / twin - 1) for v in losses.values()]
            on_a[beta] += [100 * (v / twin - 1) for h, v in losses.items() if h == "A"]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    for label, table_gaps in (("mean gap, host A", on_a), ("mean gap, every run", gaps)):
        means = [f"{statistics.mean(g):+.1f}% ({len(g)} runs)" for g in table_gaps.values()]
        lines.append(f"| {label} | | {means[0]} | {means[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for schedule in ("constant", "warmup"):
        print(f"\n{schedule}, each against Adam of its seed (A: AMD EPYC host, I: Intel Xeon 6 host):\n")
        print(table(schedule))
