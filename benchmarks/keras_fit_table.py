"""Keras 3 ``model.fit`` on digits with every compressor and 1-bit optimizer, side by side.

    .venv/bin/python benchmarks/keras_fit_table.py --np 2 3
    .venv/bin/python benchmarks/keras_fit_table.py none cascading_sign --np 2 --seeds 0 1 2

Runs ``examples/keras_fit.py`` under ``horovodrun --gloo`` once per config, world size and
seed (the same data, epochs and seed for every config) and prints a markdown table: test
accuracy (the mean over seeds, and each seed's value), the gap to the first config in
accuracy points (``none``, SGD with momentum and an fp32 allreduce, unless told
otherwise), whether every rank ended with identical weights, and bytes sent per step per
rank. Configs: ``NAME`` or ``NAME:KEY=VALUE,...`` (a compressor in
``hvd_quant.tensorflow.DistributedOptimizer`` around SGD with momentum) or ``opt=NAME``
(``adam``, or a 1-bit optimizer: ``onebit_adam``, ``zero_one_adam``, ``binsgdm``).

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
    p.add_argument("--out", default=None, help="write every run's summary here (JSON)")
    return p.parse_args(argv)


def config_args(config):
    """``keras_fit.py`` arguments for one config."""
    if config.startswith("opt="):
        return ["--optimizer", config[len("opt="):]]
    return ["--compression", config]


def run_all(args, bindir):
    jobs = [(n, c, s) for n in args.np for c in args.configs for s in args.seeds]
    runs, started = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdq_keras_fit_") as tmp:
        for i, (np_, config, seed) in enumerate(jobs, 1):
            out = Path(tmp) / f"{i}.json"
            cmd = [str(bindir / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                   str(bindir / "python"), str(EXAMPLE), *config_args(config), "--epochs", str(args.epochs),
                   "--seed", str(seed), "--json", str(out)]
            print(f"=== [{i}/{len(jobs)}] np={np_} {config} seed {seed} "
                  f"({(time.monotonic() - started) / 60:.1f} min so far)", flush=True)
            run = {"np": np_, "config": config, "seed": seed, "command": " ".join(map(shlex.quote, cmd))}
            try:
                run_job(cmd, args.timeout, echo=False)
                run.update(json.loads(out.read_text()))
                print(f"    test acc {run['final_test_accuracy']:.4f}, identical weights "
                      f"{run['identical_weights']}, {run['bytes_per_step']:,.0f} bytes/step/rank", flush=True)
            except (JobFailed, FileNotFoundError) as exc:
                run["error"] = str(exc).splitlines()[0]
                print(f"!!! FAILED: {exc}", flush=True)
            runs.append(run)
    return runs


def markdown_table(args, runs):
    head = (f"| ranks | config | test acc (mean of {len(args.seeds)}) | per seed | vs {args.configs[0]} "
            "(points) | identical weights | bytes/step/rank |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for np_ in args.np:
        mean = {}
        for config in args.configs:
            ok = [r for r in runs if r["np"] == np_ and r["config"] == config and "error" not in r]
            failed = [r for r in runs if r["np"] == np_ and r["config"] == config and "error" in r]
            if not ok:
                lines.append(f"| {np_} | {config} | FAILED ({failed[0]['error'] if failed else 'not run'}) "
                             "| | | | |")
                continue
            accs = [100 * r["final_test_accuracy"] for r in ok]
            mean[config] = statistics.fmean(accs)
            base = mean.get(args.configs[0])
            gap = "–" if base is None else f"{mean[config] - base:+.2f}"
            same = "yes" if all(r["identical_weights"] for r in ok) else "**no**"
            note = f" ({len(failed)} failed)" if failed else ""
            lines.append(f"| {np_} | {config} | {mean[config]:.2f}{note} | {' / '.join(f'{a:.2f}' for a in accs)} "
                         f"| {gap} | {same} | {ok[-1]['bytes_per_step']:,.0f} |")
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
