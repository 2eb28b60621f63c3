"""Issue 55 at 8 hosts: the 200-step loss curves of DDP fp16 and of the `marsit`,
`global_qsgd` and `onebit` hooks (this folder, 8 ranks on loopback), priced at the step
times of 25-step runs on the emulated cluster (8 hosts x 1 rank at 100 Mbit/s) made in the
same session (`step/`), beside Horovod fp32 timed there too.
Usage: page_curves.py

The rule of ../ddp-8hosts-100mbit-2026-12-04/page_table.py: a row takes a curve only where
its timing run's validation loss at step 25 equals the curve's bit for bit. The curves do
not equal the timing runs of that folder (made in an earlier session; the script prints
both); they are checked here against this session's. Horovod fp32's curve is the 8-host
one of issue 51 (../ttq-8hosts-2026-12-03/), checked the same way."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ddp-8hosts-100mbit-2026-12-04"))
import page_table as P  # noqa: E402

T = P.T
ROWS = ("ddp_fp16", "ddp_marsit", "ddp_global_qsgd", "ddp_onebit")


def loopback_curve(method):
    return T.load(HERE / "loss" / "8x1-loopback" / f"{method}_s0_constant.json")


def checked(curve, timing_run):
    """The curve priced at ``timing_run``'s step times, or ``None`` where their step 25
    differs; and what was compared."""
    mine, theirs = T.loss_at(curve, 25), T.loss_at(timing_run, 25)
    ok = P.same(mine, theirs)
    return (P.priced(curve, timing_run) if ok else None), ("equal" if ok else f"{mine!r} against {theirs!r}")


def main():
    here = T.group_runs(T.load_runs(HERE / "step")).get((P.SETTING, "constant", 0), {})
    earlier = P.timing_runs(HERE.parent / "ddp-8hosts-100mbit-2026-12-04")
    fp32, fp32_check = checked(P.curve("horovod_fp32"), here["horovod_fp32"])
    print(f"Horovod fp32: its 8-host curve against this session's 25 steps at step 25: {fp32_check}; "
          f"{P.steady_ms(here['horovod_fp32']):,.0f} ms/step here")
    if fp32 is None:
        return
    final, at100 = fp32["history"][-1]["val_loss"], T.loss_at(fp32, 100)
    fp32_t = {"final": T.time_to_reach(fp32, final), "100": T.time_to_reach(fp32, at100)}
    print(f"| row | step 25: curve | this session's run | the earlier run | loss at step 200 | vs Horovod fp32's "
          f"final ({final:.4f}) | ms/step | vs Horovod fp32 | to fp32's final loss | to its step-100 loss ({at100:.4f}) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = P.steady_ms(here["horovod_fp32"])
    curves = {"horovod_fp32": fp32}
    for m in ROWS:
        curve = loopback_curve(m)
        p, _ = checked(curve, here[m])
        cells = []
        for key, target in (("final", final), ("100", at100)):
            t = T.time_to_reach(p, target) if p else None
            cells.append("not equal at step 25" if p is None else "not reached" if t is None
                         else f"{t:,.0f} s ({fp32_t[key] / t:.2f}x)")
        last, ms = curve["history"][-1]["val_loss"], P.steady_ms(here[m])
        print(f"| {m} | {T.loss_at(curve, 25)!r} | {T.loss_at(here[m], 25)!r} | {T.loss_at(earlier[m], 25)!r} | "
              f"{last:.4f} | {100 * (last / final - 1):+.1f}% | {ms:,.0f} | {base / ms:.2f}x | " + " | ".join(cells) + " |")
        if p is not None:
            curves[m] = p
    print(T.plot((P.SETTING, "constant", 0), curves, HERE / "ddp-8x1-100mbit-curves.png"))


if __name__ == "__main__":
    main()
