"""The GPU check's training job: 2 ranks on one GPU over Gloo, the LM case, every method.

    horovodrun -np 2 -H localhost:2 --gloo python3 benchmarks/gpu_train.py --out DIR
    scripts/gpu_train_check.sh DIR      # on a bare GPU machine: Horovod first, then this

Every rank trains the language model of the cluster benchmark (``TinyLM`` in
``benchmarks/cluster_worker.py``: 31.7M parameters in 53 tensors, a 32000-token vocabulary,
width 384, 4 layers; 4 sequences of 32 tokens per rank and step) on ``cuda:0``: both
ranks share the one GPU, and Horovod's collectives run over Gloo. Rank 0 writes
``DIR/gpu_train.json`` and ``DIR/gpu_train.md``.

Data (``--data stdlib``, the default): word-level tokens of the Python standard library's
source (``examples/stdlib_text.py``, ``load_word_text``; the vocabulary is the model's,
32000 words, or 512 for ``--size tiny``). Each rank draws its own stream of windows
(``TrainBatches`` seeded by ``(seed, rank)``), all of it before phase 1, moved to the device
once; step ``i`` of every method trains on batch ``i`` of that stream, so every method
sees the same text in the same order, a new batch each step. After its timed steps each
method's loss on fixed held-out windows is measured (untimed) and recorded with its last
training loss. ``--data random``: uniform random tokens (a new batch per step in phase 1,
one fixed batch reused in phase 2, as before). The JSON's ``config.data`` records the
source and the corpus and vocabulary digests.

Phase 1, bits (``--bits-steps`` steps per method). Every compressor of
``hvd_quant.available()`` in ``hq.DistributedOptimizer(torch.optim.Adam)``, and every
1-bit optimizer (``OnebitAdam``, ``ZeroOneAdam`` with ``exact_sync=True``, ``BinSGDM``),
each on a fresh model. Beside each rank's GPU optimizer runs a CPU twin (the same method
and seed, its own state and communicator) fed the very gradients the GPU computed, copied
to the host. After every step:

* a rank's bits on the GPU equal its bits on the CPU: the reduced gradients (compressors:
  the means ``synchronize()`` writes into ``.grad``; then each device's own Adam steps)
  or the parameters (1-bit optimizers, whose update is theirs); the first difference is
  reported with its size in float32 ulps;
* the ranks agree bit for bit: a digest of those values, gathered from every rank (0/1
  Adam's local steps, where the ranks differ by design, are left out).

Phase 2, timing (``--warmup`` untimed and ``--steps`` timed steps per method, one after
another in one run): every method above, torch DDP over Gloo with the CUDA tensors (fp32,
and the PowerSGD hook at rank 4 with error feedback and warm start, one bucket), Horovod's
own ``hvd.DistributedOptimizer`` with the CUDA tensors (only where Horovod has its CUDA
parts: one without them aborts on a CUDA tensor), and the step without communication
(``local``). A step's time is the slowest rank's (``torch.cuda.synchronize()`` before and
after). Per method and step also: the bytes sent (hvd_quant's wire meter), the bytes that
crossed between the GPU and the host for the collectives and the collectives' payload
(:class:`hvd_quant.torch.staging.HostMeter`), and the host synchronisations of one extra
step: torch's (``torch.cuda.set_sync_debug_mode("warn")``) and the staging's event waits.

``--device cpu --size tiny`` runs the whole job on the CPU with a small model (the device
optimizer's collectives staged through host buffers, ``HVD_QUANT_WIRE=staged``): what the
test suite runs (``tests/test_benchmarks.py``) on a machine without a GPU.
"""

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import horovod.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "examples"))
from cluster_worker import ONEBIT_ADAM_LR, TinyLM, init_torch_distributed, model_loss  # noqa: E402
import stdlib_text  # noqa: E402  (the word-level stdlib text the model trains on)

import hvd_quant  # noqa: E402
import hvd_quant.torch as hq  # noqa: E402
from hvd_quant.core import costmodel  # noqa: E402
from hvd_quant.torch.staging import host_meter_of, wire_for  # noqa: E402

SIZES = {  # TinyLM's configurations: the cluster benchmark's LM, and one for CPU test runs
    "lm": dict(vocab=32000, dim=384, layers=4, heads=6, ff=1536, seq=32),
    "tiny": dict(vocab=512, dim=32, layers=1, heads=2, ff=64, seq=16),
}
ONEBIT = ("onebit_adam", "zero_one_adam", "binsgdm")
#: Methods that send one bit per element: the issue's target is that each is faster than
#: DDP fp32 and DDP PowerSGD.
ONE_BIT_METHODS = ("ef_sign", "marsit", "cascading_sign", "onebit") + ONEBIT
BASELINES = ("local", "ddp_fp32", "ddp_powersgd", "horovod_fp32")
LR = 1e-3
#: ``auto``'s link in phase 1: a fixed one (100 Mbit/s, 1 ms per collective). Measured
#: twice, once by the device optimizer and once by its CPU twin, the link may differ
#: enough for the two to choose different methods, and their bits would differ by design;
#: on this slow link every bucket of both models is sent compressed, so the check covers
#: a compressor's device path. Phase 2 times ``auto`` as users run it, measuring.
BITS_LINK = costmodel.LinkModel(1e8, dict.fromkeys(costmodel.KINDS, 1e-3), dict.fromkeys(costmodel.KINDS, 0.0),
                                dict(costmodel.EMULATED_EFFICIENCY), 10e9, "fixed for the bits check")


def compressors():
    return list(hvd_quant.available())


# --- models, batches, methods -----------------------------------------------------------------
def replica(args, device):
    """A fresh model, the same on every rank and device (built on the CPU from one seed)."""
    torch.manual_seed(args.seed)
    return TinyLM(**SIZES[args.size]).to(device)


class Data:
    """This rank's batches, drawn and moved to the device before anything is timed.

    ``batch(step)``: the batch of step ``step`` (every method's step ``i`` trains on the
    same one; wraps past the pool's end). ``val``: the held-out windows, the same on every
    rank. ``info``: what the data is, for the JSON.
    """

    def __init__(self, args, rank, device, steps):
        cfg = SIZES[args.size]
        vocab, seq = cfg["vocab"], cfg["seq"]
        self.random = args.data == "random"
        if self.random:
            self.rank, self.device, self.args = rank, device, args
            g = torch.Generator().manual_seed(20_000)
            self.val = torch.randint(0, vocab, (args.val_windows, seq + 1), generator=g).to(device)
            self.info = {"data": "random", "vocab_size": vocab}
            return
        text = stdlib_text.load_word_text_once_per_host(hvd.local_rank() == 0, barrier, vocab, seq,
                                                       args.batch, max_bytes=args.corpus_bytes)
        x, y = stdlib_text.TrainBatches(text.train, seq, args.batch, args.seed, rank).take(steps)
        windows = np.concatenate([x, y[:, -1:]], axis=1).reshape(steps, args.batch, seq + 1)
        self.pool = torch.from_numpy(windows).to(device)
        vx, vy = stdlib_text.validation_windows(text.val, seq, args.val_windows)
        self.val = torch.from_numpy(np.concatenate([vx, vy[:, -1:]], axis=1)).to(device)
        self.info = text.summary()

    def batch(self, step):
        if self.random:  # the earlier workload: a batch per (rank, step) from its own seed
            g = torch.Generator().manual_seed(10_000 * self.rank + step)
            cfg = SIZES[self.args.size]
            return torch.randint(0, cfg["vocab"], (self.args.batch, cfg["seq"] + 1), generator=g).to(self.device)
        return self.pool[step % len(self.pool)]


def pool_steps(args):
    """Batches each rank pre-draws: the longest walk of one method (phase 1's steps, or
    phase 2's warm-up, PowerSGD's two extra warm-up steps, the timed steps and the
    synchronisation count's one)."""
    return max(args.bits_steps, args.warmup + 2 + args.steps + 1, 1)


def make_optimizer(name, model, bits):
    """hvd_quant's method ``name`` over ``model``: a compressor in
    ``hq.DistributedOptimizer(torch.optim.Adam)``, or a 1-bit optimizer. ``bits``: the
    phase-1 settings (short schedules that reach every kind of step in a few steps, and
    0/1 Adam's exact syncs, so that ranks and devices can agree bit for bit)."""
    params, named = list(model.parameters()), list(model.named_parameters())
    if name == "onebit_adam":
        return hq.OnebitAdam(params, lr=ONEBIT_ADAM_LR, named_parameters=named, freeze_step=2)
    if name == "zero_one_adam":
        extra = dict(var_freeze_step=2, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2,
                     exact_sync=True) if bits else dict(var_freeze_step=1)
        return hq.ZeroOneAdam(params, lr=ONEBIT_ADAM_LR, named_parameters=named, **extra)
    if name == "binsgdm":
        return hq.BinSGDM(params, lr=1e-4, named_parameters=named)
    options = {"link": BITS_LINK} if bits and name == "auto" else {}
    return hq.DistributedOptimizer(torch.optim.Adam(params, lr=LR), named_parameters=named,
                                   compression=hq.Compression.get(name, **options))


def staged_if(args):
    """``HVD_QUANT_WIRE=staged`` while the device optimizer is made, in a CPU run (so that
    its collectives go through the staging communicator, as a GPU's do)."""
    class Env:
        def __enter__(self):
            self.before = os.environ.get("HVD_QUANT_WIRE")
            if args.device == "cpu":
                os.environ["HVD_QUANT_WIRE"] = "staged"

        def __exit__(self, *exc):
            if self.before is None:
                os.environ.pop("HVD_QUANT_WIRE", None)
            else:
                os.environ["HVD_QUANT_WIRE"] = self.before
    return Env()


# --- phase 1: bits ------------------------------------------------------------------------------
def ulps(a, b):
    """Largest difference between two float32 arrays in units in the last place."""
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)  # sign-magnitude to a monotonic line
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.max(np.abs(ia - ib))) if a.size else 0


def flat_values(tensors):
    return np.concatenate([t.detach().float().cpu().numpy().reshape(-1) for t in tensors])


def bits_check(name, args, rank, device):
    model, twin = replica(args, device), replica(args, "cpu")
    with staged_if(args):
        opt = make_optimizer(name, model, bits=True)
    twin_opt = make_optimizer(name, twin, bits=True)
    params, twin_params = list(model.parameters()), list(twin.parameters())
    compressor = name not in ONEBIT
    steps = []
    for step in range(args.bits_steps):
        batch = args.data_source.batch(step)
        loss = model_loss(model, batch)
        # The twin's gradients first: the device optimizer's buckets are reduced (in place)
        # while backward runs.
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        for q, g in zip(twin_params, grads):
            q.grad = g.detach().cpu().clone()
        for p in params:
            p.grad = None
        loss.backward()
        if compressor:
            opt.synchronize()
            twin_opt.synchronize()
            got, want = flat_values([p.grad for p in params]), flat_values([q.grad for q in twin_params])
            with opt.skip_synchronize():
                opt.step()
            with twin_opt.skip_synchronize():
                twin_opt.step()
            kind = "reduce"
        else:
            opt.step()
            twin_opt.step()
            got, want = flat_values(params), flat_values(twin_params)
            kind = opt.step_kinds[-1]
        same = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
        steps.append({"kind": kind, "gpu_equals_cpu": same, "max_ulps": 0 if same else ulps(got, want),
                      "digest": zlib.crc32(got.view(np.uint8))})
    host = host_meter_of(opt._comm)
    out = {"steps": steps, "host": host.snapshot() if host else None, "bytes_sent": opt.bytes_sent}
    if name == "auto":  # each bucket's method, on both devices (the twin must have chosen alike)
        out["choices"] = opt._runner.compressor.choices(opt._comm)
        out["twin_choices"] = twin_opt._runner.compressor.choices(twin_opt._comm)
    return out


# --- phase 2: timing ------------------------------------------------------------------------------
class Feed:
    """The batch a method's next step trains on: ``advance()`` (untimed, before each step)
    moves to the next of :class:`Data`'s batches; ``last_loss`` keeps the last step's
    training loss (a detached tensor, read after the timing)."""

    def __init__(self, data, fixed=False):
        self.data, self.fixed, self.index, self.current, self.last_loss = data, fixed, -1, None, None

    def advance(self):
        self.index += 1
        self.current = self.data.batch(0 if self.fixed else self.index)


class Timed:
    """One method's training step: ``run()`` (on ``feed.current``), and what it sent
    (``sent()``: bytes) and staged (``host()``: a HostMeter snapshot or None); ``model``
    for the held-out loss."""

    def __init__(self, run, sent=None, host=None, buckets=1, model=None, feed=None):
        self.run, self.sent, self.host, self.buckets = run, sent, host, buckets
        self.model, self.feed = model, feed


def train_step(model, feed, step):
    for p in model.parameters():
        p.grad = None
    loss = model_loss(model, feed.current)
    loss.backward()
    feed.last_loss = loss.detach()
    step()


def build_timed(name, args, device, feed):
    model = replica(args, device)
    if name == "local":
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        return Timed(lambda: train_step(model, feed, opt.step), model=model, feed=feed)
    if name in ("ddp_fp32", "ddp_powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        ids = [device.index or 0] if device.type == "cuda" else None
        # PowerSGD: one bucket (its P and Q allreduces of several buckets race over Gloo:
        # benchmarks/cluster_worker.py, ddp_setup).
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=ids, **({"bucket_cap_mb": 4096} if name == "ddp_powersgd" else {}))
        if name == "ddp_powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2, use_error_feedback=True,
                                                warm_start=True, random_seed=0)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.Adam(ddp.parameters(), lr=LR)
        return Timed(lambda: train_step(ddp, feed, opt.step), model=model, feed=feed)
    if name == "horovod_fp32":
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters())
        return Timed(lambda: train_step(model, feed, opt.step), model=model, feed=feed)
    with staged_if(args):
        opt = make_optimizer(name, model, bits=False)

    def host():
        meter = host_meter_of(opt._comm)
        return meter.snapshot() if meter else None
    buckets = len(opt.bucket_groups) if hasattr(opt, "bucket_groups") else len(opt.param_groups)
    return Timed(lambda: train_step(model, feed, opt.step), sent=lambda: opt.bytes_sent, host=host,
                 buckets=buckets, model=model, feed=feed)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier():
    hvd.allreduce(torch.zeros(1), name="gpu_train.barrier")


def count_syncs(timed, device):
    """torch's synchronisations in one step (``set_sync_debug_mode("warn")``), and the
    staging's event waits in it."""
    if device.type != "cuda":
        return None
    timed.feed.advance()
    before = timed.host() if timed.host else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            timed.run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    after = timed.host() if timed.host else None
    torch_syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    waits = after["waits"] - before["waits"] if after else 0
    return {"torch": torch_syncs, "staging_waits": waits, "total": torch_syncs + waits}


def validation_loss(timed, data):
    """The method's model's mean loss on the held-out windows (untimed, no gradients)."""
    with torch.no_grad():
        return float(timed.model.loss(data.val))


def time_method(name, args, rank, device):
    # --data random keeps the earlier phase 2: one fixed batch, reused every step.
    feed = Feed(args.data_source, fixed=args.data == "random")
    t0 = time.perf_counter()
    timed = build_timed(name, args, device, feed)
    warm = args.warmup + (2 if name == "ddp_powersgd" else 0)  # its first steps are plain allreduces
    for _ in range(warm):
        feed.advance()
        timed.run()
    synchronize(device)
    setup_s = time.perf_counter() - t0
    times, sent, host = [], [], []
    for _ in range(args.steps):
        feed.advance()  # the batch is already on the device: this only picks it
        s0 = timed.sent() if timed.sent else 0.0
        h0 = timed.host() if timed.host else None
        synchronize(device)
        barrier()
        t = time.perf_counter()  # timed: from here to the synchronize after the step
        timed.run()
        synchronize(device)
        times.append(time.perf_counter() - t)
        if timed.sent:
            sent.append(timed.sent() - s0)
        if h0 is not None:
            h1 = timed.host()
            host.append({k: h1[k] - h0[k] for k in h1})
    loss = {"train_loss": float(feed.last_loss), "val_loss": validation_loss(timed, args.data_source),
            "steps": feed.index + 1}
    syncs = count_syncs(timed, device)
    buckets = timed.buckets
    del timed
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"times_s": times, "sent_bytes": statistics.median(sent) if sent else None,
            "host": host[-1] if host else None, "syncs": syncs, "setup_s": setup_s,
            "buckets": buckets, "loss": loss}


# --- the job ------------------------------------------------------------------------------------
def environment(device, args):
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
           "horovod": __import__("horovod").__version__,
           "horovod_cuda_built": bool(hvd.cuda_built()), "horovod_nccl_built": int(hvd.nccl_built()),
           "wire": os.environ.get("HVD_QUANT_WIRE", "auto")}
    with staged_if(args):
        env["wire_chosen"] = wire_for(device, hvd)
    rate = os.environ.get("HVDQ_CLUSTER_RATE_BPS")  # set by python -m hvd_quant.cluster run
    env["cluster_rate_bps"] = float(rate) if rate else None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    import hvd_quant.kernels as kernels

    gpu_module = getattr(kernels, "gpu_module", None)
    env["gpu_kernels"] = bool(gpu_module()) if gpu_module else False
    try:
        from hvd_quant.cluster import netns

        problems, _ = netns.probe()
        env["network_namespaces"] = "available" if not problems else "; ".join(problems)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        env["network_namespaces"] = f"not available ({type(exc).__name__}: {exc})"
    return env


def gather_object(value, name):
    return hvd.allgather_object(value, name=name)


def run(args):
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the wire, once per process
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)  # every rank on the one GPU
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    init_torch_distributed(rank, size, args.gloo_timeout)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, hvd.local_size())))
    started = time.perf_counter()

    def say(text):
        if rank == 0:
            print(f"[gpu_train {time.perf_counter() - started:6.1f} s] {text}", flush=True)

    methods = [m for m in (args.methods.split(",") if args.methods else compressors() + list(ONEBIT)) if m]
    result = {"config": {"ranks": size, "size": args.size, "model": SIZES[args.size], "batch": args.batch,
                         "bits_steps": args.bits_steps, "warmup": args.warmup, "steps": args.steps,
                         "date": datetime.date.today().isoformat()},
              "environment": environment(device, args) if rank == 0 else None, "bits": {}, "timing": {}}
    numel = sum(p.numel() for p in replica(args, "cpu").parameters())
    result["config"]["numel"] = numel
    say(f"{size} ranks on {device}, TinyLM {args.size} ({numel:,} parameters), {len(methods)} methods")
    args.data_source = Data(args, rank, device, pool_steps(args))
    result["config"]["data"] = args.data_source.info
    say("data: " + ", ".join(f"{k} {v}" for k, v in args.data_source.info.items()))

    if args.bits_steps:
        for name in methods:
            t = time.perf_counter()
            mine = bits_check(name, args, rank, device)
            ranks = gather_object(mine, f"bits.{name}")
            steps = []
            for i in range(args.bits_steps):
                per_rank = [r["steps"][i] for r in ranks]
                local = per_rank[0]["kind"] == "local"
                steps.append({"kind": per_rank[0]["kind"],
                              "gpu_equals_cpu": all(s["gpu_equals_cpu"] for s in per_rank),
                              "max_ulps": max(s["max_ulps"] for s in per_rank),
                              "ranks_agree": None if local else len({s["digest"] for s in per_rank}) == 1})
            result["bits"][name] = {"steps": steps, "host": ranks[0]["host"], "bytes_sent": ranks[0]["bytes_sent"]}
            if "choices" in mine:
                result["bits"][name].update(choices=ranks[0]["choices"], twin_choices=ranks[0]["twin_choices"],
                                            ranks_chose_alike=all(r["choices"] == ranks[0]["choices"] for r in ranks))
            ok = all(s["gpu_equals_cpu"] and s["ranks_agree"] is not False for s in steps)
            say(f"bits {name:16s} {'ok' if ok else 'DIFFERENT'} ({time.perf_counter() - t:.1f} s)")

    if args.steps:
        baselines = list(BASELINES)
        if device.type == "cuda" and not hvd.cuda_built():
            # A Horovod built without its CUDA parts (the GPU check's) aborts its background
            # loop on a CUDA tensor ("Requested device context manager with GPU device but not
            # compiled with CUDA", seen on an H200): the whole job would die with it.
            baselines.remove("horovod_fp32")
            say("time horovod_fp32: skipped, this Horovod has no CUDA parts and aborts on CUDA tensors")
        for name in baselines + methods:
            t = time.perf_counter()
            mine = time_method(name, args, rank, device)
            ranks = gather_object(mine, f"timing.{name}")
            slowest = [max(r["times_s"][i] for r in ranks) for i in range(args.steps)]
            result["timing"][name] = {"step_s": slowest, "median_s": statistics.median(slowest),
                                      "sent_bytes": mine["sent_bytes"], "host": ranks[0]["host"],
                                      "syncs": ranks[0]["syncs"], "setup_s": max(r["setup_s"] for r in ranks),
                                      "buckets": mine["buckets"],
                                      # the ranks' mean training loss of the last step, held-out loss
                                      "loss": {k: statistics.fmean(r["loss"][k] for r in ranks)
                                               for k in ("train_loss", "val_loss")}}
            say(f"time {name:16s} {1e3 * statistics.median(slowest):8.1f} ms/step "
                f"(set-up {time.perf_counter() - t:.1f} s); loss {result['timing'][name]['loss']['train_loss']:.3f}, "
                f"held-out {result['timing'][name]['loss']['val_loss']:.3f}")
    result["elapsed_s"] = time.perf_counter() - started
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_train.json").write_text(json.dumps(result, indent=1))
        (out / "gpu_train.md").write_text(report(result))
        say(f"wrote {out / 'gpu_train.json'} and gpu_train.md")
    dist.destroy_process_group()
    return result


# --- the report ---------------------------------------------------------------------------------
def data_line(info):
    if info.get("data") == "stdlib":
        return (f"Data: word tokens of the Python {info['python_version']} standard library's source "
                f"(corpus {info['corpus_digest']}, vocabulary {info['vocab_digest']} of {info['vocab_size']}), "
                "a new batch per step; loss: the last step's, and on held-out files.")
    return "Data: uniform random tokens (--data random): the loss only measures memorisation."


def report(result):
    cfg, env = result["config"], result["environment"] or {}
    lines = [f"# GPU training check ({cfg['date']})", "",
             f"{cfg['ranks']} ranks on {env.get('device')} ({env.get('gpu', 'no GPU')}), Horovod "
             f"{env.get('horovod')} (GPU operations: {'yes' if env.get('horovod_cuda_built') else 'no'}; "
             f"NCCL {env.get('horovod_nccl_built') or 'not built'}) over Gloo; torch {env.get('torch')}, "
             f"Python {env.get('python')}; hvd_quant's GPU kernels: "
             f"{'Triton' if env.get('gpu_kernels') else 'none (generic torch path)'}; the device's "
             f"collectives: {env.get('wire_chosen')} (HVD_QUANT_WIRE={env.get('wire')}).",
             f"Model: TinyLM {cfg['size']} ({cfg['numel']:,} parameters), batch {cfg['batch']} per rank.",
             data_line(cfg.get("data") or {}),
             (f"Each rank in an emulated host of its own, linked at {env['cluster_rate_bps'] / 1e9:g} Gbit/s "
              "(python -m hvd_quant.cluster)." if env.get("cluster_rate_bps") else
              f"Network namespaces (the emulated cluster): {env.get('network_namespaces')}; this run is "
              "on one host (HVD_QUANT_GPU_CLUSTER_RATES adds emulated-cluster runs)."), ""]
    if result["bits"]:
        lines += ["## Bits", "",
                  "A rank's bits on the GPU against a CPU twin fed the same gradients (compressors: "
                  "the reduced gradients; 1-bit optimizers: the parameters), and the ranks against "
                  "each other (0/1 Adam's local steps excepted).", "",
                  "| method | steps | device = CPU twin | max ulps | ranks agree |", "|---|---|---|---:|---|"]
        for name, b in result["bits"].items():
            steps = b["steps"]
            lines.append(f"| {name} | {' '.join(s['kind'] for s in steps)} | "
                         f"{'yes' if all(s['gpu_equals_cpu'] for s in steps) else 'NO'} | "
                         f"{max(s['max_ulps'] for s in steps)} | "
                         f"{'yes' if all(s['ranks_agree'] is not False for s in steps) else 'NO'} |")
        lines.append("")
    timing = result["timing"]
    if timing:
        ddp, psgd = timing.get("ddp_fp32"), timing.get("ddp_powersgd")
        lines += ["## Time per step", "",
                  f"Median of {cfg['steps']} steps after {cfg['warmup']} warm-up steps, the slowest "
                  "rank's; one run, methods one after another. Bytes per step: sent (hvd_quant's wire "
                  "meter), and crossed between the GPU and the host for the collectives against their "
                  "payload (target: at most 1.1 x the payload plus 4 kB per bucket). Host "
                  "synchronisations of one step: torch's and the staging's event waits.", "",
                  "| method | ms/step | vs DDP fp32 | vs DDP PowerSGD | sent MB | host MB | host / payload "
                  "| within target | syncs | loss (held-out) |", "|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
        for name, t in timing.items():
            ms = 1e3 * t["median_s"]
            vs = [f"{r['median_s'] / t['median_s']:.2f}x" if r else "" for r in (ddp, psgd)]
            host, within, ratio, hmb = t["host"], "", "", ""
            if host:
                hbytes = host["to_host"] + host["to_device"]
                hmb = f"{hbytes / 1e6:.3f}"
                ratio = f"{hbytes / host['payload']:.3f}" if host["payload"] else ""
                within = "yes" if hbytes <= 1.1 * host["payload"] + 4096 * t["buckets"] else "NO"
            sent = f"{t['sent_bytes'] / 1e6:.3f}" if t["sent_bytes"] is not None else ""
            syncs = t["syncs"]["total"] if t["syncs"] else ""
            loss = f"{t['loss']['train_loss']:.3f} ({t['loss']['val_loss']:.3f})" if t.get("loss") else ""
            lines.append(f"| {name} | {ms:.1f} | {vs[0]} | {vs[1]} | {sent} | {hmb} | {ratio} | {within} | {syncs} "
                         f"| {loss} |")
        lines.append("")
        if env.get("device", "").startswith("cuda") and not env.get("horovod_cuda_built"):
            lines += ["horovod_fp32: not timed. This Horovod was built without its CUDA parts "
                      "(scripts/build_horovod.sh, Fix 6), and such a build aborts on a CUDA tensor "
                      "(\"Requested device context manager with GPU device but not compiled with CUDA\").", ""]
        if ddp and psgd:
            faster = [n for n in ONE_BIT_METHODS if n in timing
                      and timing[n]["median_s"] < min(ddp["median_s"], psgd["median_s"])]
            slower = [n for n in ONE_BIT_METHODS if n in timing and n not in faster]
            lines += [f"1-bit methods faster than both DDP fp32 and DDP PowerSGD: {', '.join(faster) or 'none'}; "
                      f"not: {', '.join(slower) or 'none'}.", ""]
    lines.append(f"Job time: {result['elapsed_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="rank 0 writes gpu_train.json and gpu_train.md here")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--size", default="lm", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default="", help="comma-separated hvd_quant methods (default: all)")
    p.add_argument("--bits-steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    stdlib_text.add_data_arguments(p, "random tokens (phase 2: one fixed batch reused)")
    p.add_argument("--gloo-timeout", type=float, default=300)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
