"""Run an example once per compressor or optimizer and print one comparison table.

    python examples/compare.py --framework torch --np 2 --epochs 30 none ef_sign marsit \
        "marsit:compensation=false" global_qsgd "global_qsgd:norm=l2" opt=zero_one_adam
    sudo .venv/bin/python examples/compare.py --cluster 1gbit --hidden 1024 none ef_sign opt=binsgdm

Each config is a compressor, ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (SGD with momentum in
our DistributedOptimizer), ``horovod`` (plain Horovod: its own ``hvd.DistributedOptimizer``,
fp32 allreduce, SGD with momentum), ``ddp`` / ``ddp_powersgd`` (torch's DDP with an fp32
allreduce or PowerSGD, SGD with momentum; torch only), or an optimizer, ``opt=NAME`` (``adam`` with an fp32
allreduce, or one of hvd_quant's 1-bit optimizers ``onebit_adam``, ``zero_one_adam``,
``binsgdm``). Every run uses the same seed, data and epochs. ``--plot FILE.png`` draws
test accuracy against training time, one line per config.

``--cluster RATE`` runs every job on an emulated cluster (``hvd_quant.cluster``: one
network namespace per rank, links shaped to RATE), so that the table's step times and
time to accuracy include a slow network. Where one cannot be made (not root, no ``ip``
or ``tc``), it says why and falls back to plain loopback ``horovodrun``. Results are also
written as JSON (``--out``).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"torch": "pytorch_train.py", "tf": "tensorflow2_train.py"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="*")
    p.add_argument("--configs", dest="only", default=None, metavar="A,B,...",
                   help="comma-separated configs that replace the ones given as arguments "
                        "(e.g. a short run of scripts/demo.sh: --configs horovod,ef_sign)")
    p.add_argument("--framework", choices=sorted(SCRIPTS), default="torch")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", choices=["ours", "stock"], default="ours")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", default=None, help="write all results to this JSON file")
    p.add_argument("--cluster", default=None, metavar="RATE",
                   help="run on an emulated cluster with links of this rate (e.g. 1gbit)")
    p.add_argument("--hidden", type=int, default=128, help="width of the MLP's hidden layers")
    p.add_argument("--target-accuracy", type=float, default=0.95)
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="test accuracy against training time, one line per config")
    args = p.parse_args()
    if args.only:
        args.configs = [c for c in args.only.split(",") if c]
    if not args.configs:
        p.error("give at least one config")
    cluster, where = start_cluster(args)

    bindir = Path(sys.executable).parent
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(args.configs):
            out = Path(tmp) / f"{i}.json"
            path = "stock" if config == "horovod" else config if config in ("ddp", "ddp_powersgd") else args.path
            script = [str(HERE / SCRIPTS[args.framework]), *config_args(config), "--epochs", str(args.epochs),
                      "--seed", str(args.seed), "--path", path, "--hidden", str(args.hidden),
                      "--target-accuracy", str(args.target_accuracy), "--json", str(out)]
            print(f"=== [{i + 1}/{len(args.configs)}] {args.framework} np={args.np} {config} ({where})", flush=True)
            begin = time.monotonic()
            job_env = env
            if config == "horovod" and args.framework == "tf":
                job_env = dict(env, TF_USE_LEGACY_KERAS="1")  # Horovod's stock tape needs Keras 2
            proc = run_job(cluster, args, bindir, script, job_env)
            for line in proc.stdout.splitlines():
                # Rank 0's progress: the first epoch, every tenth, and the summary.
                if line.startswith(RANK0_PREFIXES) and ("epoch" in line or "final" in line):
                    text = line.split(":", 1)[1] if line.startswith("[0]") else line.split("] ", 1)[1]
                    epoch = text.split("epoch")[1].split()[0] if " epoch " in text else ""
                    if "final" in text or epoch == "1" or (epoch.isdigit() and int(epoch) % 10 == 0):
                        print("   ", text, flush=True)
            if proc.returncode != 0 or not out.exists():
                tail = "\n".join([l for l in proc.stdout.splitlines() if "I0000" not in l][-25:])
                print(f"run failed (exit {proc.returncode}):\n{tail}", flush=True)
                results.append({"config": config, "error": proc.returncode})
                continue
            summary = json.loads(out.read_text())
            summary["config"] = config
            summary["job_wall_s"] = time.monotonic() - begin
            results.append(summary)
            print(f"    ({summary['job_wall_s']:.0f} s with start-up)", flush=True)

    if cluster is not None:
        cluster.close()
    print_table(args, results, where)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(args, results, where)
    return 1 if any("error" in r for r in results) else 0


RANK0_PREFIXES = ("[0]<stdout>:", "[r0@")


def config_args(config):
    """Command-line arguments of the example for one config."""
    if config == "horovod":
        return ["--compression", "none"]  # with --path stock
    if config in ("ddp", "ddp_powersgd"):
        return []  # with --path ddp / ddp_powersgd
    if config.startswith("opt="):
        return ["--optimizer", config[len("opt="):]]
    name, _, opts = config.partition(":")
    out = ["--compression", name]
    for opt in filter(None, opts.split(",")):
        out += ["--option", opt]
    return out


def start_cluster(args):
    """``(EmulatedCluster or None, description)``: the cluster when ``--cluster`` asks for
    one and this machine can make it, else ``None`` and loopback (saying why)."""
    if not args.cluster:
        return None, "loopback"
    try:
        from hvd_quant.cluster import ClusterError, ClusterUnavailable, EmulatedCluster

        cluster = EmulatedCluster(hosts=args.np, slots=1, rate=args.cluster,
                                  log=lambda m: print(f"[cluster] {m}", flush=True))
        cluster.start()
        return cluster, f"emulated cluster, {args.np} hosts, {args.cluster} links"
    except (ClusterError, ClusterUnavailable, OSError, ImportError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"[compare] no emulated cluster here ({reason}); falling back to loopback horovodrun, "
              "whose network is not limited", flush=True)
        return None, "loopback (emulated cluster unavailable)"


def run_job(cluster, args, bindir, script, env):
    if cluster is None:
        cmd = [str(bindir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
               str(bindir / "python"), *script]
        try:
            return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(cmd, 124, stdout=str(exc.stdout or ""))
    from hvd_quant.cluster import JobTimeout

    try:
        return cluster.run_horovod([str(bindir / "python"), *script], timeout=args.timeout,
                                   env={k: env[k] for k in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED", "TF_USE_LEGACY_KERAS")
                                        if k in env})
    except JobTimeout as exc:
        return subprocess.CompletedProcess(script, 124, stdout=str(exc))


def print_table(args, results, where):
    """Markdown: accuracy, bytes, step time, and training time to the target accuracy,
    with speed-ups against the first config (the baseline)."""
    print(f"\n{args.framework}, {args.np} ranks, {where}, MLP hidden {args.hidden}, {args.epochs} epochs, "
          f"seed {args.seed}; the first row is the baseline. Times are training steps only (evaluation "
          "excluded); 'step ms' averages every epoch (first-epoch tracing and warm-ups included), "
          "'late step ms' the second half of the epochs; bytes/step/rank averages the whole run.\n")
    print("| config | test acc | bytes/step/rank | vs fp32 | comm rounds | step ms | late step ms | "
          f"step speed-up | time to {args.target_accuracy:.0%} | speed-up | total train s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = next((r for r in results if "error" not in r), None)
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | FAILED (exit {r['error']}) | | | | | | | | | |")
            continue
        sent = r.get("mean_bytes_per_step", r["bytes_per_step"])
        ratio = r["fp32_allreduce_bytes_per_step"] / max(sent, 1e-9)
        late = r.get("late_step_time_ms", r["mean_step_time_ms"])
        step_up = base.get("late_step_time_ms", base["mean_step_time_ms"]) / late
        t = r.get("time_to_target_s")
        tt = f"{t:.1f} s (epoch {r['epochs_to_target']})" if t is not None else "not reached"
        bt = base.get("time_to_target_s")
        up = f"{bt / t:.2f}x" if t and bt else "–"
        rounds = r.get("comm_rounds")
        skipped = f" ({r['skipped_steps']} steps skipped: not finite)" if r.get("skipped_steps") else ""
        print(f"| {label(r)}{skipped} | {r['final_test_accuracy']:.4f} | {sent:,.0f} | {ratio:.1f}x | "
              f"{'–' if rounds is None else rounds} | {r['mean_step_time_ms']:.1f} | {late:.1f} | {step_up:.2f}x | "
              f"{tt} | {up} | {r['train_time_s']:.1f} |")


def label(r):
    names = {"horovod": "Horovod fp32 (stock, SGDM)", "none": "hvd_quant fp32 (SGDM)",
             "opt=adam": "Adam, fp32 allreduce", "ddp": "torch DDP fp32 (SGDM)",
             "ddp_powersgd": "torch DDP PowerSGD (SGDM)"}
    config = r["config"]
    if config in names:
        return names[config]
    if config.startswith("opt="):
        return f"{config[4:]} (1-bit optimizer)"
    return f"{config} (SGDM)"


def plot(args, results, where):
    """Test accuracy against cumulative training time, one line per config."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[compare] matplotlib is not installed; no plot", flush=True)
        return
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    ok = [r for r in results if "error" not in r]
    for r in ok:
        times = [h.get("train_time_s") for h in r["history"]]
        accs = [h["test_accuracy"] for h in r["history"]]
        style = "--" if r["config"].startswith("opt=") else "-"
        ax_t.plot(times, accs, style, marker=".", label=label(r))
    ax_t.axhline(args.target_accuracy, color="grey", lw=0.8, ls=":")
    ax_t.set_xlabel("training time (s, evaluation excluded)")
    ax_t.set_ylabel("test accuracy")
    ax_t.set_ylim(max(0.0, args.target_accuracy - 0.25), 1.0)
    ax_t.set_title(f"{args.framework}, {args.np} ranks, {where}")
    ax_t.legend(fontsize=7)
    names = [label(r) for r in ok]
    late = [r.get("late_step_time_ms", r["mean_step_time_ms"]) for r in ok]
    ax_b.barh(names, late, color="tab:blue")
    ax_b.set_xlabel("step time, second half of the epochs (ms)")
    ax_b.invert_yaxis()
    ax_b.tick_params(axis="y", labelsize=7)
    for y, r in enumerate(ok):
        sent = r.get("mean_bytes_per_step", r["bytes_per_step"])
        ax_b.text(late[y], y, f" {sent / 1e3:,.1f} kB/step", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
