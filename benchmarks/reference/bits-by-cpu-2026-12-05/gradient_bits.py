"""Which kernel dispatcher moves the float bits of a training step on this CPU.

One process, one thread: the time-to-quality model (ttq_worker.MODEL) at fixed initial
weights, one fixed batch of token ids (a determinism probe, no loss is reported from it),
forward and backward; prints a digest of every gradient's bytes and the loss. Run it under
each switch (run.sh): a digest that changes means that dispatcher's choice, which follows
the CPU's instruction set, changes the bits.
"""
import hashlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
from lm_torch import ByteTransformer as GPT  # noqa: E402
from ttq_worker import BATCH, MODEL  # noqa: E402  (the benchmark's model and windows per rank)

torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(MODEL["context"], MODEL["d_model"], MODEL["heads"], MODEL["layers"], vocab=MODEL["vocab"])
ids = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["context"] + 1), generator=torch.Generator().manual_seed(1))
logits = model(ids[:, :-1])
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
loss.backward()
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.grad.numpy().tobytes())
print(digest.hexdigest()[:16], repr(loss.item()), torch.backends.cpu.get_cpu_capability())
