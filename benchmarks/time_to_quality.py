"""Time to quality: every method trains the same real-text transformer LM on the emulated
cluster; validation loss against steps and against wall-clock training time.

    sudo .venv/bin/python benchmarks/time_to_quality.py --settings 2x1-1gbit \\
        --methods horovod_fp32,ef_sign,binsgdm --steps 400           # a few methods
    sudo .venv/bin/python benchmarks/time_to_quality.py --resume \\
        --out benchmarks/reference/ttq-2026-12-01                    # the matrix, resumed
    .venv/bin/python benchmarks/time_to_quality.py --report-only --out DIR  # tables and plots again

A user does not buy steps; a user buys a model of a given quality, sooner. Each run is one
Horovod job of ``benchmarks/ttq_worker.py`` (one method, one seed, one schedule: see there
for the model, the data, the methods and what is recorded), on an
:class:`hvd_quant.cluster.EmulatedCluster` of the setting's hosts and link rate, or on this
machine's loopback under ``horovodrun`` (settings ``HxS-loopback``: tests, and the loss
curves alone). Rank 0 writes one JSON file per run, ``DIR/<setting>/<method>_s<seed>_<schedule>.json``.

Settings are ``<hosts>x<ranks per host>-<rate>``; the required ones are ``2x1-1gbit``,
``2x1-100mbit`` and ``8x1-1gbit`` (rates as ``hvd_quant.cluster`` reads them; also
``unlimited`` links, and ``loopback``).

The report (``DIR/report.md``, printed too) has one table per (setting, schedule, seed):

* final validation loss at equal steps, against the fp32 twin in % (a compressor's twin, and
  every baseline's, is Horovod fp32 with Adam; a 1-bit optimizer's is Adam, Horovod fp32's
  run too, or hvd_quant's own ``none`` where Horovod fp32 did not run);
* time to reach the twin's final validation loss (training time, the slowest rank's,
  interpolated linearly between evaluations) and the speed-up: the twin's training time over
  it;
* bytes sent per step per rank, communication rounds, time per step, step kinds.

A run that diverged (validation loss not finite, or above twice the initial one) is marked
so and plotted up to that point; a run that failed or ran out of time is marked so too, and
the matrix goes on with the next run. ``--resume`` skips every run whose JSON is finished
(``complete`` or ``diverged``) with the same steps, evaluation interval and learning rate.

Plots: one PNG per (setting, schedule, seed), loss against training time and against steps
side by side.
"""

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from hvd_quant.cluster import ClusterUnavailable, EmulatedCluster, JobTimeout, parse_rate  # noqa: E402
from hvd_quant.cluster.launch import run_ranks  # noqa: E402

WORKER = HERE / "ttq_worker.py"
REQUIRED_SETTINGS = ("2x1-1gbit", "2x1-100mbit", "8x1-1gbit")
#: Every method of the benchmark (ttq_worker.METHODS without the compute floor ``local``),
#: fp32 first: the others are compared with it.
ALL_METHODS = ("horovod_fp32", "horovod_fp16", "ddp_fp32", "ddp_powersgd", "none", "fp16", "ef_sign",
               "marsit", "onebit", "global_qsgd", "global_qsgd_exp", "cascading_sign", "auto", "qsgd",
               "onebit_adam", "zero_one_adam", "binsgdm")
#: Issue 55's rows, beside the matrix (``--methods``): DDP with our compressors as its
#: communication hooks (and DDP's own fp16 hook), and the 1-bit optimizers over
#: torch.distributed instead of Horovod.
TORCH_DISTRIBUTED_METHODS = ("ddp_fp16", "ddp_ef_sign", "ddp_marsit", "ddp_global_qsgd", "ddp_onebit",
                             "onebit_adam_dist", "zero_one_adam_dist", "binsgdm_dist")
ONEBIT_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "binsgdm", "onebit_adam_dist", "zero_one_adam_dist",
                     "binsgdm_dist")
FAMILIES = {m: m.replace("_dist", "") for m in ONEBIT_OPTIMIZERS}
FINISHED = ("complete", "diverged")


def family(method):
    return FAMILIES.get(method, "adam")


def parse_setting(text):
    """``"2x1-1gbit"`` -> ``(hosts, slots, rate)``; rate ``None`` for unlimited links,
    ``"loopback"`` for horovodrun on this machine."""
    try:
        layout, rate = text.split("-", 1)
        hosts, slots = (int(v) for v in layout.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"setting {text!r}: expected <hosts>x<ranks per host>-<rate>, "
                                         f"e.g. {', '.join(REQUIRED_SETTINGS)}")
    if hosts < 1 or slots < 1:
        raise argparse.ArgumentTypeError(f"setting {text!r}: hosts and ranks per host must be >= 1")
    if rate == "loopback":
        return hosts, slots, "loopback"
    return hosts, slots, parse_rate(None if rate == "unlimited" else rate)


def parse_lr(text):
    """``"adam=1e-3,binsgdm=3e-4"`` -> ``{family: lr}``."""
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("adam", "onebit_adam", "zero_one_adam", "binsgdm") or not value:
            raise argparse.ArgumentTypeError(f"--lr {item!r}: expected family=value with family one of "
                                             "adam, onebit_adam, zero_one_adam, binsgdm")
        out[key] = float(value)
    return out


def run_path(out, setting, method, seed, schedule):
    return Path(out) / setting / f"{method}_s{seed}_{schedule}.json"


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def finished(path, args, lr, stop_after=0):
    """The earlier result at ``path`` if it is finished for this very run, else None."""
    data = load(path)
    if not data or data.get("status") not in FINISHED:
        return None
    cfg = data.get("config", {})
    if cfg.get("steps") != args.steps or cfg.get("eval_every") != args.eval_every or cfg.get("lr") != lr:
        return None
    if (cfg.get("stop_after") or 0) != stop_after:
        return None
    return data


def log(msg):
    print(f"[ttq {datetime.now():%H:%M:%S}] {msg}", flush=True)


class Progress:
    """Stream for a job's output: rank 0's ``[ttq`` lines, hvd_quant's own lines (the "does it
    pay" verdict, auto's choices, the guard's warnings) and anything that looks like an error."""

    KEEP = ("[ttq", "hvd_quant", "Error", "Traceback", "Killed")

    def write(self, line):
        if any(k in line for k in self.KEEP):
            sys.stdout.write(line if line.endswith("\n") else line + "\n")

    def flush(self):
        sys.stdout.flush()


def loopback_job(cmd, ranks, timeout, env):
    """``horovodrun --gloo`` on this machine, as :func:`local_job`."""
    launcher = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}",
                "--gloo"]
    return local_job(launcher + cmd, timeout, env)


def local_job(argv, timeout, env):
    """Run ``argv`` on this machine under the emulated cluster's own launcher (one "rank"):
    a session of its own, its output streamed through :class:`Progress` and read on a
    thread, so the deadline holds for a job gone silent, and the whole session (children
    included) killed past ``timeout`` seconds, or when the harness itself is stopped.
    Returns the :class:`hvd_quant.cluster.JobResult`; past the deadline,
    :class:`JobTimeout`."""
    return run_ranks([argv], [{**os.environ, **env}], ["loopback"], timeout, stream=Progress())


def run_matrix(args):
    out = Path(args.out)
    runs = [(s, m, seed, sched) for s in args.settings for sched in args.schedule for seed in args.seeds
            for m in args.methods]
    log(f"{len(runs)} runs: settings {','.join(args.settings)}; methods {','.join(args.methods)}; "
        f"seeds {args.seeds}; schedules {args.schedule}; {args.steps} steps, evaluation every {args.eval_every}; "
        f"out {out}")
    began, done = time.monotonic(), 0
    for setting in args.settings:
        hosts, slots, rate = parse_setting(setting)
        todo = []
        for (s, method, seed, schedule) in runs:
            if s != setting:
                continue
            lr = args.lr.get(family(method))
            path = run_path(out, setting, method, seed, schedule)
            stop_after = 0
            if args.time_curves:  # time the first steps of a loopback loss curve on this setting
                path = run_path(out / "timing", setting, method, seed, schedule)
                loss_run = load(loss_curve_path(args.time_curves, setting, method, seed, schedule))
                if loss_run is None or loss_run.get("status") not in FINISHED:
                    done += 1
                    log(f"run {done}/{len(runs)} {setting} {method} seed {seed} {schedule}: no finished loss "
                        f"curve under {args.time_curves}, skipped")
                    continue
                lr = loss_run["config"]["lr"]
                stop_after = steps_to_time(loss_run, args.timing_min_steps)
            if args.resume and finished(path, args, lr if lr is not None else load_lr(path), stop_after):
                done += 1
                log(f"run {done}/{len(runs)} {setting} {method} seed {seed} {schedule}: finished earlier, skipped")
                continue
            todo.append((method, seed, schedule, lr, path, stop_after))
        if not todo:
            continue
        cluster = None
        if rate != "loopback":
            try:
                cluster = EmulatedCluster(hosts=hosts, slots=slots, rate=rate, log=lambda m: log(f"cluster: {m}"))
                cluster.start()
            except ClusterUnavailable as exc:
                log(f"error: setting {setting}: {exc}")
                return 3
        try:
            for method, seed, schedule, lr, path, stop_after in todo:
                done += 1
                label = f"{setting} {method} s{seed} {schedule}"
                log(f"run {done}/{len(runs)}: {label} ({(time.monotonic() - began) / 60:.1f} min elapsed)")
                path.parent.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, str(WORKER), "--method", method, "--steps", str(args.steps),
                       "--eval-every", str(args.eval_every), "--seed", str(seed), "--schedule", schedule,
                       "--setting", setting, "--label", label, "--out", str(path),
                       *(["--lr", repr(lr)] if lr is not None else []), *args.worker_arg,
                       *(["--stop-after", str(stop_after)] if stop_after else [])]
                env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "HOROVOD_GLOO_TIMEOUT_SECONDS": "600",
                       "PYTHONUNBUFFERED": "1",
                       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
                if path.exists():
                    path.unlink()  # an unfinished earlier attempt
                error = None
                try:
                    if cluster is None:
                        result = loopback_job(cmd, hosts * slots, args.run_timeout, env)
                    else:
                        result = cluster.run_horovod(cmd, timeout=args.run_timeout, env=env, stream=Progress())
                    elapsed = result.elapsed
                    if result.returncode != 0:
                        error = f"exit {result.returncode}\n{result.tail(40)}"
                except JobTimeout as exc:
                    error, elapsed = f"timeout after {args.run_timeout:.0f} s: {exc}", args.run_timeout
                data = load(path)
                if error is not None or data is None or data.get("status") not in FINISHED:
                    status = "timeout" if error and error.startswith("timeout") else "failed"
                    data = data or {"config": {"method": method, "seed": seed, "schedule": schedule,
                                               "setting": setting, "steps": args.steps}, "history": []}
                    data.update(status=status, error=(error or "no finished result written")[-4000:])
                    path.write_text(json.dumps(data, indent=1))
                    log(f"{label}: {status}; going on with the next run\n{(error or '')[-1500:]}")
                else:
                    log(f"{label}: {data['status']} in {elapsed:.0f} s, final val {data['final_val_loss']:.4f}, "
                        f"{1e3 * data['step_time_s']:.1f} ms/step")
        finally:
            if cluster is not None:
                cluster.close()
    return 0


# --- loss curves from loopback, times from the cluster (--time-curves) -------------------------
def loss_curve_path(loss_dir, setting, method, seed, schedule):
    """The loopback run with as many ranks as ``setting``: its losses are the cluster's, bit for
    bit (the link changes when bytes arrive, not which)."""
    hosts, slots, _ = parse_setting(setting)
    return run_path(loss_dir, f"{hosts * slots}x1-loopback", method, seed, schedule)


def steps_to_time(loss_run, min_steps):
    """How many of a loss curve's steps to time on the cluster: up to the first evaluation by
    which every kind of step the whole run took has been taken ``min_steps`` times (or as often
    as in the whole run), so every phase of the method is timed (warm-up, compressed, local)
    and at least one evaluation can be compared bit for bit."""
    hist = loss_run["history"]
    final = hist[-1].get("step_kinds") or {}
    for row in hist[1:]:
        kinds = row.get("step_kinds") or {}
        if all(kinds.get(k, 0) >= min(min_steps, n) for k, n in final.items()):
            return row["step"]
    return hist[-1]["step"]


def seconds_per_kind(time_by_kind):
    """``{kind: (seconds per step, one-time extra)}``: the steady mean leaves out each kind's
    first step (numba compiles, buffers are allocated), whose excess is charged once."""
    out = {}
    for kind, t in time_by_kind.items():
        steady = (t["total_s"] - t["first_s"]) / (t["steps"] - 1) if t["steps"] > 1 else t["total_s"]
        out[kind] = (steady, t["first_s"] - steady)
    return out


def platform_note(loss_run, timing_run):
    """Why two runs' bits may differ though code and seed agree: they ran on different CPUs
    (``ttq_worker.float_platform``), or one of them did not record its CPU."""
    a, b = (run["config"].get("platform") for run in (loss_run, timing_run))
    if a is None or b is None:
        return "; not both runs recorded their CPU (runs before 2026-12-05 did not), and the bits follow it"
    if a == b:
        return ""
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return (f"; the two runs ran on different CPUs or kernel libraries ({', '.join(changed)} differ), "
            "and ATen, MKL and oneDNN pick their kernels, and so the order of their sums, by the CPU: "
            "run the loss curve again on this machine")


def combine(loss_run, timing_run, loss_path, timing_path):
    """The loss curve with the cluster's training time: at each evaluation, every kind's step
    count times its cluster seconds per step (plus its first step's excess once). Refused
    (``status: "mismatch"``) unless the two runs' validation losses agree bit for bit at every
    evaluation both made, and every kind of step the curve took was timed."""
    timed = {row["step"]: row["val_loss"] for row in timing_run["history"] if row["step"] > 0}
    losses = {row["step"]: row["val_loss"] for row in loss_run["history"]}
    common = sorted(step for step in timed if step in losses)
    unequal = [step for step in common if json.dumps(timed[step]) != json.dumps(losses[step])]
    per_kind = seconds_per_kind(timing_run.get("time_by_kind") or {})
    untimed = sorted(set(loss_run["history"][-1].get("step_kinds") or {}) - set(per_kind))
    out = json.loads(json.dumps(loss_run))
    out["config"].update(setting=timing_run["config"]["setting"], hosts=timing_run["config"].get("hosts"),
                         rate_bps=timing_run["config"].get("rate_bps"))
    out["time_by_kind"] = timing_run.get("time_by_kind")
    out["derived"] = {"losses_from": str(loss_path), "times_from": str(timing_path), "bit_equal_steps": common,
                      "seconds_per_step_by_kind": {k: v[0] for k, v in per_kind.items()},
                      "first_step_excess_s": {k: v[1] for k, v in per_kind.items()}}
    if not common or unequal or untimed:
        out["status"] = "mismatch"
        out["error"] = (f"losses differ at steps {unequal}{platform_note(loss_run, timing_run)}" if unequal else
                        f"kinds {untimed} were not timed" if untimed else "no evaluation in common")
        return out
    for row in out["history"]:
        kinds = row.get("step_kinds") or {}
        row["train_time_s"] = sum(n * per_kind[k][0] + per_kind[k][1] for k, n in kinds.items() if n)
    out["train_time_s"] = out["history"][-1]["train_time_s"]
    out["step_time_s"] = out["train_time_s"] / max(1, out.get("steps_done") or out["history"][-1]["step"])
    return out


def combine_curves(args):
    """Write ``OUT/<setting>/<run>.json`` for every timing run under ``OUT/timing``."""
    out = Path(args.out)
    for timing_path in sorted((out / "timing").glob("*/*.json")):
        timing_run = load(timing_path)
        if not timing_run or timing_run.get("status") not in FINISHED:
            continue
        cfg = timing_run["config"]
        loss_path = loss_curve_path(args.time_curves, cfg["setting"], cfg["method"], cfg["seed"], cfg["schedule"])
        loss_run = load(loss_path)
        if loss_run is None:
            continue
        merged = combine(loss_run, timing_run, loss_path, timing_path)
        path = out / cfg["setting"] / timing_path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=1))
        if merged["status"] == "mismatch":
            log(f"{cfg['setting']} {cfg['method']}: {merged['error']}: not combined")


def load_lr(path):
    data = load(path)
    return (data or {}).get("config", {}).get("lr")


# --- the report ----------------------------------------------------------------------------------
def load_runs(out):
    runs = []
    for path in sorted(Path(out).glob("*/*.json")):  # OUT/timing/<setting>/ is one level deeper
        data = load(path)
        if data and "config" in data:
            data["_path"] = str(path)
            runs.append(data)
    return runs


def twin_of(method, by_method):
    """The fp32 run this method is compared with (see the module docstring)."""
    for name in ("horovod_fp32", "none"):
        if name in by_method and by_method[name].get("history"):
            return by_method[name]
    return None


def loss_at(run, step):
    for row in run.get("history", []):
        if row["step"] == step:
            return row["val_loss"]
    return None


def time_to_reach(run, target):
    """Training time at which the validation loss first reaches ``target`` (linear between
    evaluations), or None."""
    prev = None
    for row in run.get("history", []):
        loss = row["val_loss"]
        if loss == loss and loss <= target:
            if prev is None or prev["val_loss"] == loss:
                return row["train_time_s"]
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - loss)
            return prev["train_time_s"] + frac * (row["train_time_s"] - prev["train_time_s"])
        prev = row
    return None


def group_runs(runs):
    groups = {}
    for r in runs:
        c = r["config"]
        key = (c.get("setting", "?"), c.get("schedule", "?"), c.get("seed", 0))
        groups.setdefault(key, {})[c["method"]] = r
    return groups


def order(names):
    rank = {m: i for i, m in enumerate(ALL_METHODS + TORCH_DISTRIBUTED_METHODS)}
    return sorted(names, key=lambda m: (rank.get(m, len(rank)), m))


def table(key, by_method):
    setting, schedule, seed = key
    twin = twin_of(None, by_method)
    lines = [f"### {setting}, {schedule} lr, seed {seed}", ""]
    if twin is None:
        lines += ["(no fp32 run: nothing to compare with)", ""]
    else:
        tcfg = twin["config"]
        tsteps = twin["history"][-1]["step"]
        tloss = twin["history"][-1]["val_loss"]
        ttime = twin["history"][-1]["train_time_s"]
        m = tcfg.get("model", {})
        lines += [f"Model: {m.get('parameters', 0):,} parameters (vocab {m.get('vocab')}, width {m.get('d_model')}, "
                  f"{m.get('layers')} layers, context {m.get('context')}, {m.get('head', '?')} head); "
                  f"{tcfg.get('ranks')} ranks x {tcfg.get('batch_per_rank')} windows; lr by family "
                  f"{tcfg.get('lr_by_family')}. fp32 twin: {tcfg['method']}, final validation loss "
                  f"{tloss:.4f} at step {tsteps} in {ttime:.1f} s of training.", ""]
    lines += ["| method | status | val loss at equal steps | vs fp32 | time to fp32's loss | speed-up | "
              "MB/step/rank | rounds | ms/step | step kinds |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in order(by_method):
        r = by_method[name]
        hist = r.get("history", [])
        status = r.get("status", "?")
        if status == "diverged" and hist:
            status = f"**diverged** at step {hist[-1]['step']}"
        elif status == "mismatch":
            status = "**mismatch**: " + r.get("error", "")
        elif status not in FINISHED:
            status = f"**{status}**" + (f" at step {hist[-1]['step']}" if hist else "")
        loss = pct = reach = speed = "–"
        if twin is not None and hist:
            at = loss_at(r, tsteps)
            if at is not None and at == at:
                loss = f"{at:.4f}"
                pct = f"{100.0 * (at - tloss) / tloss:+.1f}%"
            t = time_to_reach(r, tloss) if r.get("status") != "mismatch" else None  # no cluster time
            if r.get("status") == "mismatch":
                reach = "–"
            elif t is not None:
                reach, speed = f"{t:.1f} s", (f"{ttime / t:.2f}x" if t > 0 else "–")
            else:
                reach = "not reached"
        steps_done = r.get("steps_done") or (hist[-1]["step"] if hist else 0)
        last = hist[-1] if hist else {}
        mb = (last.get("bytes_sent", 0.0) / steps_done / 1e6) if steps_done else float("nan")
        ms = (1e3 * last.get("train_time_s", 0.0) / steps_done) if steps_done else float("nan")
        if r.get("status") == "mismatch":
            ms = float("nan")  # its times are the loopback run's
        kinds = ", ".join(f"{k} {v}" for k, v in (last.get("step_kinds") or {}).items())
        lines.append(f"| {name} | {status} | {loss} | {pct} | {reach} | {speed} | {mb:.2f} | "
                     f"{last.get('comm_rounds', '–')} | {'–' if ms != ms else f'{ms:.0f}'} | {kinds} |")
    return "\n".join(lines) + "\n"


def horovod_twin(method):
    """The Horovod row a torch.distributed row is the twin of (``ddp_ef_sign`` -> ``ef_sign``,
    ``onebit_adam_dist`` -> ``onebit_adam``, ``ddp_fp32`` -> ``horovod_fp32``), or None."""
    if method in ("ddp_fp32", "ddp_fp16"):
        return "horovod_" + method[4:]
    if method in TORCH_DISTRIBUTED_METHODS:
        return method[4:] if method.startswith("ddp_") else method[:-len("_dist")]
    return None


def ms_per_step(run):
    """``(ms by kind, ms per step over the run)`` from the cluster's steady time of each
    kind of step, weighted by the run's own kinds (its schedule); ``None`` when untimed."""
    per_kind = (run.get("derived") or {}).get("seconds_per_step_by_kind")
    kinds = (run.get("history") or [{}])[-1].get("step_kinds") or {}
    if not per_kind or not kinds or any(k not in per_kind for k in kinds):
        return None
    by_kind = {k: 1e3 * per_kind[k] for k in kinds}
    return by_kind, sum(n * by_kind[k] for k, n in kinds.items()) / sum(kinds.values())


def torch_distributed_table(key, by_method):
    """Issue 55's rows beside DDP fp32, DDP PowerSGD and their Horovod twins: time per step
    (steady, per kind, from the cluster's timing runs; a twin whose loss curve is not this
    code's bits is still timed per step) and time to Horovod fp32's final loss."""
    rows = [m for m in order(by_method) if m in TORCH_DISTRIBUTED_METHODS + ("ddp_fp32", "ddp_powersgd")]
    if not rows:
        return ""
    fp32, psgd = by_method.get("horovod_fp32"), by_method.get("ddp_powersgd")
    target = fp32["history"][-1]["val_loss"] if fp32 and fp32.get("status") != "mismatch" else None

    def reach(run):
        if run is None or target is None or run.get("status") == "mismatch":
            return None
        return time_to_reach(run, target)

    base = ms_per_step(by_method["ddp_fp32"]) if "ddp_fp32" in by_method else None
    psgd_t = reach(psgd)
    lines = [f"#### {key[0]}: torch.distributed rows beside their Horovod twins", "",
             "| row | ms/step by kind | ms/step over the run | vs DDP fp32 | Horovod twin | its ms/step | "
             "vs twin | time to Horovod fp32's loss | vs DDP PowerSGD |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for name in rows:
        r, twin = by_method[name], horovod_twin(name)
        mine = ms_per_step(r)
        other = ms_per_step(by_method[twin]) if twin in by_method else None
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in mine[0].items()) if mine else "–"
        t = reach(r)
        lines.append("| " + " | ".join([
            name, kinds, f"{mine[1]:.0f}" if mine else "–",
            f"{base[1] / mine[1]:.2f}x" if mine and base else "–",
            twin or "–", f"{other[1]:.0f}" if other else "–",
            f"{100.0 * (mine[1] - other[1]) / other[1]:+.1f}%" if mine and other else "–",
            "not reached" if t is None and target is not None and r.get("status") in FINISHED
            else (f"{t:.1f} s" if t is not None else "–"),
            f"{psgd_t / t:.2f}x" if t and psgd_t else "–"]) + " |")
    return "\n".join(lines) + "\n"


def plot(key, by_method, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots")
        return None
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    twin = twin_of(None, by_method)
    # 17 methods and more: matplotlib's default cycle repeats after 10, so two rows would share
    # a colour; tab20 gives each of 20 its own (black for the fp32 twin).
    colours = iter(plt.get_cmap("tab20").colors)
    for name in order(by_method):
        hist = [row for row in by_method[name].get("history", []) if math.isfinite(row["val_loss"])]
        if not hist:
            continue
        style = "-" if name not in ONEBIT_OPTIMIZERS else "--"
        is_twin = by_method[name] is twin
        width, colour = (2.5, "black") if is_twin else (1.2, next(colours, None))
        label = name + (" (diverged)" if by_method[name].get("status") == "diverged" else "")
        for ax, x in ((ax_t, "train_time_s"), (ax_s, "step")):
            ax.plot([r[x] for r in hist], [r["val_loss"] for r in hist], style, lw=width, color=colour, label=label)
    if twin is not None:
        for ax in (ax_t, ax_s):
            ax.axhline(twin["history"][-1]["val_loss"], color="grey", ls=":", lw=1)
    # The first evaluation (the untrained model) squeezes the interesting part: clip it.
    finals = [r["history"][-1]["val_loss"] for r in by_method.values()
              if r.get("history") and math.isfinite(r["history"][-1]["val_loss"])]
    firsts = [r["history"][1]["val_loss"] for r in by_method.values()
              if len(r.get("history", [])) > 1 and math.isfinite(r["history"][1]["val_loss"])]
    if finals and firsts:  # every finished run's whole curve after its first evaluation shows
        done = [row["val_loss"] for r in by_method.values() if r.get("status") == "complete"
                for row in r.get("history", [])[1:] if math.isfinite(row["val_loss"])]
        ax_t.set_ylim(min(finals) - 0.1, max(firsts + done) + 0.1)
    ax_t.set_xlabel("training time, slowest rank (s)")
    ax_s.set_xlabel("step")
    ax_t.set_ylabel("validation loss (nats per token)")
    setting, schedule, seed = key
    fig.suptitle(f"Time to quality, {setting}, {schedule} lr, seed {seed}")
    ax_s.legend(fontsize=7, ncol=2)
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out):
    out = Path(out)
    runs = load_runs(out)
    if not runs:
        log(f"no run results under {out}")
        return 1
    parts = ["# Time to quality", ""]
    for key, by_method in sorted(group_runs(runs).items()):
        parts.append(table(key, by_method))
        parts.append(torch_distributed_table(key, by_method))
        setting, schedule, seed = key
        png = plot(key, by_method, out / f"ttq-{setting}-{schedule}-s{seed}.png")
        if png is not None:
            parts.append(f"![loss against time and steps, {setting}]({png.name})\n")
    text = "\n".join(parts)
    (out / "report.md").write_text(text)
    print(text, flush=True)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="2x1-1gbit",
                   help=f"comma-separated <hosts>x<ranks per host>-<rate> (required: {','.join(REQUIRED_SETTINGS)}; "
                        "also -unlimited and -loopback)")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated (ttq_worker.py's names)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seeds", default="0", help="comma-separated")
    p.add_argument("--schedule", default="constant", help="constant, warmup, or both comma-separated")
    p.add_argument("--lr", type=parse_lr, default={},
                   help="peak lr per family, e.g. adam=1e-3,binsgdm=1e-3 (default: ttq_worker.DEFAULT_LR)")
    p.add_argument("--out", default="", help="default benchmarks/reference/ttq-<date>")
    p.add_argument("--resume", action="store_true", help="skip runs whose JSON is finished")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds per run (killed past it)")
    p.add_argument("--report-only", action="store_true", help="rebuild tables and plots from the JSON files")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra argument for ttq_worker.py (repeatable), e.g. --worker-arg=--d-model=64")
    p.add_argument("--time-curves", default="", metavar="LOSS_DIR",
                   help="the issue's shortcut: time, on each cluster setting, the first steps of the loss "
                        "curves LOSS_DIR holds from loopback (same ranks, same --steps, --eval-every and "
                        "--worker-arg), check their losses bit for bit, and report the curves on the "
                        "cluster's time")
    p.add_argument("--timing-min-steps", type=int, default=20,
                   help="--time-curves: time each kind of step at least this often (or as often as the run)")
    args = p.parse_args(argv)
    args.out = args.out or str(HERE / "reference" / f"ttq-{datetime.now():%Y-%m-%d}")
    if args.timing_min_steps < 2:
        p.error("--timing-min-steps must be at least 2 (the first step of a kind is not its steady time)")
    if args.time_curves and not Path(args.time_curves).is_dir():
        p.error(f"--time-curves: no directory {args.time_curves}")
    if args.report_only:
        if args.time_curves:
            combine_curves(args)
        return report(args.out)
    args.settings = [s for s in args.settings.split(",") if s]
    for s in args.settings:
        try:
            parse_setting(s)
        except argparse.ArgumentTypeError as exc:
            p.error(str(exc))
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in ALL_METHODS + TORCH_DISTRIBUTED_METHODS + ("local",)]
    if unknown:
        p.error(f"unknown method(s) {unknown}; known: {', '.join(ALL_METHODS + TORCH_DISTRIBUTED_METHODS)} "
                "(and local, the compute floor)")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.schedule = [s for s in args.schedule.split(",") if s]
    if any(s not in ("constant", "warmup") for s in args.schedule):
        p.error("--schedule: constant, warmup or both")
    sys.path.insert(0, str(HERE))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    code = run_matrix(args)
    if args.time_curves:
        combine_curves(args)
    report(args.out)
    return code


def stop_on_signals():
    """``kill`` (SIGTERM), and Ctrl-C where a shell started the matrix in the background
    (which leaves SIGINT ignored), stop it the way Ctrl-C in a terminal does: by an
    exception, so that the running job's whole session is killed on the way out
    (the launcher's ``finally``: :func:`local_job` and the cluster run on it) instead of
    left running."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    stop_on_signals()
    sys.exit(main())
