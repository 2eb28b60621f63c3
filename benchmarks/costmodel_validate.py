"""The cost model against the measured steps: its error at every point of a scaling run.

    .venv/bin/python benchmarks/costmodel_validate.py \\
        --results benchmarks/results/scaling/results.json \\
        --calibration benchmarks/results/calibration/calibration.json --out-dir benchmarks/results/validation

For every measured point (link rate, layout, method) of ``bench_cluster.py --cases
scaling`` (or ``model``), the predicted step is

    the compute floor measured beside it (the paired ``local`` step)
    + the method's collectives (hvd_quant.core.costmodel.collectives: what the code issues,
      per bucket) at the link figures calibrated for that rate and layout
      (costmodel_calibrate.py, on Gloo's own collectives)
    + the method's passes over memory at the copy bandwidth measured in the same job

(for the 1-bit optimizers, whose own update replaces the floor's Adam step, the Adam
step's seven passes are taken off; PowerSGD's matrix products count at ``LinkModel.flops``,
an assumed 50 GFLOP/s unless the calibration measured one). The error is ``(predicted - measured) / measured``;
the issue's aim is 15% or less, and every point beyond it is listed as such.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(HERE))

from hvd_quant.core import costmodel  # noqa: E402

#: Benchmark rows and the cost model's names for them.
MODEL_NAME = {"horovod_fp32": "horovod_fp32", "hq_none": "none", "hq_fp16": "fp16"}
AIM = 0.15


def model_shapes(cfg):
    """Parameter shapes of the benchmark's TinyLM of config ``cfg`` (for PowerSGD)."""
    import torch
    from cluster_worker import TinyLM

    with torch.device("meta"):
        model = TinyLM(**cfg)
    return [tuple(p.shape) for p in model.parameters()]


def predict_point(run, name, link, shapes):
    """``(predicted s, parts)`` of method ``name`` at one run, or ``None`` if the model
    does not know it."""
    raw, summary = run["raw"], run["summary"]
    row = summary["methods"][name]
    cfg = raw["config"]
    d, n = int(cfg["numel"]), int(cfg["ranks"])
    slots = run.get("slots", 1) or 1
    k = slots if 1 < slots < n else None
    method = MODEL_NAME.get(name, name)
    options = {"shapes": shapes} if method == "ddp_powersgd" else None
    buckets = [d] if method == "horovod_fp32" else None  # Horovod fuses up to 64 MB
    segments = len(shapes)
    try:
        p = costmodel.predict(method, d, n, link, ranks_per_node=k, segments=segments, buckets=buckets,
                              options=options)
    except ValueError:
        return None
    copy_bps = summary["copy_gbps"] * 1e9
    memory = costmodel.memory_bytes(method, d, n, k, segments) / copy_bps
    if method in ("onebit_adam", "zero_one_adam", "binsgdm"):  # the 1-bit optimizers
        memory -= 7 * 4.0 * d / copy_bps  # the floor's Adam step, replaced by the optimizer's own
    floor = row.get("floor_s") or summary.get("compute_floor_s") or 0.0
    predicted = floor + p["comm_s"] + max(0.0, memory) + p["compute_s"]
    return predicted, {"floor_s": floor, "comm_s": p["comm_s"], "memory_s": memory + p["compute_s"],
                       "collectives": p["collectives"], "bytes": p["bytes"]}


def validate(results, calibration):
    from costmodel_calibrate import link_for

    rows = []
    for run in results["runs"]:
        if run["case"] not in ("model", "scaling") or run["case"] == "model" and not run["raw"]["config"].get("model"):
            continue
        link = link_for(calibration, run["rate_bps"], run["hosts"], run.get("slots", 1))
        if link is None:
            continue
        shapes = model_shapes(run["raw"]["config"]["model"])
        for name, row in run["summary"]["methods"].items():
            if name == "local":
                continue
            got = predict_point(run, name, link, shapes)
            if got is None:
                continue
            predicted, parts = got
            measured = row["median_s"]
            rows.append({"rate": run["rate"], "layout": f"{run['hosts']}x{run.get('slots', 1)}",
                         "ranks": run["hosts"] * run.get("slots", 1), "method": name,
                         "measured_s": measured, "predicted_s": predicted,
                         "error": (predicted - measured) / measured, **parts})
    return rows


def markdown(rows):
    lines = ["| rate | layout | method | measured ms | predicted ms | floor + comm + memory ms | "
             "collectives | error |", "|---|---|---|---:|---:|---|---:|---:|"]
    for r in rows:
        flag = "" if abs(r["error"]) <= AIM else " **beyond 15%**"
        lines.append(f"| {r['rate']} | {r['layout']} | {r['method']} | {1e3 * r['measured_s']:.0f} | "
                     f"{1e3 * r['predicted_s']:.0f} | {1e3 * r['floor_s']:.0f} + {1e3 * r['comm_s']:.0f} + "
                     f"{1e3 * r['memory_s']:.0f} | {r['collectives']} | {100 * r['error']:+.0f}%{flag} |")
    if rows:
        errs = [abs(r["error"]) for r in rows]
        within = sum(e <= AIM for e in errs)
        lines += ["", f"{within} of {len(rows)} points within 15%; median |error| "
                      f"{100 * statistics.median(errs):.0f}%, largest {100 * max(errs):.0f}%."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", required=True, nargs="+",
                   help="results.json of bench_cluster.py (scaling case), one or more")
    p.add_argument("--calibration", required=True, help="calibration.json of costmodel_calibrate.py")
    p.add_argument("--out-dir", default="", help="where validation.md and validation.json go (default: print)")
    args = p.parse_args(argv)
    runs = [r for path in args.results for r in json.loads(Path(path).read_text())["runs"]]
    rows = validate({"runs": runs}, json.loads(Path(args.calibration).read_text()))
    text = markdown(rows)
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.md").write_text(text)
        (out / "validation.json").write_text(json.dumps(
            [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows],
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
