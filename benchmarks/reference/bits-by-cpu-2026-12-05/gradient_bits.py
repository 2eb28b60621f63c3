"""Which kernel dispatcher moves the float bits of a training step on this CPU.

One process, one thread: the time-to-quality model (ttq_worker.MODEL) at seed 0's initial
weights and rank 0's first training batch of seed 0 (real words of the stdlib corpus, as
the benchmark draws them), forward and backward; prints a digest of every gradient's bytes
and the batch's loss. Run it under each switch (run.sh): a digest that changes means that
dispatcher's choice, which follows the CPU's instruction set, changes the bits.
"""
import hashlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
from lm_torch import ByteTransformer as GPT  # noqa: E402
from ttq_worker import BATCH, MODEL, load_tokens  # noqa: E402  (the benchmark's model and data)
import stdlib_text  # noqa: E402

torch.set_num_threads(1)
train, _, vocab, _ = load_tokens("words", MODEL["vocab"], stdlib_text.DEFAULT_MAX_BYTES, MODEL["context"], BATCH)
x, y = (torch.from_numpy(a) for a in stdlib_text.TrainBatches(train, MODEL["context"], BATCH, 0, 0).next())
torch.manual_seed(0)
model = GPT(MODEL["context"], MODEL["d_model"], MODEL["heads"], MODEL["layers"], vocab=vocab)
logits = model(x)
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
loss.backward()
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.grad.numpy().tobytes())
print(digest.hexdigest()[:16], repr(loss.item()), torch.backends.cpu.get_cpu_capability())
