"""Run an example once per compressor or optimizer and print one comparison table.

    python examples/compare.py --framework torch --np 2 --epochs 30 none ef_sign marsit \
        "marsit:compensation=false" global_qsgd "global_qsgd:norm=l2" opt=zero_one_adam
    sudo .venv/bin/python examples/compare.py --cluster 1gbit --hidden 1024 none ef_sign opt=binsgdm

Each config is a compressor, ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (SGD with momentum in
our DistributedOptimizer), or an optimizer, ``opt=NAME`` (``adam`` with an fp32 allreduce,
or one of hvd_quant's 1-bit optimizers ``onebit_adam``, ``zero_one_adam``, ``binsgdm``).
Every run uses the same seed, data and epochs.

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
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"torch": "pytorch_train.py", "tf": "tensorflow2_train.py"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+")
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
    args = p.parse_args()
    cluster, where = start_cluster(args)

    bindir = Path(sys.executable).parent
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(args.configs):
            out = Path(tmp) / f"{i}.json"
            script = [str(HERE / SCRIPTS[args.framework]), *config_args(config), "--epochs", str(args.epochs),
                      "--seed", str(args.seed), "--path", args.path, "--hidden", str(args.hidden),
                      "--target-accuracy", str(args.target_accuracy), "--json", str(out)]
            print(f"=== [{i + 1}/{len(args.configs)}] {args.framework} np={args.np} {config} ({where})", flush=True)
            proc = run_job(cluster, args, bindir, script, env)
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
            results.append(summary)

    if cluster is not None:
        cluster.close()
    print_table(args, results, where)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results) else 0


RANK0_PREFIXES = ("[0]<stdout>:", "[r0@")


def config_args(config):
    """Command-line arguments of the example for one config."""
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
                                   env={k: env[k] for k in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED")})
    except JobTimeout as exc:
        return subprocess.CompletedProcess(script, 124, stdout=str(exc))


def print_table(args, results, where):
    """Markdown: accuracy, bytes, step time, and training time to the target accuracy,
    with speed-ups against the first config (the baseline)."""
    print(f"\n{args.framework}, {args.np} ranks, {where}, MLP hidden {args.hidden}, {args.epochs} epochs, "
          f"seed {args.seed}, path {args.path}; time to {args.target_accuracy:.0%} test accuracy is "
          "training time (evaluation excluded)\n")
    print("| config | test acc | bytes/step/rank | vs fp32 | step ms | step speed-up | "
          f"time to {args.target_accuracy:.0%} | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    base = next((r for r in results if "error" not in r), None)
    for r in results:
        if "error" in r:
            print(f"| {r['config']} | FAILED (exit {r['error']}) | | | | | | |")
            continue
        ratio = r["fp32_allreduce_bytes_per_step"] / max(r["bytes_per_step"], 1e-9)
        step_up = base["mean_step_time_ms"] / r["mean_step_time_ms"]
        t = r.get("time_to_target_s")
        tt = f"{t:.1f} s (epoch {r['epochs_to_target']})" if t is not None else "not reached"
        bt = base.get("time_to_target_s")
        up = f"{bt / t:.2f}x" if t and bt else "–"
        print(f"| {r['config']} | {r['final_test_accuracy']:.4f} | {r['bytes_per_step']:,.0f} | {ratio:.1f}x | "
              f"{r['mean_step_time_ms']:.1f} | {step_up:.2f}x | {tt} | {up} |")


if __name__ == "__main__":
    sys.exit(main())
