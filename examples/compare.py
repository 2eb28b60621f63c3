"""Run an example once per compressor under horovodrun and print one comparison table.

    python examples/compare.py --framework torch --np 2 --epochs 30 none ef_sign marsit \
        "marsit:compensation=false" global_qsgd "global_qsgd:norm=l2"

Each config is ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE``. Every run uses the same seed,
data and epochs. Results are also written as JSON (``--out``).
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
    args = p.parse_args()

    bindir = Path(sys.executable).parent
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(args.configs):
            name, _, opts = config.partition(":")
            out = Path(tmp) / f"{i}.json"
            cmd = [str(bindir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
                   str(bindir / "python"), str(HERE / SCRIPTS[args.framework]), "--compression", name,
                   "--epochs", str(args.epochs), "--seed", str(args.seed), "--path", args.path,
                   "--json", str(out)]
            for opt in filter(None, opts.split(",")):
                cmd += ["--option", opt]
            print(f"=== [{i + 1}/{len(args.configs)}] {args.framework} np={args.np} {config}", flush=True)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=args.timeout)
            for line in proc.stdout.splitlines():
                # Rank 0's progress: the first epoch, every tenth, and the summary.
                if line.startswith("[0]<stdout>:") and ("epoch" in line or "final" in line):
                    text = line.split(":", 1)[1]
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

    print(f"\n{args.framework}, {args.np} ranks, {args.epochs} epochs, seed {args.seed}, path {args.path}")
    print(f"{'compression':34s} {'test acc':>9s} {'bytes/step/rank':>16s} {'vs fp32':>8s} {'step ms':>8s}")
    for r in results:
        if "error" in r:
            print(f"{r['config']:34s} {'FAILED':>9s}")
            continue
        ratio = r["fp32_allreduce_bytes_per_step"] / max(r["bytes_per_step"], 1e-9)
        print(f"{r['config']:34s} {r['final_test_accuracy']:9.4f} {r['bytes_per_step']:16,.0f} "
              f"{ratio:7.1f}x {r['mean_step_time_ms']:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
