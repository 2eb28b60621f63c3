"""What a probe step costs in torch with the probe's alltoall whole and in pieces: the
time-to-quality LM (``benchmarks/ttq_worker.py``, 7.4M parameters, 29.5 MB in two buckets
of at most 25 MB) with ``ef_sign`` on 2 emulated hosts at 1 Gbit/s, 100 steps per run:

* ``probes off``: metrics on, ``probe_every=0``;
* ``probe every 10, whole``: ``HVD_QUANT_PIECE_BYTES=0``, each probe's alltoall whole;
* ``probe every 10, pieces``: the default, 1 MiB pieces above 4 MiB a peer.

The rows take turns, ``ROUNDS`` times, on one cluster. A probe's excess is the row's mean
step time over probes off's, times 100 steps, over the 10 probes; ``probe_s`` is what the
metrics count of it (the probe's collectives and passes).

    .venv/bin/python benchmarks/reference/alltoall-pieces-2026-12-06/probe_cost.py OUT
"""

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from hvd_quant.cluster import EmulatedCluster  # noqa: E402

ROUNDS, STEPS = 3, 100
ROWS = {"probes off": ({"probe_every": 0}, {}),
        "probe every 10, whole": ({"probe_every": 10}, {"HVD_QUANT_PIECE_BYTES": "0"}),
        "probe every 10, pieces": ({"probe_every": 10}, {})}


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with EmulatedCluster(hosts=2, slots=1, rate="1gbit", log=print) as cluster:
        for i in range(ROUNDS):
            for name, (options, env) in ROWS.items():
                path = out / f"{name.replace(' ', '_').replace(',', '')}_{i}.json"
                cmd = [sys.executable, str(ROOT / "benchmarks" / "ttq_worker.py"), "--method", "ef_sign",
                       "--steps", str(STEPS), "--eval-every", str(STEPS), "--setting", "2x1-1gbit",
                       "--optimizer-options", json.dumps({**options, "report_after": 0}),
                       "--label", name, "--out", str(path)]
                job = cluster.run_horovod(cmd, timeout=900, env={"PYTHONPATH": str(ROOT), **env})
                if job.returncode != 0:
                    raise SystemExit(f"{name} round {i} failed:\n{job.tail(40)}")
                r = json.loads(path.read_text())
                m = r.get("metrics") or {}
                runs.append({"row": name, "round": i, "step_ms": 1e3 * r["step_time_s"],
                             "val_loss": r["final_val_loss"],
                             "probe_s": {k: v for k, v in m.items() if "probe_s" in k}})
                print(f"round {i + 1}/{ROUNDS} {name}: {runs[-1]['step_ms']:.1f} ms/step {runs[-1]['probe_s']}",
                      flush=True)
    base = statistics.median(r["step_ms"] for r in runs if r["row"] == "probes off")
    lines = ["| row | median ms/step | runs | a probe's excess, ms | loss at 100 |", "|---|---:|---|---:|---:|"]
    for name in ROWS:
        mine = [r for r in runs if r["row"] == name]
        med = statistics.median(r["step_ms"] for r in mine)
        excess = "" if name == "probes off" else f"{(med - base) * STEPS / 10:.0f}"
        steps = ", ".join(f"{r['step_ms']:.1f}" for r in mine)
        lines.append(f"| {name} | {med:.1f} | {steps} | {excess} | {mine[0]['val_loss']:.4f} |")
    (out / "probe_cost.json").write_text(json.dumps(runs, indent=1))
    (out / "probe_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
