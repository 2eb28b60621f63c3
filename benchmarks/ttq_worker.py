"""What each rank runs in the time-to-quality benchmark: one method trains a real-text
transformer LM for ``--steps`` steps; validation loss against steps and training time.

    python -m hvd_quant.cluster run --hosts 2 --rate 1gbit -- \\
        .venv/bin/python benchmarks/ttq_worker.py --method ef_sign --steps 400 --out r.json
    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python benchmarks/ttq_worker.py \\
        --method none --steps 30 --out r.json

Normally started by ``benchmarks/time_to_quality.py``, once per (setting, method, seed,
schedule). Speed per step is what ``cluster_worker.py`` measures; this measures what a user
buys, a model of a given quality, and how soon.

The model
---------
GPT-2's layout (Radford et al., 2019), from ``examples/lm_torch.py``: token plus learned
position embeddings, pre-LayerNorm blocks of causal self-attention and a 4x MLP (GELU),
a final LayerNorm, and an output layer **tied** to the token embedding (as GPT-2's). Its
parameters mix one large embedding matrix with the blocks' matrices, biases and norms, as
GPT-2's do. The default size (:data:`MODEL`: 7.37M parameters, 4.2M of them the tied
embedding) is chosen so that Horovod fp32's step at 1 Gbit/s between two emulated hosts is
at least half communication on a 2-core machine: the slow-link setting these methods exist
for. Measured 2026-12-01 (20 steps, one thread per rank, a busy machine, load about 9):
Horovod fp32 1809 ms per step at 1 Gbit/s, 1252 ms on unshaped links, and 714 ms for the
same step without communication (``--method local``): 61% of the step is communication
(29.5 MB sent per rank per step; its wire time alone is 248 ms at 95% of 1 Gbit/s). On a
quiet machine the compute shrinks and the share grows.

Data
----
Real text only: the Python standard library's source (``examples/stdlib_text.py``), as
words (``--tokens words``: a vocabulary built deterministically from the training files)
or bytes (``--tokens bytes``). Validation text comes from held-out files. Each rank draws
its own training windows from a generator seeded by ``(seed, rank)``, so every method sees
the same data in the same order; the validation windows are fixed and evenly spaced. A
digest of both (``data_digest``) is recorded, so runs can be checked to see the same data.

Every method starts from the same weights: every rank builds the model after
``torch.manual_seed(seed)`` (checked: the ranks' initial weight digests must agree).

What is recorded
----------------
Rank 0 writes ``--out`` (JSON), rewritten at every evaluation (``status: "running"``) and
at the end (``"complete"`` or ``"diverged"``). Every ``--eval-every`` steps (and at step 0):
the validation loss (each rank evaluates its own weights on every validation window; the
mean over ranks is recorded, with the spread: 0/1 Adam's ranks hold different weights
between syncs), the training loss since the last evaluation (mean over ranks), the
training time so far (each rank's own cumulative time of forward, backward and optimizer
step; the slowest rank's is recorded: evaluation is excluded), the bytes this rank sent so
far and the communication rounds (steps that communicated). A validation loss that is not
finite or above twice the initial one ends the run as ``diverged``; every rank sees the
same gathered numbers, so they stop together. At the end, ``time_by_kind``: per step kind
(``trainer.kinds``: a compressor's one kind, or a 1-bit optimizer's warm-up, compressed
and local steps), the steps, their total time and the first one's (numba compiles then),
each the slowest rank's: what ``time_to_quality.py --time-curves`` times a loopback loss
curve by.
"""

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# One compute thread per rank for hvd_quant's numba kernels too (read when numba is imported).
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(ROOT / "examples"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import hvd_quant  # noqa: E402
import hvd_quant.torch as hq  # noqa: E402
import stdlib_text  # noqa: E402
from cluster_worker import init_torch_distributed, ring_bytes  # noqa: E402
from common import powersgd_bytes  # noqa: E402
from lm_torch import ByteTransformer as GPT, evaluate  # noqa: E402  (GPT-2 layout, any vocabulary)

#: The default model: 16384-word vocabulary, width 256, 4 heads, 4 layers, context 64, tied
#: head: 7,370,240 parameters (see the module docstring for why this size).
MODEL = dict(vocab=16384, d_model=256, heads=4, layers=4, context=64)
BATCH = 8
#: Peak learning rate per method family (one per family, recorded in every output), chosen
#: once on seed 1 (seed 0 is the benchmark's), 2 ranks, 400 steps, constant schedule, from
#: 2.5e-4, 5e-4 and 1e-3 by the final validation loss: every family was best at 5e-4
#: (benchmarks/reference/ttq-lr-2026-12-03/). The family "adam" (Horovod fp32 and every
#: compressor around Adam) was chosen by its fp32 member, the twin the compressors are
#: compared with. Runs recorded before 2026-12-03 used 1e-3 for every family: reproduce
#: them with --lr adam=1e-3,onebit_adam=1e-3,zero_one_adam=1e-3,binsgdm=1e-3.
DEFAULT_LR = {"adam": 5e-4, "onebit_adam": 5e-4, "zero_one_adam": 5e-4, "binsgdm": 5e-4}


# --- the methods -------------------------------------------------------------------------------
@dataclass
class Trainer:
    """What a method's build returns.

    model : what forward runs through (a DDP wrapper for DDP)
    opt : has ``param_groups`` (the lr is set there every step), ``zero_grad`` and ``step``
    sent : ``sent(steps_done)`` -> bytes this rank sent so far (its wire meter or cost model)
    rounds : ``rounds(steps_done)`` -> steps so far that communicated
    kinds : ``kinds(steps_done)`` -> ``{kind: count}`` of the steps so far
    options : the method's settings that differ from its defaults (recorded)
    """
    model: nn.Module
    opt: object
    sent: Callable[[int], float]
    rounds: Callable[[int], int]
    kinds: Callable[[int], dict]
    options: dict


@dataclass
class Method:
    name: str
    family: str  # which learning rate it takes (DEFAULT_LR's keys)
    build: Callable
    doc: str


METHODS = {}


def register(name, family, build, doc):
    METHODS[name] = Method(name, family, build, doc)


def adam(params, lr, args=None):
    """The base optimizer of every fp32, baseline and compressor row: Adam, or with
    ``--base-optimizer sgdm`` SGD with momentum (``--momentum``; a diagnosis of how a
    compressor interacts with Adam's per-element normalisation, not a benchmark row)."""
    if args is not None and args.base_optimizer == "sgdm":
        return torch.optim.SGD(params, lr=lr, momentum=args.momentum)
    if args is not None and ":" in args.base_optimizer:  # module:factory(params, lr), a diagnosis
        module, _, factory = args.base_optimizer.partition(":")
        return getattr(__import__(module), factory)(params, lr)
    return torch.optim.Adam(params, lr=lr, fused=True)


def every_step(kind):
    return lambda done: {kind: done} if done else {}


def horovod_build(fp16):
    def build(ctx, model, lr):
        opt = hvd.DistributedOptimizer(adam(model.parameters(), lr, ctx.args), named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)
        per_step = ring_bytes((2 if fp16 else 4) * ctx.numel, ctx.size)
        return Trainer(model, opt, lambda done: per_step * done, lambda done: done,
                       every_step("fp16" if fp16 else "full"), {})
    return build


def ddp_build(powersgd):
    def build(ctx, model, lr):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        shapes = [tuple(p.shape) for p in model.parameters()]
        full = ring_bytes(4 * ctx.numel, ctx.size)
        if not powersgd:
            ddp = nn.parallel.DistributedDataParallel(model)
            return Trainer(ddp, adam(ddp.parameters(), lr, ctx.args), lambda done: full * done, lambda done: done,
                           every_step("full"), {})
        # One bucket: several buckets race over Gloo on CPU (see cluster_worker.ddp_setup).
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4096)
        # start_powerSGD_iter=2, the smallest PowerSGD accepts with error feedback and warm
        # start (its default, 1000, would make a 400-step run plain fp32).
        start = 2
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=ctx.args.powersgd_rank,
                                            start_powerSGD_iter=start, use_error_feedback=True,
                                            warm_start=True, random_seed=ctx.args.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        compressed = powersgd_bytes(shapes, ctx.args.powersgd_rank, ctx.size)

        def sent(done):
            return full * min(done, start) + compressed * max(0, done - start)

        def kinds(done):
            out = {"full": min(done, start), "powersgd": max(0, done - start)}
            return {k: v for k, v in out.items() if v}
        return Trainer(ddp, adam(ddp.parameters(), lr, ctx.args), sent, lambda done: done, kinds,
                       {"matrix_approximation_rank": ctx.args.powersgd_rank, "start_powerSGD_iter": start,
                        "bucket_cap_mb": 4096})
    return build


def compressor_build(name):
    def build(ctx, model, lr):
        # --compressor and --compression-options: a registered variant or non-default
        # options in a method's row (recorded in method_options).
        chosen = ctx.args.compressor or name
        options = json.loads(ctx.args.compression_options) if ctx.args.compression_options else {}
        compression = hq.Compression.get(chosen)
        if options:
            compression = compression(**options)
        # --optimizer-options: hq.DistributedOptimizer's own keywords (monitoring: metrics,
        # probe_every), recorded with the method's options.
        settings = json.loads(ctx.args.optimizer_options) if ctx.args.optimizer_options else {}
        opt = hq.DistributedOptimizer(adam(model.parameters(), lr, ctx.args), named_parameters=model.named_parameters(),
                                      compression=compression, **settings)
        recorded = {**({"compressor": chosen} if chosen != name else {}), **options, **settings}
        return Trainer(model, opt, lambda done: float(opt.bytes_sent), lambda done: done,
                       every_step(name), recorded)
    return build


def ddp_hook_build(name):
    """torch DDP with hvd_quant's compressor as its communication hook (``hq.ddp``, issue 55),
    or with DDP's own ``fp16_compress_hook`` for ``fp16``; Adam after it. DDP's default
    25 MB buckets: Gloo runs one bucket's hook at a time here (the compressor's collectives
    are chains)."""
    def build(ctx, model, lr):
        ddp = nn.parallel.DistributedDataParallel(model)
        if name == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            per_step = ring_bytes(2 * ctx.numel, ctx.size)
            sent = lambda done: per_step * done  # noqa: E731
        else:
            state = hq.ddp.register(ddp, hq.Compression.get(name))
            sent = lambda done: float(state.bytes_sent)  # noqa: E731
        return Trainer(ddp, adam(ddp.parameters(), lr, ctx.args), sent, lambda done: done,
                       every_step(f"ddp_{name}"), {})
    return build


def onebit_optimizer_build(cls_name, process_group=False):
    def build(ctx, model, lr):
        cls = getattr(hq, cls_name)
        options = {}
        freeze = ctx.args.freeze_step
        if freeze is not None and cls_name == "OnebitAdam":
            options["freeze_step"] = freeze
        elif freeze is not None and cls_name == "ZeroOneAdam":
            options["var_freeze_step"] = freeze
        if ctx.args.optimizer_options:  # non-default settings of the 1-bit optimizer (recorded)
            options.update(json.loads(ctx.args.optimizer_options))
        if process_group:  # over torch.distributed (issue 55): the same rule, no Horovod in its steps
            options["process_group"] = True
        params = model.parameters()
        if ctx.args.embedding_non_freeze:  # a diagnosis: the tied embedding stays fp32 Adam (1-bit Adam)
            rest = [p for n, p in model.named_parameters() if n != "tok.weight"]
            params = [{"params": [model.tok.weight], "non_freeze": True}, {"params": rest}]
        opt = cls(params, lr=lr, named_parameters=list(model.named_parameters()), **options)
        if ctx.args.embedding_non_freeze:
            options = {**options, "embedding_non_freeze": True}  # recorded with the row
        return Trainer(model, opt, lambda done: float(opt.bytes_sent), lambda done: int(opt.comm_rounds),
                       lambda done: dict(Counter(opt.step_kinds)), options)
    return build


def local_build(ctx, model, lr):
    """No communication: each rank trains on its own data alone (the compute floor)."""
    return Trainer(model, adam(model.parameters(), lr, ctx.args), lambda done: 0.0, lambda done: 0,
                   every_step("local"), {})


register("horovod_fp32", "adam", horovod_build(False), "hvd.DistributedOptimizer(Adam), fp32")
register("horovod_fp16", "adam", horovod_build(True), "hvd.DistributedOptimizer(Adam, hvd.Compression.fp16)")
register("ddp_fp32", "adam", ddp_build(False), "torch DDP over Gloo with Adam, fp32 allreduce")
register("ddp_powersgd", "adam", ddp_build(True), "torch DDP with powerSGD_hook (rank 4, error feedback)")
for _name in ("none", "fp16", "ef_sign", "marsit", "onebit", "global_qsgd", "global_qsgd_exp",
              "cascading_sign", "auto", "qsgd"):
    register(_name, "adam", compressor_build(_name),
             f"hq.DistributedOptimizer(Adam, compression=hq.Compression.get({_name!r}))")
for _name in ("ef_sign", "marsit", "global_qsgd", "onebit", "fp16"):
    register(f"ddp_{_name}", "adam", ddp_hook_build(_name),
             f"torch DDP, {'fp16_compress_hook' if _name == 'fp16' else f'hq.ddp hook {_name!r}'}, Adam")
register("onebit_adam", "onebit_adam", onebit_optimizer_build("OnebitAdam"), "hq.OnebitAdam")
register("zero_one_adam", "zero_one_adam", onebit_optimizer_build("ZeroOneAdam"), "hq.ZeroOneAdam")
register("binsgdm", "binsgdm", onebit_optimizer_build("BinSGDM"), "hq.BinSGDM")
for _cls, _name in (("OnebitAdam", "onebit_adam"), ("ZeroOneAdam", "zero_one_adam"), ("BinSGDM", "binsgdm")):
    register(f"{_name}_dist", _name, onebit_optimizer_build(_cls, process_group=True),
             f"hq.{_cls}(process_group=True): over torch.distributed (Gloo)")
register("local", "adam", local_build, "Adam without communication (compute floor; not a method)")

#: The 1-bit optimizers: their fp32 twin is Adam, not Horovod's optimizer around it.
ONEBIT_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "binsgdm")


# --- data ----------------------------------------------------------------------------------------
def words_available():
    return hasattr(stdlib_text, "word_tokens")


def load_tokens(kind, vocab_size, corpus_bytes, context, batch):
    """``(train_ids, val_ids, vocab_size, info)`` of the stdlib corpus as words or bytes; a
    missing or too small corpus raises an error naming where it looked and what it needed."""
    if kind == "bytes":
        corpus = stdlib_text.load_corpus(corpus_bytes)
        return corpus.train, corpus.val, stdlib_text.VOCAB_SIZE, {"tokens": kind, "corpus": corpus.summary()}
    if not words_available():
        raise SystemExit("--tokens words: examples/stdlib_text.py has no word_tokens() in this checkout; "
                         "use --tokens bytes")
    text = stdlib_text.load_word_text(vocab_size, context, batch, max_bytes=corpus_bytes)
    info = {"tokens": kind, "corpus": text.corpus.summary(), **text.vocab.summary(),
            "train_tokens": int(text.train.size), "val_tokens": int(text.val.size)}
    return text.train, text.val, int(text.vocab.size), info


def array_digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


# Environment switches that change which kernels ATen, MKL and oneDNN pick.
ISA_SWITCHES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "avx_vnni")


def float_platform():
    """What a run's float bits depend on besides the code, the seed and the thread count.

    ATen, MKL and oneDNN each pick their kernels by the CPU's instruction set, and each
    pick sums in its own order: on one Xeon (2026-12-05) forcing any one of them to AVX2
    changed the model's gradient bits. So two runs agree bit for bit only on the same kind
    of CPU, and a loss curve recorded in another session, on another host, may differ in
    the 6th or 7th digit. Recorded with every run so that such a difference can be told
    apart from a change in the code."""
    first = {}  # the first core's /proc/cpuinfo ("model name" can be generic under a hypervisor)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            first.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(first.get("flags", "").split())
    model = " ".join(first.get(k, "?") for k in ("model name", "cpu family", "model", "stepping")) if first else ""
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:  # cache sizes set the libraries' blocking, and so the order of their sums
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            caches[f"L{level}{'d' if kind == 'Data' else 'i' if kind == 'Instruction' else ''}"] = (
                (index / "size").read_text().strip())
        except OSError:
            pass
    libraries = [line.strip(" -") for line in torch.__config__.show().splitlines()
                 if "Math Kernel Library" in line or "MKL-DNN" in line or "oneDNN" in line]
    return {"cpu": model or None, "aten_isa": torch.backends.cpu.get_cpu_capability(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags], "caches": caches, "libraries": libraries,
            "switches": {k: os.environ[k] for k in ISA_SWITCHES if k in os.environ}}


# --- the run -------------------------------------------------------------------------------------
@dataclass
class Context:
    rank: int
    size: int
    numel: int
    args: argparse.Namespace


def lr_schedule(args):
    """``args`` for ``stdlib_text.lr_at``: constant, or linear warm-up then cosine decay."""
    if args.schedule == "constant":
        return argparse.Namespace(lr=args.lr, warmup=0, decay="constant", steps=args.steps, min_lr_ratio=1.0)
    return argparse.Namespace(lr=args.lr, warmup=max(1, int(args.warmup_frac * args.steps)), decay="cosine",
                              steps=args.steps, min_lr_ratio=args.min_lr_ratio)


def count_kind(by_kind, seen, counts, elapsed):
    """Add one step's time to its kind: the kind whose count ``trainer.kinds`` says grew."""
    kind = next((k for k, c in counts.items() if c > seen.get(k, 0)), "other")
    entry = by_kind.setdefault(kind, [0, 0.0, elapsed])
    entry[0] += 1
    entry[1] += elapsed
    return dict(counts)


def slowest_by_kind(per_rank):
    """Per step kind, the slowest rank's figures: ``{kind: {"steps", "total_s", "first_s"}}``.
    What ``time_to_quality.py --time-curves`` multiplies a loss curve's step counts by."""
    out = {}
    for kind in sorted({k for r in per_rank for k in r}):
        rows = [r[kind] for r in per_rank if kind in r]
        out[kind] = {"steps": rows[0][0], "total_s": max(r[1] for r in rows), "first_s": max(r[2] for r in rows)}
    return out


def write_json(path, data):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=True))
    os.replace(tmp, path)


def log(rank, label, text):
    if rank == 0:
        print(f"[ttq {label}] {text}", flush=True)


#: What --record-probes keeps of each probe step (hq.DistributedOptimizer.metrics()).
PROBE_KEPT = ("probe_rel_error", "probe_cosine", "residual_ratio", "grad_norm", "residual_norm", "scale_max",
              "scale_avg")


def record_probe(result, opt, done):
    """After a step that probed (``metrics()["probes"]`` grew), keep its figures in
    ``result["probes"]``: the Monitoring page's curves (docs/guide/monitoring.md)."""
    if not callable(getattr(opt, "metrics", None)):
        return
    snap = opt.metrics()
    probes = result.setdefault("probes", [])
    if snap["probes"] > (probes[-1]["probes"] if probes else 0):
        probes.append({"step": done, "probes": snap["probes"], **{k: snap[k] for k in PROBE_KEPT}})


def adam_variance(opt, model):
    """Adam's bias-corrected second moment ``v_hat`` per parameter, in ``model``'s order
    (torch.optim.Adam's state, also under Horovod's DistributedOptimizer)."""
    out = []
    for p in model.parameters():
        state = opt.state[p]
        step = float(state["step"])
        beta2 = next(g["betas"][1] for g in opt.param_groups if any(q is p for q in g["params"]))
        out.append((state["exp_avg_sq"] / (1 - beta2 ** step)).numpy().ravel().copy())
    return out


def variance_vs_frozen(frozen, now, model):
    """``--variance-from``: the quartiles of ``sqrt(v_hat(now) / v_hat(frozen))`` over the
    elements whose frozen variance is positive, for the tied embedding and for the rest:
    the factor by which a step with the variance frozen at that step is smaller than
    Adam's (below 1: the frozen variance holds larger gradients than the present's)."""
    names = [name for name, _ in model.named_parameters()]
    parts = {"embedding": [], "blocks": []}
    for name, then, v in zip(names, frozen, now):
        keep = then > 0
        parts["embedding" if name.startswith("tok.") else "blocks"].append(np.sqrt(v[keep] / then[keep]))
    parts["all"] = parts["embedding"] + parts["blocks"]
    return {k: [float(q) for q in np.percentile(np.concatenate(v), (25, 50, 75))] for k, v in parts.items()}


def train(args):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(hvd_quant.threads_per_rank() if args.threads == 0 else args.threads)
    method = METHODS[args.method]
    if (method.name.startswith("ddp_") or method.name.endswith("_dist")) and not torch.distributed.is_initialized():
        init_torch_distributed(rank, size, 600)
    lr = args.lr if args.lr is not None else DEFAULT_LR[method.family]
    args.lr = lr
    label = args.label or args.method

    train_ids, val_ids, vocab, data_info = load_tokens(args.tokens, args.vocab, args.corpus_bytes,
                                                         args.context, args.batch)
    batches = stdlib_text.TrainBatches(train_ids, args.context, args.batch, args.seed, rank)
    xv, yv = stdlib_text.validation_windows(val_ids, args.context, args.val_windows)
    x_val, y_val = torch.from_numpy(xv), torch.from_numpy(yv)

    torch.manual_seed(args.seed)
    model = GPT(args.context, args.d_model, args.heads, args.layers, vocab=vocab)
    numel = sum(p.numel() for p in model.parameters())
    init_digests = hvd.allgather_object(stdlib_text.weights_digest([p.detach().numpy() for p in model.parameters()]))
    if len(set(init_digests)) != 1:
        raise SystemExit(f"ranks built different initial weights: {init_digests}")
    ctx = Context(rank, size, numel, args)
    trainer = method.build(ctx, model, lr)
    if args.variance_from and not isinstance(trainer.opt, torch.optim.Adam):
        raise SystemExit(f"--variance-from reads torch.optim.Adam's state; {args.method} does not train with it")
    schedule = lr_schedule(args)
    config = {
        "method": args.method, "family": method.family, "doc": method.doc, "lr": lr,
        "lr_by_family": {**DEFAULT_LR, **({method.family: lr} if args.lr_given else {})},
        "schedule": args.schedule, "warmup_steps": schedule.warmup,
        "min_lr_ratio": schedule.min_lr_ratio, "steps": args.steps, "stop_after": args.stop_after or None,
        "variance_from": args.variance_from or None,
        "eval_every": args.eval_every,
        "seed": args.seed, "ranks": size, "local_size": hvd.local_size(), "batch_per_rank": args.batch,
        "threads": torch.get_num_threads(), "setting": args.setting,
        "hosts": int(os.environ.get("HVDQ_CLUSTER_HOSTS", 0)) or None,
        "rate_bps": float(os.environ.get("HVDQ_CLUSTER_RATE_BPS", 0)) or None,
        "model": {"parameters": numel, "vocab": vocab, "d_model": args.d_model, "heads": args.heads,
                  "layers": args.layers, "context": args.context, "mlp": 4 * args.d_model, "head": "tied",
                  "embedding_parameters": vocab * args.d_model + args.context * args.d_model},
        "data": {**data_info, "val_windows": args.val_windows},
        "method_options": trainer.options, "init_digest": init_digests[0],
        "base_optimizer": {"sgd_momentum": args.momentum} if args.base_optimizer == "sgdm" else
        args.base_optimizer,
        "python": ".".join(map(str, sys.version_info[:3])), "torch": torch.__version__,
        "platform": float_platform(),
    }
    result = {"config": config, "status": "running", "history": [], "data_digest": None}
    log(rank, label, f"{numel:,} parameters (vocab {vocab}, width {args.d_model}, {args.layers} layers, "
                     f"context {args.context}), {size} ranks, lr {lr:g} ({args.schedule}), {args.steps} steps")

    train_hash = hashlib.sha256()
    val_hash = array_digest(xv, yv)
    initial = None
    train_time, losses, began = 0.0, [], time.perf_counter()
    by_kind, seen = {}, {}  # per step kind: [steps, seconds, the first step's seconds]

    def record(done, current_lr):
        nonlocal initial, losses
        val = evaluate(model, x_val, y_val)
        train_mean = float(np.mean(losses)) if losses else float("nan")
        rows = hvd.allgather_object([val, train_mean, train_time])
        vals = [r[0] for r in rows]
        mean_val = float(np.mean(vals))
        if initial is None:
            initial = mean_val
        row = {"step": done, "lr": current_lr, "val_loss": mean_val, "val_loss_spread": max(vals) - min(vals),
               "train_loss": float(np.mean([r[1] for r in rows])),
               "train_time_s": max(r[2] for r in rows), "bytes_sent": trainer.sent(done),
               "comm_rounds": trainer.rounds(done), "step_kinds": trainer.kinds(done)}
        result["history"].append(row)
        losses = []
        diverged = not math.isfinite(mean_val) or mean_val > args.diverge_factor * initial
        log(rank, label, f"step {done:5d}/{args.steps}  val {mean_val:.4f}  train {row['train_loss']:.4f}  "
                         f"train time {row['train_time_s']:.1f} s  elapsed {time.perf_counter() - began:.0f} s"
                         + ("  DIVERGED" if diverged else ""))
        if rank == 0 and args.out:
            write_json(args.out, result)
        return diverged

    record(0, schedule.lr if args.schedule == "constant" else stdlib_text.lr_at(0, schedule))
    diverged, done, frozen_variance = False, 0, None
    last_step = min(args.steps, args.stop_after or args.steps)  # the schedule still spans --steps
    for step in range(last_step):
        current_lr = stdlib_text.lr_at(step, schedule)
        for group in trainer.opt.param_groups:
            group["lr"] = current_lr
        x, y = batches.next()
        train_hash.update(x.tobytes())
        train_hash.update(y.tobytes())
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        t = time.perf_counter()
        trainer.opt.zero_grad()
        logits = trainer.model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        trainer.opt.step()
        elapsed = time.perf_counter() - t
        train_time += elapsed
        losses.append(loss.item())
        done = step + 1
        seen = count_kind(by_kind, seen, trainer.kinds(done), elapsed)
        if args.record_probes:
            record_probe(result, trainer.opt, done)
        if args.variance_from and done == args.variance_from:
            frozen_variance = adam_variance(trainer.opt, model)
        if done % args.eval_every == 0 or done == last_step:
            if frozen_variance is not None:
                result.setdefault("variance_vs_frozen", []).append(
                    {"step": done, **variance_vs_frozen(frozen_variance, adam_variance(trainer.opt, model), model)})
            if record(done, current_lr):
                diverged = True
                break

    train_digests = hvd.allgather_object(train_hash.hexdigest()[:16])
    kind_times = slowest_by_kind(hvd.allgather_object(by_kind))
    final_digests = hvd.allgather_object(stdlib_text.weights_digest([p.detach().numpy() for p in model.parameters()]))
    last = result["history"][-1]
    if callable(getattr(trainer.opt, "metrics", None)):  # hq.DistributedOptimizer's figures at the end
        result["metrics"] = {k: v for k, v in trainer.opt.metrics().items() if not k.startswith("bucket")}
    result.update(
        status="diverged" if diverged else "complete",
        steps_done=done,
        data_digest={"val": val_hash, "train_by_rank": train_digests},
        final_val_loss=last["val_loss"],
        train_time_s=last["train_time_s"],
        step_time_s=last["train_time_s"] / max(1, done),
        bytes_per_step=last["bytes_sent"] / max(1, done),
        fp32_ring_bytes_per_step=ring_bytes(4 * numel, size),
        comm_rounds=last["comm_rounds"],
        step_kinds=last["step_kinds"],
        time_by_kind=kind_times,
        skipped_steps=int(getattr(trainer.opt, "skipped_steps", 0)),
        ranks_agree=len(set(final_digests)) == 1,
        wall_s=time.perf_counter() - began,
    )
    log(rank, label, f"{result['status']}: final val {last['val_loss']:.4f} after {done} steps; "
                     f"{1e3 * result['step_time_s']:.1f} ms/step; {result['bytes_per_step'] / 1e6:.2f} MB/step/rank; "
                     f"{result['comm_rounds']} rounds; kinds {result['step_kinds']}")
    if rank == 0 and args.out:
        write_json(args.out, result)
    hvd.shutdown()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return result


def parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", required=True, choices=sorted(METHODS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", choices=("constant", "warmup"), default="constant",
                   help="constant lr, or linear warm-up over --warmup-frac of the run then cosine decay")
    p.add_argument("--warmup-frac", type=float, default=0.2)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=None, help="peak lr (default: DEFAULT_LR of the method's family)")
    p.add_argument("--freeze-step", type=int, default=None,
                   help="1-bit Adam's freeze_step / 0/1 Adam's var_freeze_step (default: the library's)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--compression-options", default="",
                   help="compressor rows: options as JSON, e.g. '{\"compensation\": false}' (recorded)")
    p.add_argument("--optimizer-options", default="",
                   help="JSON dict of keyword arguments for the 1-bit optimizer, e.g. '{\"variance_floor\": 0}', "
                        "or for hq.DistributedOptimizer in compressor rows, e.g. '{\"probe_every\": 100}'")
    p.add_argument("--compressor", default="",
                   help="compressor rows: use this registered compressor instead of the method's own "
                        "(e.g. a variant registered by --import)")
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help="import this module first (benchmarks/ is on the path), e.g. one registering variants")
    p.add_argument("--base-optimizer", default="adam",
                   help="adam (the benchmark), sgdm (SGD with --momentum) or module:factory, "
                        "factory(params, lr) -> optimizer (diagnoses)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--embedding-non-freeze", action="store_true",
                   help="1-bit Adam: the tied embedding in a non_freeze group (fp32 Adam throughout; a diagnosis)")
    p.add_argument("--tokens", choices=("words", "bytes"), default=None,
                   help="default: words where stdlib_text has word_tokens(), else bytes")
    p.add_argument("--vocab", type=int, default=MODEL["vocab"], help="word vocabulary size (--tokens words)")
    p.add_argument("--d-model", type=int, default=MODEL["d_model"])
    p.add_argument("--heads", type=int, default=MODEL["heads"])
    p.add_argument("--layers", type=int, default=MODEL["layers"])
    p.add_argument("--context", type=int, default=MODEL["context"])
    p.add_argument("--batch", type=int, default=BATCH, help="windows per rank per step")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=stdlib_text.DEFAULT_MAX_BYTES)
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop after this many steps, the lr schedule and freeze still those of --steps "
                        "(time_to_quality.py --time-curves: the first steps of a run, timed on the cluster)")
    p.add_argument("--diverge-factor", type=float, default=2.0,
                   help="a validation loss above this times the initial one is divergence")
    p.add_argument("--record-probes", action="store_true",
                   help="keep each probe step's figures (hq.DistributedOptimizer rows; set probe_every "
                        "with --optimizer-options)")
    p.add_argument("--variance-from", type=int, default=0, metavar="STEP",
                   help="a diagnosis for Adam rows: at each evaluation after STEP, the quartiles of "
                        "sqrt(v_hat(now) / v_hat(STEP)), the factor by which a variance frozen at STEP "
                        "(the 1-bit Adams' freeze) makes a step smaller than Adam's")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: threads_per_rank())")
    p.add_argument("--setting", default="", help="recorded (the driver's setting name)")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or args.stop_after < 0:
        raise SystemExit("--steps and --eval-every must be positive, --stop-after not negative")
    if not 0 <= args.variance_from < args.steps:
        raise SystemExit(f"--variance-from must be a step before --steps ({args.steps}), or 0 for off; "
                         f"got {args.variance_from}")
    if args.tokens is None:
        args.tokens = "words" if words_available() else "bytes"
    args.lr_given = args.lr is not None
    # hvd_quant's INFO lines (auto's choice per bucket with its predicted times, the "does it
    # pay" line) in the job's output, as a user who turns logging on sees them.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("hvd_quant").setLevel(logging.INFO)
    for module in args.imports:
        __import__(module)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
