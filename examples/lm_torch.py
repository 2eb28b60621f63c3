"""A small byte-level transformer language model on the Python standard library's source,
trained data-parallel under Horovod (PyTorch): Adam or SGD with momentum over an fp32
allreduce, or hvd_quant's 1-bit optimizers (1-bit Adam, 0/1 Adam, BinSGDM).

    horovodrun -np 2 -H localhost:2 --gloo python examples/lm_torch.py --optimizer adam
    horovodrun -np 2 -H localhost:2 --gloo python examples/lm_torch.py --optimizer zero_one_adam

Data: ``stdlib_text.py`` (no download; the corpus depends on the Python version). Every
rank evaluates its own weights on the same validation windows; the reported validation
loss is their mean over ranks (0/1 Adam's ranks hold different weights between syncs), and
the summary says whether the ranks' final weights are identical.
"""

import math
import os
import time
from collections import Counter

# One compute thread per rank: the ranks share the machine's cores. hvd_quant's numba
# kernels otherwise start a thread per core in every rank, and with 2 ranks on 2 cores
# that made 1-bit Adam's steps 6x slower here (numba reads this when it is imported).
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np
import torch
import torch.nn.functional as F
import horovod.torch as hvd

import hvd_quant.torch as hq
from stdlib_text import (BASELINES, VOCAB_SIZE, LMReport, TrainBatches, lm_arguments, load_corpus, lr_at,
                         validation_windows, weights_digest)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block (GPT-2 layout)."""

    def __init__(self, d_model, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.fc = torch.nn.Linear(d_model, 4 * d_model)
        self.proj = torch.nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class ByteTransformer(torch.nn.Module):
    """Decoder-only transformer over bytes; the output layer shares the embedding."""

    def __init__(self, context, d_model=128, heads=4, layers=2, vocab=VOCAB_SIZE):
        super().__init__()
        self.context = context
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d_model)
        self.apply(_init_weights)
        # GPT-2: scale the projections into the residual stream by depth, so the stream's
        # variance does not grow with the number of layers.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()


def _init_weights(module):
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, torch.nn.Linear) and module.bias is not None:
        torch.nn.init.zeros_(module.bias)


def make_optimizer(args, model):
    """The optimizer named by ``--optimizer``; baselines go through an fp32 allreduce."""
    params, named = list(model.parameters()), list(model.named_parameters())
    if args.optimizer in BASELINES:
        if args.optimizer == "adam":
            base = torch.optim.Adam(params, lr=args.lr, betas=(args.beta, args.beta2), eps=args.eps,
                                    weight_decay=args.weight_decay)
        else:
            base = torch.optim.SGD(params, lr=args.lr, momentum=args.beta, weight_decay=args.weight_decay)
        return hq.DistributedOptimizer(base, named_parameters=named, compression=hq.Compression.none)
    cls = getattr(hq, {"onebit_adam": "OnebitAdam", "zero_one_adam": "ZeroOneAdam",
                       "binsgdm": "BinSGDM"}[args.optimizer], None)
    if cls is None:
        raise SystemExit(f"--optimizer {args.optimizer}: this hvd_quant has no torch implementation "
                         "of it yet (hvd_quant.torch lacks the class); use adam or sgdm")
    common = dict(lr=args.lr, named_parameters=named, weight_decay=args.weight_decay)
    if args.optimizer == "onebit_adam":
        return cls(params, freeze_step=args.freeze_step, betas=(args.beta, args.beta2), eps=args.eps,
                   scales=args.scales, **common)
    if args.optimizer == "zero_one_adam":
        return cls(params, betas=(args.beta, args.beta2), eps=args.eps, var_freeze_step=args.var_freeze_step,
                   var_update_scaler=args.var_update_scaler, local_step_scaler=args.local_step_scaler,
                   local_step_clipper=args.local_step_clipper, scales=args.scales, **common)
    return cls(params, betas=(args.beta,), **common)


@torch.no_grad()
def evaluate(model, x, y, chunk=64):
    """Mean next-byte cross-entropy (nats) over the validation windows."""
    model.eval()
    total = 0.0
    for i in range(0, len(x), chunk):
        logits = model(x[i:i + chunk])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + chunk].reshape(-1),
                                 reduction="sum").item()
    model.train()
    return total / y.numel()


def main():
    args = lm_arguments(__doc__.splitlines()[0])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)  # ranks share the machine's cores
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.corpus_bytes)
    batches = TrainBatches(corpus.train, args.context, args.batch, args.seed, rank)
    x_val, y_val = (torch.from_numpy(a) for a in validation_windows(corpus.val, args.context, args.val_windows))

    model = ByteTransformer(args.context, args.d_model, args.heads, args.layers)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make_optimizer(args, model)
    numel = sum(p.numel() for p in model.parameters())
    report = LMReport(args, "torch", rank, size, numel, corpus, hvd.allgather_object)

    losses, train_time = [], 0.0
    for step in range(args.steps):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = (torch.from_numpy(a) for a in batches.next())
        begin = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))
        loss.backward()
        opt.step()
        train_time += time.perf_counter() - begin
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"rank {rank}: training loss is {losses[-1]} at step {step + 1}; "
                             f"lower --lr (now {args.lr})")
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            report.evaluation(done, lr, float(np.mean(losses)), evaluate(model, x_val, y_val),
                              _bytes(opt), _rounds(opt, done), train_time / done)
            losses = []
    digest = weights_digest([p.detach().numpy() for p in model.parameters()])
    report.finish(_kinds(opt, args.steps), digest, getattr(opt, "skipped_steps", 0))


def _bytes(opt):
    return float(opt.bytes_sent)


def _rounds(opt, steps):
    # The baselines allreduce once per step.
    return int(opt.comm_rounds) if hasattr(opt, "comm_rounds") else steps


def _kinds(opt, steps):
    kinds = getattr(opt, "step_kinds", None)
    return dict(Counter(kinds)) if kinds is not None else {"full": steps}


if __name__ == "__main__":
    main()
