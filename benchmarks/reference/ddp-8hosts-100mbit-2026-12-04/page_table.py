"""Issue 55 at 8 hosts x 1 rank on 100 Mbit/s: the page's tables (docs/benchmarks/ddp.md),
from this folder's 25-step timing runs and the 200-step loss curves of the 8-host runs of
issue 51 (lr 5e-4, seed 0, freeze_step 40; the losses do not depend on the link).
Usage: page_table.py [FOLDER]   (default: this script's folder)

A row's time to a loss is its curve priced at this run's steady seconds per kind of step
(time_to_quality.seconds_per_kind: each kind's first step charged once), the same rule as
the harness's --time-curves. A row takes a curve only where bits say it may:
* a Horovod row: its own curve, if this run's validation loss at step 25 equals the curve's
  bit for bit (the 1-bit optimizers ran here with freeze_step 10, so their step 25 cannot
  be checked against a freeze_step-40 curve: theirs are taken as they are);
* a torch.distributed row: its own 200-step curve where one was run (DDP fp32, PowerSGD;
  DDP fp16 and the `marsit`, `global_qsgd` and `onebit` hooks since
  ../ddp-8hosts-curves-2026-12-04/), if this run's loss at step 25 equals it, else its Horovod twin's, if the two rows' losses at step 25 in this run are equal bit for
  bit (and the twin's curve is usable); otherwise no curve, and per step only."""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF = HERE.parent
sys.path.insert(0, str(REF.parent))  # benchmarks/
import time_to_quality as T  # noqa: E402

SETTING = "8x1-100mbit"
CURVES = {  # the 200-step curves at 8 hosts (lr 5e-4, seed 0, freeze_step 40)
    "horovod_fp32": "ttq-8hosts-2026-12-03/8x1-1gbit",
    "ddp_fp32": "ttq-8hosts-ddp-auto-onebit-2026-12-04/8x1-1gbit",
    "ddp_powersgd": "ttq-8hosts-ddp-auto-onebit-2026-12-04/8x1-1gbit",
    "ef_sign": "ttq-8hosts-rest-2026-12-03/loss/8x1-loopback",
    "marsit": "ttq-8hosts-rest-2026-12-03/loss/8x1-loopback",
    "global_qsgd": "ttq-8hosts-2026-12-03/loss/8x1-loopback",
    "onebit": "ttq-8hosts-ddp-auto-onebit-2026-12-04/loss/8x1-loopback",
    "onebit_adam": "ttq-8hosts-2026-12-03/loss/8x1-loopback",
    "zero_one_adam": "ttq-8hosts-2026-12-03/loss/8x1-loopback",
    "binsgdm": "ttq-8hosts-2026-12-03/loss/8x1-loopback",
    # the hooks whose step 25 differs from their Horovod twins, and DDP fp16: their own
    # curves, run later the same day (../ddp-8hosts-curves-2026-12-04/)
    "ddp_fp16": "ddp-8hosts-curves-2026-12-04/loss/8x1-loopback",
    "ddp_marsit": "ddp-8hosts-curves-2026-12-04/loss/8x1-loopback",
    "ddp_global_qsgd": "ddp-8hosts-curves-2026-12-04/loss/8x1-loopback",
    "ddp_onebit": "ddp-8hosts-curves-2026-12-04/loss/8x1-loopback",
}
ROWS = ("horovod_fp32", "ddp_fp32", "ddp_fp16", "ddp_powersgd", "ddp_ef_sign", "ef_sign", "ddp_marsit",
        "marsit", "ddp_global_qsgd", "global_qsgd", "ddp_onebit", "onebit", "onebit_adam_dist",
        "onebit_adam", "zero_one_adam_dist", "zero_one_adam", "binsgdm_dist", "binsgdm", "local")
FREEZE_10 = set(T.ONEBIT_OPTIMIZERS)  # timed with freeze_step 10 (step-optimizers/)


def timing_runs(folder):
    out = {}
    for sub in ("step", "step-optimizers"):
        out.update(T.group_runs(T.load_runs(folder / sub)).get((SETTING, "constant", 0), {}))
    return out


def curve(method):
    path = REF / CURVES[method] / f"{method}_s0_constant.json" if method in CURVES else None
    return T.load(path) if path and path.exists() else None


def same(a, b):
    return a is not None and b is not None and json.dumps(a) == json.dumps(b)


def choose_curves(timed):
    """``{row: (curve or None, where it came from)}`` by the rules of the docstring."""
    chosen = {}
    for m in ROWS:
        if m not in timed:
            continue
        own, step25 = curve(m), T.loss_at(timed[m], 25)
        if own is not None and (m in FREEZE_10 or same(step25, T.loss_at(own, 25))):
            chosen[m] = (own, "own curve" + ("" if m in FREEZE_10 else ", equal at step 25"))
        elif own is not None:
            chosen[m] = (None, f"own curve differs at step 25 ({T.loss_at(own, 25)!r} against {step25!r})")
    for m in ROWS:
        twin = T.horovod_twin(m)
        if m not in timed or m in chosen or twin is None:
            continue
        twin_curve = chosen.get(twin, (None,))[0]
        if twin_curve is not None and same(T.loss_at(timed[m], 25), T.loss_at(timed.get(twin, {}), 25)):
            chosen[m] = (twin_curve, f"{twin}'s curve, equal at step 25")
        else:
            chosen[m] = (None, f"no curve: step 25 {T.loss_at(timed[m], 25)!r}, {twin}'s "
                               f"{T.loss_at(timed.get(twin, {}), 25)!r}")
    return chosen


def renamed(time_by_kind, curve_kinds):
    """A DDP hook's one kind of step is named after the hook (``ddp_ef_sign``) and its
    twin's after the method (``ef_sign``): with one kind on each side, the same step."""
    if len(time_by_kind) == 1 and len(curve_kinds) == 1:
        return {next(iter(curve_kinds)): next(iter(time_by_kind.values()))}
    return time_by_kind


def priced(run_curve, timing_run):
    """The curve with training times at this run's seconds per kind (the harness's rule)."""
    per_kind = T.seconds_per_kind(renamed(timing_run["time_by_kind"], run_curve["history"][-1]["step_kinds"]))
    history = [{**h, "train_time_s": sum(n * per_kind[k][0] + per_kind[k][1]
                                         for k, n in (h.get("step_kinds") or {}).items() if n)}
               for h in run_curve["history"]]
    return {**run_curve, "history": history, "train_time_s": history[-1]["train_time_s"]}


def steady_ms(timing_run, kinds=None):
    """ms per step: this run's steady seconds per kind weighted by ``kinds`` (a schedule's
    counts; default the run's own)."""
    kinds = kinds or timing_run["history"][-1]["step_kinds"]
    per_kind = T.seconds_per_kind(renamed(timing_run["time_by_kind"], kinds))
    return 1e3 * sum(n * per_kind[k][0] for k, n in kinds.items()) / sum(kinds.values())


def main():
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    timed = timing_runs(folder)
    chosen = choose_curves(timed)
    fp32 = priced(chosen["horovod_fp32"][0], timed["horovod_fp32"])
    targets = {"final": fp32["history"][-1]["val_loss"], "step 100": T.loss_at(fp32, 100)}
    fp32_t = {k: T.time_to_reach(fp32, v) for k, v in targets.items()}
    base = steady_ms(timed["ddp_fp32"]) if "ddp_fp32" in timed else None
    print(f"| row | loss at step 200 | MB/step/rank | ms/step | vs DDP fp32 | "
          f"time to fp32's final loss ({targets['final']:.4f}) | to its step-100 loss ({targets['step 100']:.4f}) "
          f"| curve |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    curves_for_plot = {}
    for m in ROWS:
        if m not in timed:
            continue
        run, (c, where) = timed[m], chosen.get(m, (None, "no curve"))
        if c is not None and not all(k in renamed(run["time_by_kind"], c["history"][-1]["step_kinds"])
                                     for k in c["history"][-1]["step_kinds"]):
            c, where = None, f"{where}; not every kind timed"
        p = priced(c, run) if c is not None else None
        ms = steady_ms(run, c["history"][-1]["step_kinds"] if c else None)
        cells = []
        for k, v in targets.items():
            t = T.time_to_reach(p, v) if p else None
            cells.append("–" if p is None else "not reached" if t is None else f"{t:,.0f} s ({fp32_t[k] / t:.2f}x)")
        loss = f"{c['history'][-1]['val_loss']:.4f}" if c else "–"
        mb = (c or run)["bytes_per_step"] / 1e6
        print(f"| {m} | {loss} | {mb:.2f} | {ms:,.0f} | {base / ms:.2f}x | " + " | ".join(cells) + f" | {where} |")
        if p is not None and m != "local":
            curves_for_plot[m] = p
    print()
    print("| method | torch.distributed ms/step | Horovod ms/step | overhead |")
    print("|---|---:|---:|---:|")
    for m in ROWS:
        twin = T.horovod_twin(m)
        if m in timed and twin in timed:
            kinds = chosen.get(twin, (None,))[0]
            kinds = kinds["history"][-1]["step_kinds"] if kinds else None
            mine, theirs = steady_ms(timed[m], kinds), steady_ms(timed[twin], kinds)
            print(f"| {m} | {mine:,.0f} | {theirs:,.0f} | {100 * (mine / theirs - 1):+.1f}% |")
    print(T.plot((SETTING, "constant", 0), curves_for_plot, folder / "ddp-8x1-100mbit.png"))


if __name__ == "__main__":
    main()
