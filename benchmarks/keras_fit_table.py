"""Keras 3 ``model.fit`` on digits with every compressor and 1-bit optimizer, side by side.

    .venv/bin/python benchmarks/keras_fit_table.py --np 2 3
    .venv/bin/python benchmarks/keras_fit_table.py none cascading_sign --np 2 --seeds 0 1 2
    .venv/bin/python benchmarks/keras_fit_table.py --np 2 3 --seeds 0 1 2 --out runs.json --load runs.json

Runs ``examples/keras_fit.py`` under ``horovodrun --gloo`` once per config, world size and
seed (the same data, epochs and seed for every config) and prints a markdown table: test
accuracy (the mean over seeds, its range, and each seed's value), the gap to the first
config in accuracy points (``none``, SGD with momentum and an fp32 allreduce, unless told
otherwise: each seed's own gap against the baseline's run with the same seed, and their
mean, which is the difference of the means), whether every rank ended with identical weights, and bytes sent
per step per rank. Configs: ``NAME`` or ``NAME:KEY=VALUE,...`` (a compressor in
``hvd_quant.tensorflow.DistributedOptimizer`` around SGD with momentum) or ``opt=NAME``
(``adam``, or a 1-bit optimizer: ``onebit_adam``, ``zero_one_adam``, ``binsgdm``).

``--out`` is rewritten after every job, so a long run that is stopped keeps what it has;
``--load`` takes earlier ``--out`` files: runs found there (same ranks, config, seed and
epochs, without error) are not run again and join the table, so a table can be built up
in several sittings.

digits has 360 test images: one image is 0.28 points, so a single seed's gap of a point
is 3 or 4 images; ``--seeds`` averages that noise out.
"""

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from convergence import JobFailed, run_job  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "keras_fit.py"
CONFIGS = ["none", "fp16", "ef_sign", "marsit", "cascading_sign", "global_qsgd", "global_qsgd:norm=l2",
           "global_qsgd_exp", "onebit", "opt=adam", "opt=onebit_adam", "opt=zero_one_adam", "opt=binsgdm"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=CONFIGS, help="the first one is the baseline")
    p.add_argument("--np", nargs="+", type=int, default=[2, 3], help="world sizes")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--out", default=None, help="write every run's summary here (JSON), after every job")
    p.add_argument("--load", nargs="+", default=[], metavar="JSON",
                   help="earlier --out files: their runs are reused, not run again")
    return p.parse_args(argv)


def config_args(config):
    """``keras_fit.py`` arguments for one config."""
    if config.startswith("opt="):
        return ["--optimizer", config[len("opt="):]]
    return ["--compression", config]


def job_command(bindir, np_, config, seed, epochs, out, extra=()):
    return [str(bindir / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
            str(bindir / "python"), str(EXAMPLE), *config_args(config), "--epochs", str(epochs),
            "--seed", str(seed), "--json", str(out), *extra]


def run_one(bindir, np_, config, seed, epochs, timeout, workdir, extra=()):
    """One ``keras_fit.py`` job: the run's record, the example's summary merged in
    (``final_test_accuracy``, ``identical_weights``, ``bytes_per_step``, ...), or with
    ``"error"`` when the job failed."""
    out = Path(workdir) / f"np{np_}-{config.replace(':', '_').replace('=', '_')}-seed{seed}.json"
    cmd = job_command(bindir, np_, config, seed, epochs, out, extra)
    run = {"np": np_, "config": config, "seed": seed, "epochs": epochs,
           "command": " ".join(map(shlex.quote, cmd))}
    start = time.monotonic()
    try:
        run_job(cmd, timeout, echo=False)
        run.update(json.loads(out.read_text()))
    except (JobFailed, FileNotFoundError) as exc:
        run["error"] = str(exc)
    run["job_s"] = time.monotonic() - start
    return run


def _key(run):
    return run["np"], run["config"], run["seed"], run.get("epochs")


def load_runs(paths, epochs):
    """Successful runs of earlier ``--out`` files with these epochs, by (np, config, seed)."""
    found = {}
    for path in paths:
        for run in json.loads(Path(path).read_text()):
            if "error" not in run and run.get("epochs") == epochs:
                found[_key(run)[:3]] = run
    return found


def run_all(args, bindir):
    earlier = load_runs(args.load, args.epochs)
    jobs = [(n, c, s) for n in args.np for c in args.configs for s in args.seeds]
    todo = [j for j in jobs if j not in earlier]
    runs, started = [earlier[j] for j in jobs if j in earlier], time.monotonic()
    if earlier:
        print(f"reusing {len(runs)} runs from {', '.join(args.load)}; {len(todo)} to run", flush=True)
    with tempfile.TemporaryDirectory(prefix="hvdq_keras_fit_") as tmp:
        for i, (np_, config, seed) in enumerate(todo, 1):
            print(f"=== [{i}/{len(todo)}] np={np_} {config} seed {seed} "
                  f"({(time.monotonic() - started) / 60:.1f} min so far)", flush=True)
            run = run_one(bindir, np_, config, seed, args.epochs, args.timeout, tmp)
            if "error" in run:
                print(f"!!! FAILED: {run['error']}", flush=True)
                run["error"] = run["error"].splitlines()[0]
            else:
                print(f"    test acc {run['final_test_accuracy']:.4f}, identical weights "
                      f"{run['identical_weights']}, {run['bytes_per_step']:,.0f} bytes/step/rank "
                      f"({run['job_s']:.0f} s)", flush=True)
            runs.append(run)
            if args.out:  # after every job: a stopped run keeps what it has
                Path(args.out).write_text(json.dumps(runs, indent=1))
    return runs


def summarize(runs, np_, configs):
    """Per config at ``np_`` ranks: accuracies by seed (points), mean, range, the gap of
    the means to ``configs[0]`` and each seed's gap against the baseline's same seed."""
    rows = {}
    for config in configs:
        ok = sorted((r for r in runs if r["np"] == np_ and r["config"] == config and "error" not in r),
                    key=lambda r: r["seed"])
        failed = [r for r in runs if r["np"] == np_ and r["config"] == config and "error" in r]
        row = {"config": config, "failed": failed, "runs": ok}
        if ok:
            row["acc"] = {r["seed"]: 100 * r["final_test_accuracy"] for r in ok}
            row["mean"] = statistics.fmean(row["acc"].values())
            row["identical"] = all(r["identical_weights"] for r in ok)
            row["bytes"] = ok[-1]["bytes_per_step"]
        rows[config] = row
    base = rows.get(configs[0], {})
    for row in rows.values():
        if "mean" in row and "mean" in base:
            # Paired by seed (the same data order and initial weights): with the same seeds
            # on both sides this is the difference of the means.
            row["seed_gaps"] = {s: a - base["acc"][s] for s, a in row["acc"].items() if s in base["acc"]}
            if row["seed_gaps"]:
                row["gap"] = statistics.fmean(row["seed_gaps"].values())
    return rows


def markdown_table(args, runs):
    head = (f"| ranks | config | test acc, mean | range | per seed ({', '.join(map(str, args.seeds))}) "
            f"| vs {args.configs[0]} (mean) | per-seed gaps | identical weights | bytes/step/rank |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for np_ in args.np:
        for config, row in summarize(runs, np_, args.configs).items():
            if not row["runs"]:
                why = row["failed"][0]["error"] if row["failed"] else "not run"
                lines.append(f"| {np_} | {config} | FAILED ({why}) | | | | | | |")
                continue
            accs = list(row["acc"].values())
            note = f" ({len(row['failed'])} failed)" if row["failed"] else ""
            gap = f"{row['gap']:+.2f}" if "gap" in row else "–"
            gaps = " / ".join(f"{g:+.2f}" for g in row.get("seed_gaps", {}).values()) or "–"
            if config == args.configs[0]:
                gaps = ""
            same = "yes" if row["identical"] else "**no**"
            lines.append(f"| {np_} | {config} | {row['mean']:.2f}{note} | {min(accs):.2f}-{max(accs):.2f} "
                         f"| {' / '.join(f'{a:.2f}' for a in accs)} | {gap} | {gaps} | {same} "
                         f"| {row['bytes']:,.0f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    bindir = Path(sys.executable).parent
    runs = run_all(args, bindir)
    print(f"\nKeras 3 model.fit, digits MLP (64-128-64-10), {args.epochs} epochs, batch 32 per rank, "
          f"seeds {args.seeds}; SGD with momentum (lr 0.05) for the compressors\n")
    print(markdown_table(args, runs))
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
