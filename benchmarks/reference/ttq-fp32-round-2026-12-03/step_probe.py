"""Per-phase times of a training step of the time-to-quality LM (forward, backward, step), per
method, and each collective of 1-bit Adam's fp32 round: its start within ``step()`` and its length.

    .venv/bin/python -m hvd_quant.cluster run --hosts 2 --rate 100mbit -- env BAR=0 \\
        .venv/bin/python benchmarks/reference/ttq-fp32-round-2026-12-03/step_probe.py onebit_adam,horovod_fp32 24

BAR=1 (default) puts a barrier before each step; BAR=0 lets the ranks run as in training.
1-bit Adam's freeze_step is 80, as in the benchmark, so every step probed is an fp32 round.
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import ttq_worker as W  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import horovod.torch as hvd  # noqa: E402
from hvd_quant.torch.comm import HorovodTorchComm  # noqa: E402

CALLS = []  # (name, start, seconds) of the round's collectives in this step


def recorded(method):
    def wrapper(self, *args):
        start = time.perf_counter()
        out = method(self, *args)
        CALLS.append((args[-1] if method.__name__ == "allreduce" else args[3], start, time.perf_counter() - start))
        return out
    return wrapper


HorovodTorchComm.sendrecv = recorded(HorovodTorchComm.sendrecv)
HorovodTorchComm.allreduce = recorded(HorovodTorchComm.allreduce)
methods = sys.argv[1].split(",")
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
barrier = os.environ.get("BAR", "1") == "1"
hvd.init()
torch.set_num_threads(1)
args = W.parser().parse_args(["--method", "horovod_fp32", "--freeze-step", "80"])
args.tokens, args.lr_given = "words", False
train_ids, _, vocab, _ = W.load_tokens(args.tokens, args.vocab, args.corpus_bytes, args.context, args.batch)
batches = W.stdlib_text.TrainBatches(train_ids, args.context, args.batch, 0, hvd.rank())
for m in methods:
    torch.manual_seed(0)
    model = W.GPT(args.context, args.d_model, args.heads, args.layers, vocab=vocab)
    numel = sum(p.numel() for p in model.parameters())
    args.method = m
    trainer = W.METHODS[m].build(W.Context(hvd.rank(), hvd.size(), numel, args), model, 5e-4)
    rows = []
    for s in range(steps):
        x, y = (torch.from_numpy(a) for a in batches.next())
        if barrier:
            hvd.allreduce(torch.zeros(1), name=f"bar.{m}.{s}")
        t0 = time.perf_counter()
        trainer.opt.zero_grad()
        loss = F.cross_entropy(trainer.model(x).reshape(-1, vocab), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        CALLS.clear()
        trainer.opt.step()
        t3 = time.perf_counter()
        if hvd.rank() == 0 and m != "horovod_fp32":
            print(f"step {s} total {1e3 * (t3 - t0):.0f} ms; collectives (name, start in step(), ms):",
                  [(n[-12:], round(1e3 * (b - t2)), round(1e3 * d)) for n, b, d in CALLS if "check" not in n], flush=True)
        rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    if hvd.rank() == 0:
        med = [1e3 * statistics.median(r[i] for r in rows[2:]) for i in range(4)]
        print(f"{m:16s} medians from step 3: forward {med[0]:.0f} backward {med[1]:.0f} step() {med[2]:.0f} "
              f"total {med[3]:.0f} ms; mean total {1e3 * statistics.mean(r[3] for r in rows[2:]):.0f} ms", flush=True)
        print(f"{m:16s} per step total ms:", [round(1e3 * r[3]) for r in rows], flush=True)
