"""What each rank runs in the cluster benchmark: every method, timed, interleaved per repeat.

    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- \\
        .venv/bin/python benchmarks/cluster_worker.py --case buffer --numel 25000000 --out r.json
    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/cluster_worker.py

Normally started by ``benchmarks/bench_cluster.py``. Horovod and torch.distributed (Gloo,
``env://``) are initialised in the same processes, so Horovod's allreduce, torch DDP and
hvd_quant run side by side on the same data in one job.

Cases
-----
``buffer``
    One parameter of ``--numel`` floats, shaped as a near-square matrix (25M floats:
    5000 x 5000, so PowerSGD has a matrix), with a fixed random gradient per rank. Only
    the gradient reduction is timed: the gradient is restored (untimed) before each call.
    Methods that only write ``.grad`` share the parameter; optimizers whose ``step()``
    updates it get a copy of their own (0/1 Adam's local steps, for one, leave the ranks'
    parameters a few ulps apart, which would fail the next method's agreement check).
``scaling``
    The ``model`` case with a small many-tensor model (:data:`SCALING_MODEL`: 3.7M
    parameters in 101 tensors, batch 1 of 16 tokens), so that 16 ranks fit on one 2-core
    machine with little compute each and the link and the collectives dominate. Each call
    also reads the host's link counters (``/sys/class/net/eth0/statistics``, inside the
    emulated host's namespace): the bytes that really left and entered the host per step,
    headers and Horovod's own coordination included, divided by the ranks on the host.
``model``
    A full training step (forward, backward, reduction, optimizer update) of a GPT-style
    language model built from ``torch.nn`` (:class:`TinyLM`: 31.7M parameters in 53
    tensors by default, a 32000-token vocabulary, width 384, 4 layers) on real text, 4
    sequences of 32 tokens per rank and step (see "Data" below), trained with Adam: Horovod's
    ``hvd.DistributedOptimizer(torch.optim.Adam)``, DDP with Adam, hvd_quant's compressors
    in ``hq.DistributedOptimizer(torch.optim.Adam)``, and the 1-bit optimizers in its
    place. Each method trains its own replica, all starting from the same seed. The
    ``local`` row is the same Adam step without any communication: the compute floor.

Data
----
Model cases train on word-level tokens of the Python standard library's source
(``examples/stdlib_text.py``: ``load_word_text``, the vocabulary the model's, 32000 words
for the LM and 8192 for the scaling model, built from the training files). Every step is a
new batch: each rank draws from its own stream (``TrainBatches`` seeded by ``(seed,
rank)``), and every method's replica trains on the same sequence of batches, pre-drawn
before any timing (the timed call indexes a tensor that is already there). After its
timed repeats each replica's loss on fixed held-out windows is measured (untimed) and
recorded with the last training loss, so a row whose optimizer diverged shows it. With
``--data random`` the old workload returns: one fixed batch of uniform random tokens per
rank, reused every step (its loss only measures memorisation). The raw JSON's
``config.data`` records the source and the corpus and vocabulary digests.

Timing
------
Methods are measured one after another, each *paired* with the baseline (Horovod fp32)
and, in the model case, the compute floor (``local``), which stay alive for the whole
job: a method is set up and warmed up (untimed: state creation, first-step agreement
checks, DDP's bucket rebuild, PowerSGD's uncompressed start-up iterations, the 1-bit
optimizers' full-precision phase), then each repeat runs the method, the baseline and
the floor once, in an order rotated by one per repeat, and the method is freed before
the next one is built. So every speed-up and every share of the ideal compares runs
interleaved within the same minutes (the machine's speed drifts by more than the
communication at 10 Gbit/s), and memory holds one method at a time besides the two
kept ones (2 ranks per host on one machine would not hold every replica at once).
Each call is preceded by its untimed ``prepare`` and a barrier (``hvd.barrier()``), and
timed on every rank with ``time.perf_counter``; a repeat's time is the slowest rank's.
A copy (``dst.copy_(src)`` of a buffer of the same size into a preallocated one) is
timed three times per repeat: the copy bandwidth of the buffer case's roofline.

Settings are the user's defaults: the only one the worker sets is torch's intra-op
threads, to what the docs recommend (``--threads 0``: the usable cores divided by
the ranks on this host, as Horovod's examples do); hvd_quant's kernels follow their own
thread policy, and both choices are printed.

Adding a method
---------------
A method is ``setup(ctx) -> Step``, registered under a name::

    def setup_my_sgd(ctx):
        # build whatever the method needs for ctx.case ("buffer" or "model")
        return optimizer_step(ctx, lambda params, named: MyOptimizer(params, lr=1e-3,
                                  named_parameters=named), warmup=3, touched=lambda d, n: 12 * 4 * d)

    register("my_sgd", setup_my_sgd, doc="what it is, in a few words")

:func:`optimizer_step` covers anything with ``step()`` that reduces gradients itself
(the 1-bit optimizers): in the buffer case it times ``step()`` on the shared 25M-float
parameter, in the model case a full training step of its own replica; it reads the bytes
sent from the optimizer's ``bytes_sent`` (hvd_quant's wire meter) and the kind of each
step from ``step_kinds``. For anything else, return a :class:`Step` directly.

Cost models (per rank, per call; ``d`` floats, ``F = 4 d`` bytes, ``n`` ranks)
---------------------------------------------------------------------------
Bytes sent: ring allreduce ``2 (n-1)/n`` times the buffer's bytes (Horovod, DDP), PowerSGD
the ring allreduce of its ``P`` and ``Q`` factors (plus uncompressed tensors), hvd_quant
methods what their wire meter counts (``hvd_quant.core.comm.WireMeter``).

Bytes touched (read + written in local memory) are lower bounds for each algorithm, in
passes over the buffer; each ``touched_*`` function below says which passes it counts.
Network copies (socket buffers) belong to the link term, not here.
"""

import argparse
import ctypes
import faulthandler
import gc
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import horovod.torch as hvd
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hvd_quant from this checkout
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "examples"))
from common import powersgd_bytes  # noqa: E402  (PowerSGD's byte model, shared with the examples)
import stdlib_text  # noqa: E402  (the word-level stdlib text the model cases train on)

import hvd_quant  # noqa: E402
import hvd_quant.torch as hq  # noqa: E402
from hvd_quant.core import costmodel  # noqa: E402  (the bytes-touched models, one place)
from hvd_quant.core.compressed_allreduce import compressed_allreduce_compensated, padded_size  # noqa: E402
from hvd_quant.torch.backend import TorchBackend  # noqa: E402
from hvd_quant.torch.comm import HorovodTorchComm  # noqa: E402


BASELINE = "horovod_fp32"


# --- the registry -----------------------------------------------------------------------------
@dataclass
class Step:
    """What a method's setup returns: the timed call and its cost model.

    run : the timed call (must return only when the reduction is complete)
    prepare : untimed, before each call (e.g. restore the input gradient)
    warmup : untimed calls before timing starts (3 by default: the first steps of a fresh
        model and optimizer pay page faults and first-use allocations, seen as a slow
        first timed repeat with one warm-up call)
    sent_bytes : bytes this rank sends per call (cost model); or use ``bytes_counter``
    bytes_counter : callable returning cumulative bytes sent (the per-call delta is recorded)
    touched_bytes : bytes read + written in local memory per call (lower bound)
    kind : callable returning a label of what the last call did (e.g. "onebit")
    skipped : callable returning True when the last call's step was skipped (hvd_quant's
        optimizers skip a step whose values are not finite: such a step does less work,
        so a timed one is counted and reported)
    feed : model cases: the replica's :class:`Feed` (its batches, its last loss)
    model : model cases: the replica, for the held-out loss after its repeats
    """
    run: Callable[[], object]
    prepare: Optional[Callable[[], object]] = None
    warmup: int = 3
    sent_bytes: Optional[float] = None
    bytes_counter: Optional[Callable[[], float]] = None
    touched_bytes: float = 0.0
    kind: Optional[Callable[[], str]] = None
    skipped: Optional[Callable[[], bool]] = None
    feed: Optional["Feed"] = None
    model: Optional[nn.Module] = None


@dataclass
class Method:
    name: str
    setup: Callable[["Context"], Step]
    cases: tuple = ("buffer", "model", "scaling")
    doc: str = ""


METHODS = {}

#: The cases that time a model's training step (the others time one buffer's reduction).
MODEL_CASES = ("model", "scaling")

#: The scaling case's model: a TinyLM of 3.7M parameters in 101 tensors (8 layers of
#: width 128), batch 1 of 16 tokens: 16 ranks fit on a 2-core machine, and a step's
#: compute is a few ms per rank.
SCALING_MODEL = dict(vocab=8192, dim=128, layers=8, heads=4, ff=512, seq=16)
SCALING_BATCH = 1
#: The model case's LM (:class:`TinyLM`'s defaults).
LM_MODEL = dict(vocab=32000, dim=384, layers=4, heads=6, ff=1536, seq=32)


def register(name, setup, cases=("buffer", "model", "scaling"), doc=""):
    """Add a method under ``name`` (see "Adding a method" in the module docstring)."""
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered")
    METHODS[name] = Method(name, setup, tuple(cases), doc)
    return METHODS[name]


# --- what the methods run on ------------------------------------------------------------------
class TinyLM(nn.Module):
    """A GPT-style decoder (pre-norm Transformer with a causal mask), built from ``torch.nn``.

    Default size (vocab 32000, width 384, 4 layers, 6 heads, MLP 1536, context 32): 31.7M
    parameters in 53 tensors, most of them in the embedding and the output projection, as
    in small LMs; at batch 4 its step is communication-bound on a 1 Gbit/s link.
    """

    def __init__(self, vocab=32000, dim=384, layers=4, heads=6, ff=1536, seq=32):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos.weight[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))

    def loss(self, batch):
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), batch[:, 1:].reshape(-1))


class Feed:
    """The batches one replica trains on, drawn before any timing: ``advance()`` (a step's
    untimed ``prepare``) moves to the next one, ``current``, which the timed step reads.
    Every replica gets its own Feed over the same batches, so every method trains on the
    same text in the same order; past the end it starts again (the pool is sized so that
    no method gets there, see :func:`pool_size`)."""

    def __init__(self, batches):
        self.batches, self.index, self.current = batches, -1, None
        self.last_loss = None  # the last step's training loss (a detached tensor)

    def advance(self):
        self.index += 1
        self.current = self.batches[self.index % len(self.batches)]


@dataclass
class Context:
    """What every method's setup sees. ``case`` is ``"buffer"`` or ``"model"``."""
    case: str
    rank: int
    size: int
    args: argparse.Namespace
    # buffer case: one shared parameter with a working gradient and its saved value
    weight: Optional[nn.Parameter] = None
    grad0: Optional[torch.Tensor] = None
    # model case: replicas built from one seed; this rank's batches, (steps, batch, seq + 1)
    # tokens, and the held-out windows (windows, seq + 1), the same on every rank
    batches: Optional[torch.Tensor] = None
    val_batch: Optional[torch.Tensor] = None
    data: Optional[dict] = None  # the data source, corpus and vocabulary digests (JSON)
    model_numel: int = 0

    @property
    def numel(self):
        return self.weight.numel() if self.case == "buffer" else self.model_numel

    def restore_grad(self):
        self.weight.grad.copy_(self.grad0)

    def replica(self):
        """A fresh model, identical on every rank and to every other replica."""
        torch.manual_seed(self.args.seed)
        return TinyLM(**model_config(self.args))

    def feed(self):
        """A new replica's :class:`Feed` over this rank's pre-drawn batches."""
        return Feed(self.batches)

    @staticmethod
    def train_step(model, feed, step):
        """zero_grad, forward on ``feed.current``, backward, then ``step()`` (reduction +
        update); the loss is kept (detached, not read: no extra work) in ``feed.last_loss``."""
        for p in model.parameters():
            p.grad = None
        loss = model_loss(model, feed.current)
        loss.backward()
        feed.last_loss = loss.detach()
        step()


def model_config(args):
    return dict(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ff=args.ff,
                seq=args.seq)


def model_loss(model, batch):
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if inner is model:
        return model.loss(batch)
    logits = model(batch[:, :-1])  # through DDP's forward, so its reducer sees the step
    return nn.functional.cross_entropy(logits.reshape(-1, inner.vocab), batch[:, 1:].reshape(-1))


def matrix_shape(numel):
    """Near-square ``(rows, cols)`` with ``rows * cols <= numel`` (25M -> 5000 x 5000)."""
    rows = max(1, int(numel ** 0.5))
    return rows, max(1, numel // rows)


# --- touched-bytes models (lower bounds, bytes per call; d floats, n ranks) -------------------
def touched_ring_fp32(d, n):
    """Ring allreduce in place: reduce-scatter reads own + received and writes own on
    (n-1)/n of the buffer (3 passes), all-gather writes the received (n-1)/n (1 pass);
    averaging folded into the last write."""
    return costmodel.memory_bytes("none", d, n)


def touched_fp16(d, n):
    """Cast down (read F, write F/2), fp16 ring allreduce on F/2, cast back (read F/2,
    write F)."""
    return costmodel.memory_bytes("fp16", d, n)


def touched_powersgd(d, n):
    """With error feedback: M = g + e (read 2F, write F), P = M Q and Q = M^T P (read M
    twice), output P Q^T (write F), new error M - P Q^T (read F, write F): 8 passes; the
    small factors' allreduce is negligible."""
    return costmodel.memory_bytes("ddp_powersgd", d, n)


def touched_sign(d, n):
    """ef_sign / marsit: scale sums and packed signs of g + e in one pass (read 2F, write
    bits F/32), then the residual and the decode of the packed inputs into the output
    (read 2F and the gathered bits, write e and the output: 2F; one fused pass,
    ``unpack_sum_residual``, after the gather for ef_sign and after the ring for marsit)."""
    return costmodel.memory_bytes("ef_sign", d, n)


def touched_cascading(d, n):
    """No residual: scale (read F), sign + pack (read F), decode (write F), and the folds
    of its hops in bytes of a copy (``costmodel.cascade_fold_bytes``: compute, measured)."""
    return costmodel.memory_bytes("cascading_sign", d, n)


def touched_integer(wire_bytes_per_element):
    """Global-QSGD (linear, exponential): scale (read F), quantize (read F, write W),
    ring allreduce/sum on W (4 W (n-1)/n), dequantize (read W, write F); ``W`` the wire
    buffer (bytes per element from the wire meter)."""
    def touched(d, n):
        w = wire_bytes_per_element * d
        return 3 * 4 * d + 2 * w + 4 * w * (n - 1) / n
    return touched


def touched_onebit(d, n):
    """DeepSpeed's compressed allreduce, with the server's state kept compensated (as
    hvd_quant runs it): worker sums of squares and signs (read x, e: 2F), server stage on
    F/n in one pass (read c_s, write the new c_s over it, its sums and signs taken from
    the cache: 2F/n), then the worker residual and the decode in one pass (read x, e,
    write e and the output: 4F); bit buffers (1/32 F each) neglected."""
    return costmodel.memory_bytes("onebit", d, n)


def touched_adam_onebit(d, n):
    """1-bit Adam step: momentum update (read m, g, write m: 3F), compressed allreduce of
    m, parameter update (read x, m, v, write x: 4F)."""
    return costmodel.memory_bytes("onebit_adam", d, n)


def touched_zero_one_adam(d, n):
    """0/1 Adam sync step: momentum (3F), local update of x and u (read m, v, x, u, write
    x, u: 6F), scaled accumulator into the compressed allreduce (read u, v, write: 3F),
    momentum re-estimate (2F), x correction (4F), u reset (F): 19F + the allreduce."""
    return costmodel.memory_bytes("zero_one_adam", d, n)


def touched_binsgdm(d, n):
    """BinSGDM step: momentum (3F), randomized sign of m / b (read m, b, write bits), 1-bit
    allreduce (as ef_sign without residual), update (read x and the result, write x: 3F)."""
    return costmodel.memory_bytes("binsgdm", d, n)


def touched_sgd_step(d, n):
    return 0.0


# --- helpers for methods ------------------------------------------------------------------------
def ring_bytes(nbytes, n):
    return 2.0 * (n - 1) / n * nbytes


def optimizer_step(ctx, make_optimizer, warmup=3, touched=touched_sgd_step, buffer_call="step"):
    """A :class:`Step` for an optimizer that reduces gradients itself (hvd_quant's).

    ``make_optimizer(params, named_parameters)`` builds it. Buffer case: ``buffer_call``
    (``"step"`` or ``"synchronize"``) on the shared parameter, gradient restored before
    each call. Model case: a full training step of the method's own replica.
    """
    if ctx.case == "buffer":
        if buffer_call == "synchronize":
            weight, prepare = ctx.weight, ctx.restore_grad  # only .grad changes: share it
        else:
            # step() updates the parameter: a copy of its own, so no method sees another's.
            weight = nn.Parameter(ctx.weight.detach().clone())
            weight.grad = ctx.grad0.clone()
            prepare = lambda: weight.grad.copy_(ctx.grad0)  # noqa: E731
        opt = make_optimizer([weight], [("weight", weight)])
        run = getattr(opt, buffer_call)
    else:
        model, feed = ctx.replica(), ctx.feed()
        opt = make_optimizer(list(model.parameters()), list(model.named_parameters()))
        run = lambda: ctx.train_step(model, feed, opt.step)  # noqa: E731
        prepare = feed.advance
    kinds = getattr(opt, "step_kinds", None)
    model_case = ctx.case != "buffer"
    return Step(run=run, prepare=prepare, warmup=warmup, bytes_counter=lambda: opt.bytes_sent,
                feed=feed if model_case else None, model=model if model_case else None,
                touched_bytes=touched(ctx.numel, ctx.size),
                kind=(lambda: kinds[-1] if kinds else "") if kinds is not None else None,
                skipped=(lambda: bool(opt.last_step_skipped)) if hasattr(opt, "last_step_skipped") else None)


def adam(params, args):
    """The base optimizer of every fp32 and compressor row (the 1-bit optimizers replace it):
    torch's default Adam, or its fused CPU kernel with ``--adam-fused`` (the tuning guide's
    tip, reported in the table's settings)."""
    return torch.optim.Adam(params, lr=args.lr, **({"fused": True} if args.adam_fused else {}))


# --- Horovod's own allreduce ------------------------------------------------------------------
def horovod_setup(fp16):
    def setup(ctx):
        d, n = ctx.numel, ctx.size
        if ctx.case == "buffer":
            g = ctx.weight.grad
            name = f"bench.horovod.{'fp16' if fp16 else 'fp32'}"
            if fp16:
                def run():
                    # Horovod's Compression.fp16: cast, allreduce, cast back into the gradient.
                    h = g.half()
                    hvd.allreduce_(h, op=hvd.Average, name=name)
                    g.copy_(h)
            else:
                def run():
                    hvd.allreduce_(g, op=hvd.Average, name=name)
            prepare = ctx.restore_grad
        else:
            model, feed = ctx.replica(), ctx.feed()
            opt = hvd.DistributedOptimizer(
                adam(model.parameters(), ctx.args), named_parameters=model.named_parameters(),
                compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
            run = lambda: ctx.train_step(model, feed, opt.step)  # noqa: E731
            prepare = feed.advance
        step = Step(run=run, prepare=prepare, sent_bytes=ring_bytes((2 if fp16 else 4) * d, n),
                    touched_bytes=(touched_fp16 if fp16 else touched_ring_fp32)(d, n))
        if ctx.case != "buffer":
            step.feed, step.model = feed, model
        return step
    return setup


register("horovod_fp32", horovod_setup(False),
         doc="hvd.allreduce_ (buffer) / hvd.DistributedOptimizer (model), fp32")
register("horovod_fp16", horovod_setup(True),
         doc="the same with Horovod's fp16 compression (cast, fp16 allreduce, cast back)")


# --- torch DDP over Gloo ------------------------------------------------------------------------
def ddp_setup(hook):
    """DDP with no hook (fp32 allreduce), ``fp16_compress_hook`` or PowerSGD.

    Buffer case: the reduction DDP runs at the end of backward, alone: DDP's own reducer
    runs its comm hook (or its built-in allreduce) on its bucket of the 25M-float
    parameter (``reducer._run_comm_hook``, as DDP's ``join`` does), the bucket refilled
    with the gradient before each call. Model case: a real DDP training step.
    """
    def setup(ctx):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        d, n = ctx.numel, ctx.size
        if ctx.case == "buffer":
            module = nn.Module()
            module.weight = ctx.weight  # shared; no forward/backward ever runs in this case
            # init_sync=False: the weight is identical on every rank already (one seed).
            model = nn.parallel.DistributedDataParallel(module, init_sync=False)
        elif hook == "powersgd":
            # One bucket for the whole model. With several buckets, PowerSGD over Gloo on CPU
            # races: each bucket's later allreduces (P, then Q) are issued from callbacks on
            # Gloo's worker threads when the earlier ones complete, interleaved with the
            # autograd thread issuing the next bucket's, so the ranks can issue collectives in
            # different orders (seen here: "Received data size doesn't match expected size",
            # or a hang). With NCCL the callbacks run at enqueue time and the order is fixed.
            model = nn.parallel.DistributedDataParallel(ctx.replica(), bucket_cap_mb=4096)
        else:
            model = nn.parallel.DistributedDataParallel(ctx.replica())
        warmup, state = 3, None
        if hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            # start_powerSGD_iter=2 is the smallest PowerSGD accepts with error feedback and
            # warm start; its first two iterations are plain allreduces, so warm up past them
            # (and one more, which creates P, Q and the error buffer).
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=ctx.args.powersgd_rank,
                                                start_powerSGD_iter=2, use_error_feedback=True,
                                                warm_start=True, random_seed=0)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            warmup = 4
        if ctx.case == "buffer":
            bucket = model.reducer._get_zeros_like_grad_buckets()[0]
            flat = ctx.grad0.reshape(-1)
            prepare = lambda: bucket.buffer().copy_(flat)  # noqa: E731
            run = lambda: model.reducer._run_comm_hook(bucket).wait()  # noqa: E731
            shapes = [tuple(ctx.weight.shape)]
        else:
            opt = adam(model.parameters(), ctx.args)
            feed = ctx.feed()
            prepare = feed.advance
            run = lambda: ctx.train_step(model, feed, opt.step)  # noqa: E731
            shapes = [tuple(p.shape) for p in model.parameters()]
        if hook == "powersgd":
            sent = powersgd_bytes(shapes, ctx.args.powersgd_rank, n)
            touched = touched_powersgd(d, n)
        elif hook == "fp16":
            sent, touched = ring_bytes(2 * d, n), touched_fp16(d, n)
        else:
            sent, touched = ring_bytes(4 * d, n), touched_ring_fp32(d, n)
        step = Step(run=run, prepare=prepare, warmup=warmup, sent_bytes=sent, touched_bytes=touched)
        if ctx.case != "buffer":
            step.feed, step.model = feed, model.module
        return step
    return setup


register("ddp_fp32", ddp_setup(None), doc="torch DDP over Gloo, no hook (fp32 allreduce)")
register("ddp_fp16", ddp_setup("fp16"), doc="torch DDP with fp16_compress_hook")
register("ddp_powersgd", ddp_setup("powersgd"),
         doc="torch DDP with powerSGD_hook (rank 4, error feedback, warm start)")


# --- hvd_quant compressors through hvd_quant.torch.DistributedOptimizer ------------------------
def compressor_setup(config, chunk_mb=None, bucket_mb=None):
    """``config`` is ``name`` or ``name:opt=value,...``; ``chunk_mb`` turns on the
    optimizer's chunk pipelining (``pipeline_chunk_mb``); ``bucket_mb`` is its
    ``bucket_size_mb`` (``None``: the default, buckets of an eighth of the model, 1 to 25 MB,
    reduced during backward; about 15 MB for this LM)."""
    name, _, opt_text = config.partition(":")
    options = dict(kv.split("=", 1) for kv in opt_text.split(",") if kv)
    touched = {"none": touched_ring_fp32, "fp16": touched_fp16, "ef_sign": touched_sign,
               "marsit": touched_sign, "cascading_sign": touched_cascading,
               "onebit": touched_onebit}.get(name)

    def setup(ctx):
        def make(params, named):
            return hq.DistributedOptimizer(adam(params, ctx.args), named_parameters=named,
                                           compression=hq.Compression.get(name, **options),
                                           pipeline_chunk_mb=chunk_mb,
                                           bucket_size_mb=bucket_mb)
        step = optimizer_step(ctx, make, buffer_call="synchronize")
        if touched is not None:
            step.touched_bytes = touched(ctx.numel, ctx.size)
        else:
            # integer methods: the wire width comes from the measured bytes (set after warm-up)
            step.touched_bytes = None
        return step
    return setup


def compressor_configs():
    return hvd_quant.available() + ["global_qsgd:norm=l2"]


def compressor_method_name(config):
    """Registry name of a compressor: its config, with hvd_quant's own ``none``/``fp16``
    called ``hq_none``/``hq_fp16`` so they are not mistaken for Horovod's."""
    return f"hq_{config}" if config in ("none", "fp16") else config


for _config in compressor_configs():
    register(compressor_method_name(_config), compressor_setup(_config),
             doc=f"hvd_quant.torch.DistributedOptimizer(compression={_config}).synchronize() "
                 "(buffer) / .step() (model)")

#: Chunk size of the pipelined rows (``pipeline_chunk_mb``).
PIPELINE_CHUNK_MB = 16
for _config in ("ef_sign", "global_qsgd"):
    register(f"{_config}+pipelined", compressor_setup(_config, chunk_mb=PIPELINE_CHUNK_MB),
             doc=f"the same with pipeline_chunk_mb={PIPELINE_CHUNK_MB}: chunk k+1 encoded while "
                 "chunk k is on the wire")


for _config in ("ef_sign", "global_qsgd"):
    register(f"{_config}+no_overlap", compressor_setup(_config, bucket_mb=0),
             doc="the same with bucket_size_mb=0: one fused buffer reduced at step() (the "
                 "default until 2026-11-26), to show what the default buckets buy")
    register(f"{_config}+25mb", compressor_setup(_config, bucket_mb=25),
             doc="the same with bucket_size_mb=25: DDP's fixed size, the default until 2026-12-07 "
                 "(the default now follows the model's size: about 15 MB for the model case's LM)")


# --- the 1-bit compressed allreduce and the 1-bit optimizers -----------------------------------
def onebit_allreduce_setup(ctx):
    """DeepSpeed's two-stage compressed allreduce (hvd_quant.core.compressed_allreduce), called directly on
    the gradient, with its worker and server error buffers."""
    B, comm = TorchBackend(), HorovodTorchComm()
    d, n = ctx.numel, ctx.size
    total = padded_size(d, n)
    state = {"we": torch.zeros(total), "cs": torch.zeros(total // n), "ss": torch.zeros(1)}
    g = ctx.weight.grad.reshape(-1)

    def run():
        # Decoded straight into the gradient (out=g), as hvd_quant's optimizer does.
        out, state["we"], state["cs"], state["ss"], _ = compressed_allreduce_compensated(
            B, comm, g, state["we"], state["cs"], state["ss"], "bench.onebit", out=g)
        if out.data_ptr() != g.data_ptr():  # padded buffers decode into one of their own
            g.copy_(out)
    return Step(run=run, prepare=ctx.restore_grad, bytes_counter=lambda: comm.meter.bytes_sent,
                touched_bytes=touched_onebit(d, n))


register("onebit_allreduce", onebit_allreduce_setup, cases=("buffer",),
         doc="1-bit compressed allreduce (1-bit Adam's collective), called directly")


#: Learning rate of the two Adam-family 1-bit optimizers. Their variance is frozen after one
#: or two steps here (so that the timed steps are 1-bit ones without minutes of fp32
#: warm-up), and Adam's step is then about 20 times the learning rate per element: at 1e-4
#: the model's loss on the fixed batch grows from step 4 and is no longer finite by step 10
#: or so, and a non-finite step is skipped, doing less work. At 1e-5 the loss falls steadily
#: (10.6 to 2.3 in 20 steps at 2 ranks). (Measured on the fixed random batch, now
#: ``--data random``.) Every timed step is checked (``Step.skipped``).
ONEBIT_ADAM_LR = 1e-5


def onebit_adam_setup(ctx):
    # freeze_step=2: two fp32 Adam steps (warm-up), every later step is a 1-bit step.
    return optimizer_step(ctx, lambda params, named: hq.OnebitAdam(
        params, lr=ONEBIT_ADAM_LR, named_parameters=named, freeze_step=2), warmup=4,
        touched=touched_adam_onebit)


def zero_one_adam_setup(ctx):
    # Variance frozen after step 1; then the default local-step policy (DeepSpeed's:
    # the interval starts at 1 and doubles every local_step_scaler=32678 steps), so each
    # timed step is 0/1 Adam's communicating step (1-bit sync of the accumulated update)
    # as in the first 32678 steps after the freeze.
    return optimizer_step(ctx, lambda params, named: hq.ZeroOneAdam(
        params, lr=ONEBIT_ADAM_LR, named_parameters=named, var_freeze_step=1), warmup=4,
        touched=touched_zero_one_adam)


def binsgdm_setup(ctx):
    return optimizer_step(ctx, lambda params, named: hq.BinSGDM(
        params, lr=1e-4, named_parameters=named), warmup=3, touched=touched_binsgdm)


def binsgdm_flat_setup(ctx):
    # The public option ranks_per_node=1: one flat 1-bit allgather of every rank's signs
    # instead of the default hierarchy that follows the hosts (the same with one rank per host).
    return optimizer_step(ctx, lambda params, named: hq.BinSGDM(
        params, lr=1e-4, named_parameters=named, ranks_per_node=1), warmup=3, touched=touched_binsgdm)


register("onebit_adam", onebit_adam_setup, doc="hvd_quant.torch.OnebitAdam after freeze_step (1-bit steps)")
register("zero_one_adam", zero_one_adam_setup,
         doc="hvd_quant.torch.ZeroOneAdam after var_freeze_step, default local-step policy")
register("binsgdm", binsgdm_setup, doc="hvd_quant.torch.BinSGDM (1-bit every step)")
register("binsgdm_flat", binsgdm_flat_setup,
         doc="hvd_quant.torch.BinSGDM(ranks_per_node=1): flat 1-bit allgather, no hierarchy")


# --- reference rows -----------------------------------------------------------------------------
def local_setup(ctx):
    """The model step without communication (plain Adam): the compute floor."""
    model, feed = ctx.replica(), ctx.feed()
    opt = adam(model.parameters(), ctx.args)
    return Step(run=lambda: ctx.train_step(model, feed, opt.step), prepare=feed.advance, sent_bytes=0.0,
                touched_bytes=0.0, feed=feed, model=model)


register("local", local_setup, cases=MODEL_CASES, doc="model step with no communication (compute floor)")


# --- the timing loop ---------------------------------------------------------------------------
#: Copies timed per repeat (one copy is short and noisy; all are kept in the raw results).
COPIES_PER_REPEAT = 3

def barrier():
    hvd.barrier()


def link_counters():
    """``(tx, rx)`` bytes of this emulated host's link so far, or ``None`` outside the
    emulated cluster (its ranks run in the host's namespace, where ``eth0`` is the link)."""
    if not os.environ.get("HVDQ_CLUSTER_PREFIX"):
        return None
    try:
        base = "/sys/class/net/eth0/statistics/"
        with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
            return int(tx.read()), int(rx.read())
    except (OSError, ValueError):
        return None


def log(ctx, msg):
    if ctx.rank == 0:
        print(f"[bench {ctx.args.label}] {msg}", flush=True)


def pool_size(names, args):
    """Batches to pre-draw: the kept methods (baseline, floor) run a warm-up (at most
    ``MAX_WARMUP`` calls) and then once per repeat with every paired method."""
    paired = [n for n in names if n not in (BASELINE, "local")]
    return MAX_WARMUP + args.repeats * max(1, len(paired))


#: The longest warm-up of any method (PowerSGD's and the Adam-family 1-bit optimizers': 4).
MAX_WARMUP = 8


def model_data(args, rank, steps):
    """This rank's ``steps`` training batches ``(steps, batch, seq + 1)``, the held-out
    windows ``(val_windows, seq + 1)`` and the JSON description of the data.

    ``stdlib``: word ids of the standard library's source (a vocabulary of the model's
    size), a new batch per step from this rank's stream. ``random``: the earlier workload,
    one fixed batch of uniform tokens reused every step (and random "held-out" tokens).
    """
    if args.data == "random":
        gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
        batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        gen = torch.Generator().manual_seed(args.seed + 2000)
        val = torch.randint(0, args.vocab, (args.val_windows, args.seq + 1), generator=gen)
        return batch[None], val, {"data": "random", "vocab_size": args.vocab}
    text = stdlib_text.load_word_text_once_per_host(hvd.local_rank() == 0, barrier, args.vocab, args.seq,
                                                   args.batch, max_bytes=args.corpus_bytes)
    x, y = stdlib_text.TrainBatches(text.train, args.seq, args.batch, args.seed, rank).take(steps)
    windows = np.concatenate([x, y[:, -1:]], axis=1).reshape(steps, args.batch, args.seq + 1)
    vx, vy = stdlib_text.validation_windows(text.val, args.seq, args.val_windows)
    val = np.concatenate([vx, vy[:, -1:]], axis=1)
    return torch.from_numpy(windows), torch.from_numpy(val), text.summary()


def validation_loss(step, ctx):
    """The replica's mean loss on the held-out windows (untimed, no gradients)."""
    with torch.no_grad():
        return float(step.model.loss(ctx.val_batch))


def build_context(args, rank, size, steps=1):
    ctx = Context(case=args.case, rank=rank, size=size, args=args)
    if args.case == "buffer":
        rows, cols = matrix_shape(args.numel)
        torch.manual_seed(args.seed)
        ctx.weight = nn.Parameter(torch.randn(rows, cols) * 0.01)
        gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
        ctx.grad0 = torch.randn(rows, cols, generator=gen)
        ctx.weight.grad = ctx.grad0.clone()
    else:
        ctx.batches, ctx.val_batch, ctx.data = model_data(args, rank, steps)
        torch.manual_seed(args.seed)
        ctx.model_numel = sum(p.numel() for p in TinyLM(**model_config(args)).parameters())
    return ctx


#: What the model case runs unless --methods says otherwise: the fp32 baselines a user
#: would otherwise run (Horovod, DDP), DDP's own compression (PowerSGD), every 1-bit
#: compressor, Global-QSGD and the 1-bit optimizers.
MODEL_DEFAULT = ("horovod_fp32", "ddp_fp32", "ddp_powersgd", "ef_sign", "marsit", "global_qsgd",
                 "onebit", "onebit_adam", "zero_one_adam", "binsgdm")
#: The scaling case: every method at its defaults against Horovod fp32 and DDP PowerSGD,
#: with hvd_quant's own fp32 path (``hq_none``: the same allreduce, waited for as
#: hvd_quant waits; Horovod's stock optimizer busy-waits).
SCALING_DEFAULT = ("horovod_fp32", "hq_none", "ddp_powersgd", "ef_sign", "marsit", "cascading_sign",
                   "global_qsgd", "global_qsgd_exp", "onebit", "onebit_adam", "zero_one_adam", "binsgdm")


def select_methods(args):
    if args.methods:
        names = [m for m in args.methods.split(",") if m]
    elif args.case in MODEL_CASES:
        names = list(MODEL_DEFAULT if args.case == "model" else SCALING_DEFAULT)
    else:
        names = [m for m, spec in METHODS.items() if args.case in spec.cases]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; registered: {', '.join(METHODS)}")
    skipped = [m for m in names if args.case not in METHODS[m].cases]
    names = [m for m in names if m not in skipped]
    if BASELINE not in names:
        names.insert(0, BASELINE)  # every method is paired with it
    if args.case in MODEL_CASES and "local" not in names:
        names.append("local")  # the model's compute floor, paired with every method
    return names, skipped


def init_torch_distributed(rank, size, timeout_s):
    """torch.distributed (Gloo) in the same processes as Horovod. Under the emulated
    cluster MASTER_ADDR/PORT are set; under plain horovodrun rank 0 picks a free local port
    and Horovod broadcasts it."""
    import datetime
    import socket

    if "MASTER_ADDR" not in os.environ:
        port = 0
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = hvd.broadcast_object(port, root_rank=0, name="bench.master_port")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def recommended_torch_threads():
    """What the docs recommend per rank: the usable cores (affinity, cgroup quota)
    divided by the ranks on this host, at least one."""
    from hvd_quant.kernels import threads

    cores, _ = threads.usable_cores()
    return max(1, cores // max(1, hvd.local_size()))


def timed_call(ctx, step, link=None):
    """One call of ``step``, after its prepare and a barrier: seconds on this rank. With a
    list ``link``, the host link's (tx, rx) bytes during the call are appended to it."""
    if step.prepare:
        step.prepare()
    barrier()
    before = link_counters() if link is not None else None
    t = time.perf_counter()
    step.run()
    elapsed = time.perf_counter() - t
    if before is not None:
        after = link_counters()
        link.append((after[0] - before[0], after[1] - before[1]))
    return elapsed


def resident_gb():
    """This process's resident memory (Linux), for the progress lines; 0 elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30
    except (OSError, ValueError):
        return 0.0


def return_freed_memory():
    """Hand the heap pages freed with a method back to the system, which glibc otherwise
    keeps: with 2 ranks per host, 4 ranks share this machine's memory (a dropped LM replica
    and its optimizer left 700 MB resident without this, 460 MB with it, 2026-11-26).
    Not glibc: nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure(args):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if not dist.is_initialized():
        init_torch_distributed(rank, size, args.gloo_timeout)
    threads = args.threads or recommended_torch_threads()
    torch.set_num_threads(threads)
    names, skipped = select_methods(args)
    ctx = build_context(args, rank, size, steps=pool_size(names, args))
    kept = [BASELINE] + (["local"] if "local" in names else [])
    paired = [n for n in names if n not in kept]
    from hvd_quant.kernels import threads as kernel_threads

    log(ctx, f"{size} ranks ({hvd.local_size()} on this host), case {args.case}, {ctx.numel:,} floats, "
             f"{len(names)} methods, {args.repeats} repeats; torch: {threads} intra-op thread(s) per rank "
             f"({'--threads' if args.threads else 'README recommendation: usable cores / ranks on this host'}); "
             f"{kernel_threads.describe()}"
             + (f"; not in this case: {', '.join(skipped)}" if skipped else ""))
    if ctx.data:
        log(ctx, "data: " + ", ".join(f"{k} {v}" for k, v in ctx.data.items()))

    def build(name):
        t0 = time.perf_counter()
        step = METHODS[name].setup(ctx)
        for _ in range(step.warmup):
            before = step.bytes_counter() if step.bytes_counter else 0.0
            timed_call(ctx, step)
            if step.bytes_counter:
                step.sent_bytes = step.bytes_counter() - before
        if step.touched_bytes is None:  # integer methods: wire bytes per element from the meter
            per_element = step.sent_bytes / max(1.0, ring_bytes(ctx.numel, size))
            step.touched_bytes = touched_integer(per_element)(ctx.numel, size)
        log(ctx, f"set up + {step.warmup} warm-up call(s): {name} ({time.perf_counter() - t0:.1f} s; "
                 f"rank 0 resident {resident_gb():.2f} GB)")
        cost[name] = {"sent": step.sent_bytes, "touched": step.touched_bytes}
        return step

    cost = {}  # name -> the cost model's bytes, kept after the method is freed
    steps = {name: build(name) for name in kept}
    src = torch.randn(ctx.numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = {name: [] for name in names}         # the method's own repeats
    pairs = {name: {k: [] for k in kept} for name in paired}  # the kept ones, interleaved with it
    kinds = {name: [] for name in names}
    skips = {name: 0 for name in names}  # timed calls whose step was skipped (non-finite)
    sent = {name: [] for name in names}
    link = {name: [] for name in names}  # the host link's (tx, rx) bytes per timed call
    copy_times = []
    losses = {name: {} for name in names}  # model cases: last training loss, held-out loss

    def record_losses(name, step):
        if step.feed is not None and step.feed.last_loss is not None:
            losses[name] = {"train_loss": float(step.feed.last_loss), "val_loss": validation_loss(step, ctx),
                            "steps": step.feed.index + 1}

    def run(name, step, rep, label):
        before = step.bytes_counter() if step.bytes_counter else 0.0
        elapsed = timed_call(ctx, step, link[name])
        if step.bytes_counter:
            sent[name].append(step.bytes_counter() - before)
        if step.kind:
            kinds[name].append(step.kind())
        if step.skipped and step.skipped():
            skips[name] += 1
        log(ctx, f"repeat {rep + 1}/{args.repeats} {label:34s} {1e3 * elapsed:9.1f} ms (rank 0)")
        return elapsed

    for name in paired or [None]:  # with nothing to pair, the kept ones still run once
        if name is not None:
            steps[name] = build(name)
        group = [n for n in [name] + kept if n is not None]
        for rep in range(args.repeats):
            for _ in range(COPIES_PER_REPEAT):
                barrier()
                t = time.perf_counter()
                dst.copy_(src)
                copy_times.append(time.perf_counter() - t)
            for n in group[rep % len(group):] + group[:rep % len(group)]:
                elapsed = run(n, steps[n], rep, n if n == name or name is None else f"{n} (with {name})")
                (times[n] if n == name or name is None else pairs[name][n]).append(elapsed)
        if name is not None:
            record_losses(name, steps[name])
            del steps[name]  # free its replica and state before the next method is built
            gc.collect()
            return_freed_memory()

    # Every rank's times, so a repeat counts as long as its slowest rank.
    def gather(values):
        t = hvd.allgather(torch.tensor(values, dtype=torch.float64).reshape(1, -1), name=f"gather.{len(values)}")
        return t.tolist()

    for k in kept:  # the kept methods' own series: all their paired runs, in order
        times[k] = [t for name in paired for t in pairs[name][k]] or times[k]
        record_losses(k, steps[k])
    result = {
        "config": {"case": args.case, "ranks": size, "local_size": hvd.local_size(), "numel": ctx.numel,
                   "repeats": args.repeats, "threads": threads, "threads_arg": args.threads,
                   "adam_fused": bool(args.adam_fused),
                   "kernel_threads": kernel_threads.describe(), "seed": args.seed,
                   "protocol": "paired",
                   "hosts": int(os.environ.get("HVDQ_CLUSTER_HOSTS", 0)) or None,
                   "slots": int(os.environ.get("HVDQ_CLUSTER_SLOTS", 0)) or None,
                   "rate_bps": float(os.environ.get("HVDQ_CLUSTER_RATE_BPS", 0)) or None,
                   "cpus": os.environ.get("HVDQ_CLUSTER_CPUS") or None,
                   "thp": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
                   "shape": list(ctx.weight.shape) if ctx.weight is not None else None,
                   "model": model_config(args) if args.case in MODEL_CASES else None,
                   "batch": args.batch if args.case in MODEL_CASES else None,
                   "data": ctx.data},
        "copy_s": gather(copy_times),
        "copy_bytes": 4 * ctx.numel,
        "methods": {},
        "skipped": skipped,
    }
    def link_per_rank(calls):
        """Median (tx, rx) bytes per call of this host's link, shared out over its ranks,
        averaged over the hosts (None outside the emulated cluster)."""
        mine = ([statistics.median(c[0] for c in calls), statistics.median(c[1] for c in calls)]
                if calls else [float("nan")] * 2)
        rows = gather(mine)
        if any(v != v for row in rows for v in row):  # NaN: no counters somewhere
            return None
        share = float(hvd.local_size())
        return {"tx": statistics.fmean(r[0] for r in rows) / share,
                "rx": statistics.fmean(r[1] for r in rows) / share}

    for name in names:
        step_sent = sent[name]
        result["methods"][name] = {
            "link_bytes": link_per_rank(link[name]),
            "times_s": gather(times[name]),          # [rank][repeat]
            "paired_s": {k: gather(v) for k, v in pairs[name].items()} if name in pairs else None,
            "sent_bytes": statistics.median(step_sent) if step_sent else cost[name]["sent"],
            "touched_bytes": cost[name]["touched"],
            "kinds": sorted(set(kinds[name])),
            "skipped_steps": skips[name],
            # model cases: this rank's (rank 0's) last training loss and held-out loss,
            # with the steps the replica took; {} in the buffer case
            "loss": losses[name],
            "doc": METHODS[name].doc,
        }
    return ctx, result


def main(argv=None):
    # `kill -USR1 <pid>` prints every thread's stack: how to see where a stuck rank waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=("buffer",) + MODEL_CASES, default="buffer")
    p.add_argument("--numel", type=int, default=25_000_000, help="buffer case: floats (default 25M)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default="", help="comma-separated names (default: all for the case)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per rank (default 0: the README's recommendation, usable "
                        "cores / ranks on this host)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--adam-fused", action="store_true",
                   help="torch.optim.Adam(fused=True) for the fp32, DDP, compressor and floor rows "
                        "(default: torch's default Adam, as a user's script has it)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None, help="model size (default: the case's model)")
    p.add_argument("--dim", type=int, default=None, help="model size (default: the case's model)")
    p.add_argument("--layers", type=int, default=None, help="model size (default: the case's model)")
    p.add_argument("--heads", type=int, default=None, help="model size (default: the case's model)")
    p.add_argument("--ff", type=int, default=None, help="model size (default: the case's model)")
    p.add_argument("--seq", type=int, default=None, help="model size (default: the case's model)")
    p.add_argument("--batch", type=int, default=None,
                   help="model cases: sequences per rank per step (default 4; scaling: 1)")
    stdlib_text.add_data_arguments(p, "one fixed batch of random tokens reused every step", "model cases: ")
    p.add_argument("--gloo-timeout", type=float, default=600)
    p.add_argument("--label", default="", help="shown in progress lines")
    p.add_argument("--out", default="", help="rank 0 writes the raw results here (JSON)")
    p.add_argument("--list", action="store_true", help="list the registered methods and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, spec in METHODS.items():
            print(f"{name:22s} {'/'.join(spec.cases):13s} {spec.doc}")
        return 0
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.label = args.label or args.case
    sizes = SCALING_MODEL if args.case == "scaling" else LM_MODEL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch is None:
        args.batch = SCALING_BATCH if args.case == "scaling" else 4
    ctx, result = measure(args)
    if ctx.rank == 0:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        for name, r in result["methods"].items():
            slowest = [max(col) for col in zip(*r["times_s"])]
            print(f"[bench {args.label}] median {name:22s} {1e3 * statistics.median(slowest):9.1f} ms "
                  f"{r['sent_bytes'] / 1e6:9.2f} MB sent", flush=True)
    barrier()
    hvd.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
