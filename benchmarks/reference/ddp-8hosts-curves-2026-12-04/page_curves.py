"""Issue 55 at 8 hosts: the 200-step loss curves of DDP fp16 and of the `marsit`,
`global_qsgd` and `onebit` hooks (this folder, 8 ranks on loopback), set beside the rows of
../ddp-8hosts-100mbit-2026-12-04/ (8 hosts x 1 rank at 100 Mbit/s, 25 timed steps each).
Usage: page_curves.py

These curves are not the timed runs' bits: at step 25 each differs from its timed run on
the cluster in the 6th or 7th digit (the script prints both), because torch's Gloo sums
in another order over loopback than between the emulated hosts. So, unlike
../ddp-8hosts-100mbit-2026-12-04/page_table.py, which takes a curve only where step 25 is
equal bit for bit, this prices each curve at its row's steady time per step on the
cluster as an estimate, and says so. Horovod fp32's curve and time are page_table.py's."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ddp-8hosts-100mbit-2026-12-04"))
import page_table as P  # noqa: E402

T = P.T
ROWS = ("ddp_fp16", "ddp_marsit", "ddp_global_qsgd", "ddp_onebit")


def main():
    timed = P.timing_runs(HERE.parent / "ddp-8hosts-100mbit-2026-12-04")
    fp32 = P.priced(P.curve("horovod_fp32"), timed["horovod_fp32"])
    final, at100 = fp32["history"][-1]["val_loss"], T.loss_at(fp32, 100)
    fp32_t = {"final": T.time_to_reach(fp32, final), "100": T.time_to_reach(fp32, at100)}
    print(f"| row | step 25 here | step 25 timed on the cluster | loss at step 100 | at step 200 | vs Horovod fp32's "
          f"final ({final:.4f}) | ms/step (cluster) | to fp32's final loss | to its step-100 loss ({at100:.4f}) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    curves = {"horovod_fp32": fp32}
    for m in ROWS:
        curve = T.load(HERE / "loss" / "8x1-loopback" / f"{m}_s0_constant.json")
        p = P.priced(curve, timed[m])
        cells = []
        for key, target in (("final", final), ("100", at100)):
            t = T.time_to_reach(p, target)
            cells.append("not reached" if t is None else f"{t:,.0f} s ({fp32_t[key] / t:.2f}x)")
        last = curve["history"][-1]["val_loss"]
        print(f"| {m} | {T.loss_at(curve, 25)!r} | {T.loss_at(timed[m], 25)!r} | {T.loss_at(curve, 100):.4f} | "
              f"{last:.4f} | {100 * (last / final - 1):+.1f}% | {P.steady_ms(timed[m]):,.0f} | " + " | ".join(cells) + " |")
        curves[m] = p
    print(T.plot(("8x1-100mbit", "constant", 0), curves, HERE / "ddp-8x1-100mbit-curves.png"))


if __name__ == "__main__":
    main()
