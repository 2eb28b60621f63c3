"""Convergence of the fp32 baselines and hvd_quant's 1-bit optimizers on real workloads.

Runs every (workload, world size, optimizer) job under ``horovodrun --gloo``, each with a
time limit, and prints one markdown table: final validation loss (test accuracy for
digits), the gap to Adam in the same workload and world size, bytes sent per step per
rank, communication rounds, steps and wall time. All results go to a JSON file.

    python benchmarks/convergence.py                                   # everything
    python benchmarks/convergence.py --workloads lm_torch --np 2 \\
        --optimizers adam onebit_adam zero_one_adam --steps 600
    python benchmarks/convergence.py --extra "lm_torch/binsgdm=--lr 3e-4 --beta 0.95"

Workloads:

* ``lm_torch`` / ``lm_keras``: the byte-level transformer LM on the standard library's
  source (``examples/lm_torch.py``, ``examples/lm_keras.py``), ``--steps`` steps; the
  metric is the final validation loss (nats per byte; lower is better).
* ``digits``: ``examples/pytorch_train.py`` (MLP on scikit-learn's digits), ``--epochs``
  epochs; the metric is the final test accuracy. It needs that script's ``--optimizer``
  option; without it the workload is skipped with a message.

``--extra KEY=ARGS`` appends arguments to matching jobs; ``KEY`` is ``WORKLOAD``,
``WORKLOAD/OPTIMIZER`` or ``*/OPTIMIZER`` (repeatable, applied in order).

``--variant [WORKLOAD/]OPTIMIZER+TAG=ARGS`` adds one more job per workload and world size
(or only for WORKLOAD): OPTIMIZER with ARGS appended, listed as ``OPTIMIZER+TAG`` (e.g.
``--variant "binsgdm+lr3e-3=--lr 3e-3"``), so that a tuned setting sits in the same
table as the defaults and is compared with the same Adam row.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hvd_quant.cluster.launch import JobTimeout, run_ranks  # noqa: E402

EXAMPLES = ROOT / "examples"
OPTIMIZERS = ("adam", "sgdm", "onebit_adam", "zero_one_adam", "binsgdm")
WORKLOADS = {
    "lm_torch": {"script": "lm_torch.py", "metric": "final_val_loss", "kind": "loss"},
    "lm_keras": {"script": "lm_keras.py", "metric": "final_val_loss", "kind": "loss"},
    "digits": {"script": "pytorch_train.py", "metric": "final_test_accuracy", "kind": "accuracy"},
}
NOISE = ("I0000", "absl::InitializeLog", "cpu_feature_guard", "AVX2 AVX512", "oneDNN custom operations",
         "cudart_stub", "Could not find cuda")


class JobFailed(RuntimeError):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["lm_torch", "digits", "lm_keras"])
    p.add_argument("--np", nargs="+", type=int, default=[2, 3], help="world sizes")
    p.add_argument("--optimizers", nargs="*", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                   help="the optimizers at their defaults (none given: only the --variant jobs)")
    p.add_argument("--steps", type=int, default=600, help="LM training steps")
    p.add_argument("--epochs", type=int, default=30, help="digits epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", action="append", default=[], metavar="KEY=ARGS",
                   help="extra arguments for matching jobs, e.g. 'lm_torch/binsgdm=--lr 3e-4'")
    p.add_argument("--variant", action="append", default=[], metavar="[WORKLOAD/]OPTIMIZER+TAG=ARGS",
                   help="one more job per workload and world size, e.g. 'binsgdm+lr3e-3=--lr 3e-3'")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed job")
    p.add_argument("--quiet", action="store_true", help="do not echo the jobs' progress lines")
    p.add_argument("--out", default="convergence.json", help="JSON file for all results")
    args = p.parse_args(argv)
    for np_ in args.np:
        if np_ < 1:
            p.error(f"--np must be positive, got {np_}")
    for item in args.extra:
        key, sep, _ = item.partition("=")
        workload = key.split("/")[0]
        if not sep or (workload != "*" and workload not in WORKLOADS):
            p.error(f"--extra needs WORKLOAD[/OPTIMIZER]=ARGS with a known workload, got {item!r}")
    if not args.optimizers and not args.variant:
        p.error("nothing to run: give --optimizers or --variant")
    for item in args.variant:
        try:
            parse_variant(item)
        except ValueError as exc:
            p.error(str(exc))
    return args


def parse_variant(item):
    """``"[WORKLOAD/]OPTIMIZER+TAG=ARGS"`` -> ``(workload or None, optimizer, label, [args])``."""
    key, sep, value = item.partition("=")
    workload, _, name = key.rpartition("/")
    optimizer, plus, tag = name.partition("+")
    if not sep or not plus or not tag or optimizer not in OPTIMIZERS or (workload and workload not in WORKLOADS):
        raise ValueError(f"--variant needs [WORKLOAD/]OPTIMIZER+TAG=ARGS with a known optimizer, got {item!r}")
    return workload or None, optimizer, name, shlex.split(value)


def job_list(args, workloads):
    """``(workload, np, optimizer, label, variant args)`` for every job, in run order."""
    variants = [parse_variant(v) for v in args.variant]
    jobs = []
    for w in workloads:
        for n in args.np:
            jobs += [(w, n, o, o, []) for o in args.optimizers]
            jobs += [(w, n, o, label, extra) for vw, o, label, extra in variants if vw in (None, w)]
    return jobs


def extra_args(extras, workload, optimizer):
    """Arguments from ``--extra`` entries that match this job, in the order given."""
    out = []
    for item in extras:
        key, _, value = item.partition("=")
        want_workload, _, want_optimizer = key.partition("/")
        if want_workload in ("*", workload) and want_optimizer in ("", optimizer):
            out += shlex.split(value)
    return out


def digits_has_optimizer_option(python):
    """Whether ``examples/pytorch_train.py`` takes ``--optimizer`` (its ``--help`` runs
    before Horovod starts, so no launcher is needed)."""
    proc = subprocess.run([python, str(EXAMPLES / "pytorch_train.py"), "--help"], capture_output=True,
                          text=True, timeout=120, env=_env())
    return proc.returncode == 0 and "--optimizer" in proc.stdout


def job_command(bindir, workload, optimizer, np_, args, out, variant=()):
    cmd = [str(bindir / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
           str(bindir / "python"), str(EXAMPLES / WORKLOADS[workload]["script"]),
           "--optimizer", optimizer, "--seed", str(args.seed), "--json", str(out)]
    if workload == "digits":
        cmd += ["--epochs", str(args.epochs)]
    else:
        cmd += ["--steps", str(args.steps)]
    return cmd + extra_args(args.extra, workload, optimizer) + list(variant)


def run_job(cmd, timeout, echo):
    """Run one horovodrun job under the emulated cluster's launcher (a session of its own,
    its output read on a thread, the whole session killed past ``timeout`` seconds or when
    this harness is stopped); echo rank 0's lines as they come.

    Returns the output. Raises :class:`JobFailed` (with the output's tail) when the job
    exits non-zero or outlives ``timeout`` seconds."""
    try:
        result = run_ranks([cmd], [_env()], ["job"], timeout, stream=RankZeroEcho() if echo else None)
    except JobTimeout as exc:
        raise JobFailed(f"timed out after {timeout:.0f}s and was killed\n{tail(exc.result.rank_output[0])}")
    if result.returncode != 0:
        raise JobFailed(f"exit status {result.returncode}\n{tail(result.rank_output[0])}")
    return result.rank_output[0]


class RankZeroEcho:
    """The launcher's stream: horovodrun's lines from rank 0's stdout, indented."""

    def write(self, line):
        line = line.split("] ", 1)[-1]  # the launcher's "[job] " label
        if line.startswith("[0]<stdout>:"):
            print("    " + line.split(":", 1)[1].rstrip(), flush=True)

    def flush(self):
        pass


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
                HOROVOD_GLOO_TIMEOUT_SECONDS=os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "120"))


def tail(output, count=40):
    keep = [line for line in output.splitlines() if not any(n in line for n in NOISE)]
    return "\n".join("    | " + line for line in keep[-count:])


def summarize(workload, optimizer, np_, summary, wall):
    """One table row from a job's JSON summary (LM scripts or the digits example)."""
    row = {"workload": workload, "optimizer": optimizer, "np": np_, "wall_s": wall,
           "metric": summary.get(WORKLOADS[workload]["metric"]),
           "final_val_loss": summary.get("final_val_loss", summary.get("final_test_loss")),
           "final_test_accuracy": summary.get("final_test_accuracy"),
           "bytes_per_step": summary.get("bytes_per_step"),
           "fp32_allreduce_bytes_per_step": summary.get("fp32_allreduce_bytes_per_step"),
           "comm_rounds": summary.get("comm_rounds"), "steps": summary.get("steps"),
           "step_kinds": summary.get("step_kinds"), "ranks_agree": summary.get("ranks_agree"),
           "skipped_steps": summary.get("skipped_steps"),
           "step_time_ms": summary.get("step_time_ms", summary.get("mean_step_time_ms"))}
    return row


def add_gaps(rows):
    """Relative gap to Adam (same workload and world size): percent of Adam's loss for
    losses (positive = worse), accuracy points for accuracy (negative = worse)."""
    adam = {(r["workload"], r["np"]): r for r in rows if r["optimizer"] == "adam" and r.get("metric") is not None}
    for r in rows:
        base = adam.get((r["workload"], r["np"]))
        r["gap_to_adam"] = None
        if base is None or r.get("metric") is None:
            continue
        if WORKLOADS[r["workload"]]["kind"] == "loss":
            r["gap_to_adam"] = 100.0 * (r["metric"] - base["metric"]) / base["metric"]
        else:
            r["gap_to_adam"] = 100.0 * (r["metric"] - base["metric"])


def markdown_table(rows):
    head = ("| workload | ranks | optimizer | final val loss | test acc | vs Adam | bytes/step/rank "
            "| vs fp32 | comm rounds | steps | ms/step | ranks agree | wall s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['np']} | {r['optimizer']} | FAILED ({r['error']}) "
                       "| | | | | | | | | |")
            continue
        loss = f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "–"
        acc = f"{100 * r['final_test_accuracy']:.2f}" if r.get("final_test_accuracy") is not None else "–"
        gap = r.get("gap_to_adam")
        if gap is None:
            gap_text = "–"
        elif WORKLOADS[r["workload"]]["kind"] == "loss":
            gap_text = f"{gap:+.2f}%"
        else:
            gap_text = f"{gap:+.2f} pt"
        sent = r.get("bytes_per_step")
        fp32 = r.get("fp32_allreduce_bytes_per_step")
        ratio = f"{fp32 / sent:.1f}x" if sent and fp32 else "–"
        agree = {True: "yes", False: "no", None: "–"}[r.get("ranks_agree")]
        out.append(f"| {r['workload']} | {r['np']} | {r['optimizer']} | {loss} | {acc} | {gap_text} | "
                   f"{_num(sent)} | {ratio} | {_num(r.get('comm_rounds'))} | {_num(r.get('steps'))} | "
                   f"{_num(r.get('step_time_ms'), '.1f')} | {agree} | {r['wall_s']:.0f} |")
    return "\n".join(out)


def _num(value, fmt=",.0f"):
    return "–" if value is None else format(value, fmt)


def main(argv=None):
    args = parse_args(argv)
    bindir = Path(sys.executable).parent
    workloads = list(args.workloads)
    skipped = []
    if "digits" in workloads and not digits_has_optimizer_option(str(bindir / "python")):
        print("digits: examples/pytorch_train.py has no --optimizer option yet; skipping that workload",
              flush=True)
        workloads.remove("digits")
        skipped.append("digits: examples/pytorch_train.py has no --optimizer option")
    jobs = job_list(args, workloads)
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvdq_convergence_") as tmp:
        for i, (workload, np_, optimizer, label, variant) in enumerate(jobs, 1):
            out = Path(tmp) / f"{workload}-{np_}-{i}.json"
            cmd = job_command(bindir, workload, optimizer, np_, args, out, variant)
            elapsed = time.monotonic() - started
            print(f"=== [{i}/{len(jobs)}] {workload} np={np_} {label}  ({elapsed / 60:.1f} min so far)\n"
                  f"    $ {' '.join(shlex.quote(c) for c in cmd[5:])}", flush=True)
            begin = time.monotonic()
            try:
                run_job(cmd, args.timeout, echo=not args.quiet)
                if not out.exists():
                    raise JobFailed("the job exited 0 but rank 0 wrote no JSON summary")
                row = summarize(workload, label, np_, json.loads(out.read_text()), time.monotonic() - begin)
                row["command"] = cmd
                rows.append(row)
            except JobFailed as exc:
                print(f"!!! {workload} np={np_} {label} FAILED: {exc}", flush=True)
                first_line = str(exc).splitlines()[0]
                rows.append({"workload": workload, "optimizer": label, "np": np_, "command": cmd,
                             "error": first_line, "output_tail": str(exc), "wall_s": time.monotonic() - begin})
                if args.fail_fast:
                    break
    add_gaps([r for r in rows if "error" not in r])
    table = markdown_table(rows)
    print(f"\nseed {args.seed}; LM steps {args.steps}; digits epochs {args.epochs}; "
          f"total {(time.monotonic() - started) / 60:.1f} min\n")
    print(table)
    for note in skipped:
        print(f"\nskipped: {note}")
    Path(args.out).write_text(json.dumps({"settings": vars(args), "skipped": skipped, "rows": rows,
                                          "table": table}, indent=1))
    print(f"\nresults: {Path(args.out).resolve()}")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"{len(failed)} job(s) failed: "
              + ", ".join(f"{r['workload']} np={r['np']} {r['optimizer']}" for r in failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
