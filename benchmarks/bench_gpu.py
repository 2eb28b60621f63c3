"""The GPU kernels against today's host path, torch operations, DeepSpeed's CuPy recipe and PowerSGD.

Side by side in one run, on one GPU (issue 39):

* every fused primitive (:mod:`hvd_quant.kernels.gpu`, called through the call sites the
  methods use), in milliseconds and in effective GB/s over the bytes the operation must
  touch (its inputs read once, its outputs written once), against the device-to-device
  copy bandwidth measured in the same run (``dst.copy_(src)``: read + write);
* the same call with the generic path on the GPU (plain torch operations, the kernels off)
  and with today's host path (the inputs copied to the host, the numba kernel, the
  outputs copied back; for a primitive every input and output crosses);
* each compressor's whole compute per step at one rank (a one-rank communicator: the
  wire excluded), on the GPU and on today's host path (the gradient to the host, state
  and compute there, the result back: ``hvd_quant.torch.compression`` today);
* DeepSpeed's 1-bit compression as its GPU recipe does it (``sign``, ``add_(1)``,
  ``bool``, ``cupy.packbits`` and the unpack side, after ``runtime/compression/cupy.py``
  and ``runtime/comm/nccl.py``; written here from that description; skipped with the
  reason if CuPy is missing);
* torch's PowerSGD DDP hook (``powerSGD_hook``, rank 1 and 4, error feedback and warm
  start) on the same tensors, at one rank: its compress/decompress work (the one-rank
  allreduces are no-ops), in a child process (:func:`powersgd_child` says why).

Sizes: 25M elements in one tensor, and a GPT-2-small-shaped gradient (124M elements in
148 tensors). The issues' targets are checked on the latter and printed pass/fail: every
hot primitive at >= 60% of the copy bandwidth (or, for those that draw a hash per element,
within 1.5x of ``uniform`` alone: issue 56); ef_sign, marsit and onebit in <= 2 ms,
global_qsgd in <= 3 ms, each >= 20x faster than the host path, faster than the CuPy
recipe and than PowerSGD's rank-4 compute.

``--tune FILE`` (issue 56) times the launch settings of the kernel families of
:data:`hvd_quant.kernels.gpu.LAUNCH` instead (:func:`tune`) and writes the fastest to FILE,
for ``HVD_QUANT_GPU_LAUNCH``.

``--interpret`` runs everything on the CPU under Triton's interpreter at tiny sizes (the
harness's own check, ``tests/test_benchmarks.py``; its timings mean nothing).

    .venv/bin/python benchmarks/bench_gpu.py --out results/gpu        # on a GPU machine
    .venv/bin/python benchmarks/bench_gpu.py --interpret --out /tmp/x # anywhere
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hvd_quant  # noqa: E402
from hvd_quant import kernels  # noqa: E402
from hvd_quant.compressors import exp_dithering as ed  # noqa: E402
from hvd_quant.compressors import global_qsgd as gq  # noqa: E402
from hvd_quant.compressors.marsit import MarsitSelect  # noqa: E402
from hvd_quant.core.comm import Communicator  # noqa: E402
from hvd_quant.core.hierarchical import threshold_rows  # noqa: E402
from hvd_quant.core.packing import (pack_signs, sign_pack_residual, sign_residual, unpack_scaled_sum,  # noqa: E402
                                    unpack_sum_residual, unpack_sums_signs)
from hvd_quant.core.rng import CounterRNG, random_bytes  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402
from hvd_quant.core.segments import block_counts, compensate_sums, compensate_sums_signs  # noqa: E402
from hvd_quant.optimizers import elementwise as ew  # noqa: E402
from hvd_quant.optimizers.binsgdm import binary_randomize  # noqa: E402
from hvd_quant.torch.backend import TorchBackend  # noqa: E402

#: Primitives whose effective bandwidth must reach TARGET_COPY_SHARE of the copy's.
HOT = ("sign_pack", "compensate_sums_signs", "unpack_sum_residual", "unpack_scaled_sum", "quantize_lanes",
       "dequantize_lanes", "marsit_select", "binsgdm_encode", "rebinarize", "ema", "descend", "adam_descend",
       "precondition", "zero_one_sync_input", "zero_one_sync_result")
TARGET_COPY_SHARE = 0.6
#: Primitives that draw one hash per element: they may instead be within
#: TARGET_UNIFORM_RATIO of ``uniform`` alone (the draws by themselves; issue 56).
HASHED = ("quantize_lanes", "marsit_select", "rebinarize", "binsgdm_encode")
TARGET_UNIFORM_RATIO = 1.5
#: Whole compute per step on the GPT-2-shaped gradient, at most (ms).
TARGET_MS = {"ef_sign": 2.0, "marsit": 2.0, "onebit": 2.0, "global_qsgd": 3.0}
TARGET_HOST_SPEEDUP = 20.0
METHODS = ("ef_sign", "marsit", "onebit", "global_qsgd", "global_qsgd_exp", "cascading_sign")
#: --tune: per launch family of :data:`hvd_quant.kernels.gpu.LAUNCH`, the primitive case
#: that times it and the settings tried (issue 56: warps, and elements per program where
#: a program packs lanes).
_WARPS_TRIED = [{"num_warps": w} for w in (1, 2, 4, 8, 16)]
_LANES_TRIED = [{"num_warps": w, "block": b} for w in (2, 4, 8) for b in (1024, 2048, 4096, 8192)]
#: A family is timed on every call site that launches its kernel (their times added): the
#: variants differ (unpack_sums_signs decodes in _sums_k as well), and one setting serves all.
TUNE = {"sums": (("compensate_sums_signs", "unpack_sums_signs"), _WARPS_TRIED),
        "unpack": (("unpack_scaled_sum", "unpack_sum_residual"), _WARPS_TRIED),
        "quantize_lanes": (("quantize_lanes",), _LANES_TRIED), "dequantize_lanes": (("dequantize_lanes",), _LANES_TRIED),
        "marsit_select": (("marsit_select",), _WARPS_TRIED), "rebinarize": (("rebinarize",), _WARPS_TRIED)}


def gpt2_small_shapes():
    """The 148 parameter shapes of GPT-2 small (124,439,808 elements): token and position
    embeddings, 12 blocks of 12 tensors, the final layer norm."""
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072),
                   (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


def layouts(interpret):
    """``{name: list of parameter shapes}``: GPT-2 small (the issue's targets are judged
    on it), then 25M in one tensor; tiny versions of both (the same numbers of tensors)
    under the interpreter."""
    if interpret:
        small = [tuple(max(1, s // 96) for s in shape) for shape in gpt2_small_shapes()]
        return {"GPT-2 small shapes, 148 tensors (tiny)": small, "one tensor, 5k": [(50, 100)]}
    return {"GPT-2 small, 124M in 148 tensors": gpt2_small_shapes(), "25M in one tensor": [(5000, 5000)]}


# --- timing ----------------------------------------------------------------------------------
class Clock:
    """Times a call on the device: CUDA events around it (the stream's time), or wall time
    with synchronisations for calls that wait on the host themselves, or on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, repeats, wall=False):
        fn()  # warm-up: compilation, caches, allocator
        self.sync()
        times = []
        for _ in range(repeats):
            if self.cuda and not wall:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


class OneRank(Communicator):
    """One rank: every collective returns its input (the wire excluded)."""

    def allreduce(self, x, op, name):
        return x

    def allgather(self, x, name):
        return x

    def alltoall(self, x, name):
        return x

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        return x


class _NativeInt8(OneRank):
    allreduce_int_dtypes = ("int8", "int16", "int32", "int64")


class GenericTorch(TorchBackend):
    """The torch backend with the fused kernels off: plain torch operations."""

    name = "torch-generic"

    def kernel(self, name, *tensors):
        return None


class InterpretedTorch(TorchBackend):
    """``--interpret``: the interpreted Triton kernels for CPU tensors, one call at a time."""

    name = "torch+triton-interpreter"
    _lock = threading.Lock()

    def kernel(self, name, *tensors):
        fn = getattr(kernels.gpu_interpreted(), name, None) if name in kernels.NAMES else None
        if fn is None:
            return None

        def call(*args, **kwargs):
            if name in ("uniform", "random_bytes"):
                kwargs.setdefault("device", "cpu")
            with self._lock:
                return fn(*args, **kwargs)
        return call


# --- the primitives ----------------------------------------------------------------------------
def inputs(d, counts, device, seed=0):
    """Every tensor the primitive cases read, on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(scale=1.0):
        return torch.randn(d, generator=gen, device=device) * scale

    x, e = randn(), randn(0.1)
    t = {"x": x, "e": e, "m": randn(0.01), "v": randn(1e-2).abs(), "u": randn(1e-3), "w": randn(),
         "x2": x.clone(), "x3": x.clone(), "server": e.clone(), "out": torch.empty(d, device=device),
         "scales": torch.rand(len(counts), generator=gen, device=device) + 0.1,
         "scale": x.abs().max().reshape(1), "pre": torch.ones(1, device=device)}
    t["block_scale"] = gq.block_absmax(GenericTorch(device), x, block_counts(d, case_block(d)))
    t["block_pre"] = torch.ones_like(t["block_scale"])
    t["bits"] = pack_signs(GenericTorch(device), x)
    t["bits2"] = pack_signs(GenericTorch(device), e)
    t["rows3"] = torch.cat([t["bits"], t["bits2"], t["bits"]])
    t["words"] = gq.quantize(GenericTorch(device), OneRank(), x, t["scale"], t["pre"], 63, 8, key=11)
    t["ints"] = gq.quantize(GenericTorch(device), _NativeInt8(), x, t["scale"], t["pre"], 63, 8, key=11)
    t["codes"] = ed.encode(GenericTorch(device), x, t["scale"], 2, CounterRNG(2))
    t["m_out"], t["b_out"] = torch.empty(d, device=device), torch.empty(d, device=device)
    return t


def case_block(d):
    """The block of the blocked cases: global_qsgd's default, 512, or 8 for a small buffer
    (several blocks either way, so the blocked kernels run)."""
    return 512 if d >= 4 * 512 else 8


def primitive_cases(B, t, counts):
    """``[(primitive, bytes touched, inputs read, callable)]``: each fused primitive as the
    methods call it, on the tensors ``t`` (on ``B``'s device)."""
    d = sum(counts)
    bits = (d + 7) // 8
    one = OneRank()
    block = case_block(d)
    blocks = block_counts(d, block)
    return [
        ("sign_pack", 4 * d + bits, ("x",), lambda: pack_signs(B, t["x"])),
        ("compensate_sums", 8 * d, ("x", "e"), lambda: compensate_sums(B, t["x"], t["e"], counts)),
        ("compensate_sums_signs", 8 * d + bits, ("x", "e"), lambda: compensate_sums_signs(B, t["x"], t["e"], counts)),
        ("sign_pack_residual", 12 * d + bits, ("x", "e", "scales"),
         lambda: sign_pack_residual(B, t["x"], t["e"], t["scales"], counts, out=t["e"])),
        ("sign_residual", 12 * d, ("x", "e", "scales"),
         lambda: sign_residual(B, t["x"], t["e"], t["scales"], counts, out=t["e"])),
        ("unpack_scaled_sum", bits + 4 * d, ("bits", "scales"),
         lambda: unpack_scaled_sum(B, t["bits"], t["scales"], counts, d, out=t["out"])),
        ("unpack_sum_residual", bits + 16 * d, ("bits", "scales", "x2", "e"),
         lambda: unpack_sum_residual(B, t["bits"], t["scales"], counts, d, t["x2"], t["e"], t["scales"],
                                     out=t["x2"], resid_out=t["e"])),
        ("unpack_sums_signs", 2 * bits + 8 * d, ("bits", "scales", "server"),
         lambda: unpack_sums_signs(B, t["bits"], t["scales"], counts, d, base=t["server"], base_scales=t["scales"],
                                   out=t["server"], squares=True)),
        ("absmax_finite", 4 * d, ("x",), lambda: gq.absmax_finite(B, t["x"])),
        ("all_finite", 4 * d, ("x",), lambda: B.all_finite(t["x"])),
        ("quantize_lanes", 5 * d, ("x", "scale", "pre"),
         lambda: gq.quantize(B, one, t["x"], t["scale"], t["pre"], 63, 8, key=11)),
        ("dequantize_lanes", 5 * d, ("words", "scale", "pre"),
         lambda: gq.dequantize(B, one, t["words"], d, t["scale"], t["pre"], 63, 8, into=t["out"])),
        ("quantize_ints", 5 * d, ("x", "scale", "pre"),
         lambda: gq.quantize(B, _NativeInt8(), t["x"], t["scale"], t["pre"], 63, 8, key=11)),
        ("dequantize_ints", 5 * d, ("ints", "scale", "pre"),
         lambda: gq.dequantize(B, _NativeInt8(), t["ints"], d, t["scale"], t["pre"], 63, 8, into=t["out"])),
        ("block_absmax_finite", 4 * d, ("x",), lambda: gq.local_scale_stat(B, t["x"], "max", blocks)),
        ("quantize_lanes_blocks", 5 * d, ("x", "block_scale"),
         lambda: gq.quantize_blocks(B, one, t["x"], t["block_scale"], None, blocks, block, 63, 8, key=11)),
        ("dequantize_lanes_blocks", 5 * d, ("words", "block_scale", "block_pre"),
         lambda: gq.dequantize(B, one, t["words"], d, t["block_scale"], t["block_pre"], 63, 8, into=t["out"],
                               counts=blocks, block=block)),
        ("quantize_ints_blocks", 5 * d, ("x", "block_scale"),
         lambda: gq.quantize_blocks(B, _NativeInt8(), t["x"], t["block_scale"], None, blocks, block, 63, 8, key=11)),
        ("dequantize_ints_blocks", 5 * d, ("ints", "block_scale", "block_pre"),
         lambda: gq.dequantize(B, _NativeInt8(), t["ints"], d, t["block_scale"], t["block_pre"], 63, 8,
                               into=t["out"], counts=blocks, block=block)),
        ("exp_encode", 5 * d, ("x", "scale"), lambda: ed.encode(B, t["x"], t["scale"], 2, CounterRNG(2))),
        ("exp_combine", 3 * d, ("codes",),
         lambda: ed.ExpDitheringSum().combine(B, t["codes"], 1, t["codes"], 1, CounterRNG(4))),
        ("exp_decode", 5 * d, ("codes", "scale"), lambda: ed.exp_decode(B, t["codes"], t["scale"], 2, into=t["out"])),
        ("marsit_select", 3 * bits, ("bits", "bits2"),
         lambda: MarsitSelect().combine(B, t["bits"], 1, t["bits2"], 2, CounterRNG(3))),
        ("rebinarize", 4 * bits, ("rows3",), lambda: threshold_rows(B, t["rows3"], 3, 7)),
        ("binsgdm_encode", 20 * d + bits, ("x", "m", "v"),
         lambda: binary_randomize(B, t["x"], t["m"], t["v"], 0.9, 5, out=(t["m_out"], t["b_out"]))),
        ("uniform", 4 * d, (), lambda: B.draws(6, d)),
        ("random_bytes", bits, (), lambda: random_bytes(B, 8, bits)),
        ("ema", 12 * d, ("m", "x"), lambda: ew.ema(B, t["m"], t["x"], 0.9, in_place=True)),
        ("descend", 12 * d, ("x3", "e"), lambda: ew.descend(B, t["x3"], t["e"], 1e-3, 0.0, into=t["x3"])),
        ("adam_descend", 16 * d, ("x3", "m", "v"),
         lambda: ew.adam_descend(B, t["x3"], t["m"], t["v"], 1e-3, 1e-8, 0.0, into=t["x3"])),
        ("precondition", 12 * d, ("u", "v"), lambda: ew.precondition(B, t["u"], t["v"], 1e-8, out=t["out"])),
        ("zero_one_sync_input", 28 * d, ("x", "m", "w", "v", "u"),
         lambda: ew.zero_one_sync_input(B, t["x"], t["m"], t["w"], t["v"], t["u"], 0.9, 1e-3, 1e-8, 0.0)),
        ("zero_one_sync_result", 24 * d, ("x", "u", "w", "v"),
         lambda: ew.zero_one_sync_result(B, t["x"], t["u"], t["w"], t["v"], 1e-8, 0.0123)),
    ]


def _to(device, value):
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(device, v) for v in value)
    return value


def host_path(device, t, counts):
    """Today's path for each primitive: the inputs it reads copied to the host (into
    pageable memory, as ``tensor.cpu()``), the numba kernel there, the results back."""
    host = {k: v.cpu() for k, v in t.items()}
    out = {}
    for name, nbytes, reads, fn in primitive_cases(TorchBackend("cpu"), host, counts):
        def run(fn=fn, reads=reads):
            for k in reads:
                host[k].copy_(t[k])
            return _to(device, fn())
        out[name] = run
    return out


# --- whole methods -----------------------------------------------------------------------------
def method_runs(name, backend, device, counts, host):
    """A callable for one step of the compressor ``name`` at one rank on ``backend``; with
    ``host``, today's path: the gradient to the host, the step there, the result back."""
    segments = [(f"p{i}", c) for i, c in enumerate(counts)]
    d = sum(counts)
    runner = CompressorRunner(hvd_quant.get(name), backend, seed=3)
    grad = torch.randn(d, generator=torch.Generator(device=device).manual_seed(9), device=device)
    comm = OneRank()
    if host:
        return lambda: runner.reduce(grad.cpu(), comm, "g", segments).to(device)
    out = torch.empty(d, device=device)
    return lambda: runner.reduce(grad, comm, "g", segments, out=out)


def profile_method(name, backend, device, counts, calls=3, top=8):
    """Where one step of ``name`` spends its time: torch's profiler over ``calls`` steps, the
    kernels (on the CPU, under ``--interpret``: the operators) by their own time per step,
    the ``top`` largest first, and their total beside the step's wall time (the rest is the
    host: Python, launches, waits)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run = method_runs(name, backend, device, counts, False)
    cuda = device.type == "cuda"
    run()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize()
    wall_us = 1e6 * (time.perf_counter() - t0) / calls
    rows = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": e.key, "calls": e.count / calls, "us": us / calls})
    rows.sort(key=lambda r: -r["us"])
    busy = sum(r["us"] for r in rows)
    return {"method": name, "wall_us": wall_us, "kernels_us": busy, "kernel_count": sum(r["calls"] for r in rows),
            "top": rows[:top]}


def deepspeed_cupy_onebit(device, d):
    """DeepSpeed's 1-bit compressed allreduce at one rank, its GPU recipe written from its
    description (``runtime/comm/nccl.py``, ``runtime/compression/cupy.py``): the worker
    adds its error, scales by the RMS, packs ``sign(x).add_(1).bool()`` with
    ``cupy.packbits`` (DLPack), keeps the new error; the server unpacks with
    ``cupy.unpackbits``, maps bits to +-1, scales, adds its own error and compresses the
    same way; the workers unpack the server's signs. ``None, reason`` without CuPy."""
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not importable ({exc})"
    if device.type != "cuda":
        return None, "CuPy needs a CUDA device"
    x = torch.randn(d, device=device)
    worker_error, server_error = torch.zeros(d, device=device), torch.zeros(d, device=device)
    buf = torch.empty(d, device=device)
    root = math.sqrt(d)

    def to_cupy(t):
        try:
            return cupy.from_dlpack(t)
        except (TypeError, ValueError, RuntimeError, BufferError):  # an old DLPack without bool
            return cupy.from_dlpack(t.view(torch.uint8))

    def to_torch(a):
        return torch.from_dlpack(a)

    def compress(m, error):
        scale = torch.linalg.norm(m) / root
        error.copy_(m - scale * m.sign().add_(1).bool().float().add_(-0.5).mul_(2.0))
        packed = cupy.packbits(to_cupy(m.sign_().add_(1).bool()))
        return packed, scale

    def decompress(packed, scale):
        return to_torch(cupy.unpackbits(packed)).float().add_(-0.5).mul_(2.0).mul_(scale)

    def step():
        buf.copy_(x)
        buf.add_(worker_error)
        packed, scale = compress(buf, worker_error)
        server = decompress(packed, scale)[:d]
        server.add_(server_error)
        packed, scale = compress(server, server_error)
        buf.copy_(decompress(packed, scale)[:d])
        return buf
    return step, None


def powersgd_runs(device, shapes, rank):
    """torch's PowerSGD DDP hook on parameters of ``shapes`` (one bucket), at one rank:
    the callable runs the hook on the bucket (refilled with the gradient first); ``None,
    reason`` where DDP cannot be set up."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if not dist.is_available():
        return None, "torch.distributed is not available"
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    module = nn.Module()
    module.params = nn.ParameterList([nn.Parameter(torch.zeros(s, device=device)) for s in shapes])
    model = nn.parallel.DistributedDataParallel(module, device_ids=[device.index or 0] if device.type == "cuda"
                                                else None, bucket_cap_mb=1 << 20, init_sync=False)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                        use_error_feedback=True, warm_start=True, random_seed=0)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    bucket = model.reducer._get_zeros_like_grad_buckets()[0]
    grad = torch.randn(bucket.buffer().numel(), generator=torch.Generator(device=device).manual_seed(4),
                       device=device)

    def run():
        bucket.buffer().copy_(grad)
        return model.reducer._run_comm_hook(bucket).wait()
    for _ in range(3):  # the hook's first two iterations are plain allreduces; the third makes P, Q, the error
        run()
    return run, None


POWERSGD_RANKS = (1, 4)
POWERSGD_CHILD_TIMEOUT_S = 900
POWERSGD_ROWS = {rank: f"PowerSGD hook, rank {rank}" for rank in POWERSGD_RANKS}  # the report's row names


def powersgd_child(device, shapes, repeats):
    """The body of ``--powersgd-child``: each of :data:`POWERSGD_RANKS` measured, one JSON
    line of rows on stdout, then ``os._exit(0)``.

    Why a process of its own, and why ``os._exit``: the hook's callbacks run on the process
    group's worker threads, and a worker destroys a callback (which needs the GIL) just
    after the callback has completed the future the main thread waits on. If the main
    thread reaches interpreter teardown first, the worker's GIL request ends its thread
    inside a C++ destructor and the process aborts ("terminate called without an active
    exception": seen in this benchmark's CI check, and reproduced in 18 of 40 runs of a
    short script; pytorch/pytorch#190489). ``destroy_process_group()`` does not help: the
    DDP reducer still holds the group. Measured here, the rows are printed and flushed
    first, and this process skips a teardown it has no use for."""
    clock = Clock(device)
    rows = []
    for rank, name in POWERSGD_ROWS.items():
        try:
            run, why = powersgd_runs(device, shapes, rank)
            ms = None if run is None else 1e3 * clock(run, repeats, wall=True)
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            ms, why = None, f"{type(exc).__name__}: {exc}"
        rows.append({"name": name, "ms": ms} if ms is not None else {"name": name, "ms": None, "skipped": why})
    print(json.dumps(rows), flush=True)
    sys.stderr.flush()
    os._exit(0)


def powersgd_in_child(device, shapes, repeats):
    """``[{"name", "ms"[, "skipped"]}]`` for PowerSGD's hook at each rank of
    :data:`POWERSGD_RANKS`, measured in a child process (:func:`powersgd_child` says why);
    a child that fails or runs out of time gives rows skipped with its reason."""
    import subprocess

    cmd = [sys.executable, str(Path(__file__).resolve()), "--powersgd-child",
           json.dumps({"device": str(device), "shapes": shapes, "repeats": repeats})]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=POWERSGD_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        why = f"no result in {POWERSGD_CHILD_TIMEOUT_S} s"
    else:
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            return json.loads(lines[-1])
        why = "child failed: " + (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return [{"name": name, "ms": None, "skipped": why} for name in POWERSGD_ROWS.values()]


# --- the run -----------------------------------------------------------------------------------
def versions(device):
    info = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    for name in ("triton", "numba", "cupy"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[name] = f"missing ({type(exc).__name__})"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, multiprocessors=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2 ** 30, 1), cuda=torch.version.cuda,
                    driver=_driver_version())
    else:
        info["device"] = "CPU (Triton interpreter)"
    return info


def _driver_version():
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def run_layout(label, shapes, device, args, clock, deadline, log):
    counts = [math.prod(s) for s in shapes]
    d = sum(counts)
    log(f"== {label}: {d:,} elements in {len(counts)} tensors")
    result = {"layout": label, "numel": d, "tensors": len(counts), "primitives": [], "methods": [], "others": []}
    src, dst = torch.randn(d, device=device), torch.empty(d, device=device)
    copy_s = clock(lambda: dst.copy_(src), args.repeats)
    result["copy_ms"], result["copy_gbps"] = 1e3 * copy_s, 8 * d / copy_s / 1e9
    log(f"device copy: {1e3 * copy_s:.3f} ms, {result['copy_gbps']:.0f} GB/s (read + write)")
    del src, dst

    fast = InterpretedTorch() if args.interpret else TorchBackend(device)
    t = inputs(d, counts, device)
    generic = dict((name, fn) for name, _, _, fn in primitive_cases(GenericTorch(device), t, counts))
    host = host_path(device, t, counts) if not args.no_host else {}
    for name, nbytes, _, fn in primitive_cases(fast, t, counts):
        if args.only and name not in args.only:
            continue
        row = {"primitive": name, "bytes": nbytes}
        row["ms"] = 1e3 * clock(fn, args.repeats)
        row["gbps"] = nbytes / row["ms"] / 1e6
        row["copy_share"] = row["gbps"] / result["copy_gbps"]
        row["generic_ms"] = 1e3 * clock(generic[name], args.repeats)
        if name in host and time.perf_counter() < deadline:
            row["host_ms"] = 1e3 * clock(host[name], args.host_repeats, wall=True)
        elif name in host:
            row["host_ms"] = None
            row["host_skipped"] = "time budget spent"
        result["primitives"].append(row)
        log(f"  {name:22s} {row['ms']:9.3f} ms {row['gbps']:8.1f} GB/s ({100 * row['copy_share']:5.1f}% of copy)"
            f"  generic {row['generic_ms']:9.3f} ms  host {_fmt(row.get('host_ms'))} ms")
    del t, host, generic

    for name in METHODS:
        if args.only and name not in args.only:
            continue
        row = {"method": name, "ms": 1e3 * clock(method_runs(name, fast, device, counts, False), args.repeats,
                                                 wall=True)}
        row["generic_ms"] = 1e3 * clock(method_runs(name, GenericTorch(device), device, counts, False),
                                        args.repeats, wall=True)
        if not args.no_host and time.perf_counter() < deadline:
            row["host_ms"] = 1e3 * clock(method_runs(name, TorchBackend("cpu"), device, counts, True),
                                         args.host_repeats, wall=True)
        else:
            row["host_ms"], row["host_skipped"] = None, "time budget spent" if not args.no_host else "--no-host"
        result["methods"].append(row)
        log(f"  {name:22s} {row['ms']:9.3f} ms  generic {row['generic_ms']:9.3f} ms  host {_fmt(row['host_ms'])} ms")

    result["profiles"] = []
    for name in args.profile:
        prof = profile_method(name, fast, device, counts)
        result["profiles"].append(prof)
        log(f"  profile {name}: {prof['kernels_us']:.0f} us in {prof['kernel_count']:.0f} kernels per step, "
            f"{prof['wall_us']:.0f} us of wall time under the profiler")

    step, why = deepspeed_cupy_onebit(device, d)
    if step is None:
        result["others"].append({"name": "DeepSpeed 1-bit, CuPy recipe", "ms": None, "skipped": why})
        log(f"  DeepSpeed 1-bit (CuPy): skipped, {why}")
    else:
        ms = 1e3 * clock(step, args.repeats)
        result["others"].append({"name": "DeepSpeed 1-bit, CuPy recipe", "ms": ms})
        log(f"  DeepSpeed 1-bit (CuPy) {ms:9.3f} ms")
    for row in powersgd_in_child(device, shapes, args.repeats):
        result["others"].append(row)
        log(f"  {row['name']}: skipped, {row['skipped']}" if row["ms"] is None else
            f"  {row['name']} {row['ms']:9.3f} ms")
    return result


# --- --tune: the launch settings ----------------------------------------------------------------
def _tensors(value):
    """The tensors of a primitive's result (nested tuples), cloned: later calls may write
    into the same outputs."""
    if torch.is_tensor(value):
        return [value.detach().clone()]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(a, b):
    """Equal bit for bit, except float64 sums to 1e-12 (their reduction order follows the
    warps; the float32 outputs and every bit must not move)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and
        (torch.allclose(x, y, rtol=1e-12, atol=0.0) if x.dtype == torch.float64 else torch.equal(x, y))
        for x, y in zip(a, b))


def tune(gpu, fast, device, args, clock, log):
    """Time each family's candidates of :data:`TUNE` on the GPT-2-shaped gradient (10 calls
    of each call site queued per timing, so that the CPU's launch cost hides behind the
    GPU's work) and keep the fastest whose outputs equal the default settings'. Returns
    ``{family: {...}}`` with every row; :data:`hvd_quant.kernels.gpu.LAUNCH` is left as it
    was. Under the interpreter, the one small tensor (a check of the harness)."""
    shapes = list(layouts(args.interpret).values())[-1 if args.interpret else 0]
    counts = [math.prod(shape) for shape in shapes]
    timed = {name: fn for name, _, _, fn in primitive_cases(fast, inputs(sum(counts), counts, device), counts)}

    def outputs(sites):
        """The call sites' results on fresh inputs (some write into their inputs)."""
        fresh = {name: fn for name, _, _, fn in primitive_cases(fast, inputs(sum(counts), counts, device), counts)}
        return [t for site in sites for t in _tensors(fresh[site]())]

    result = {}
    for family, (sites, tried) in TUNE.items():
        if args.only and family not in args.only and not set(sites) & args.only:
            continue
        default = dict(gpu.LAUNCH[family])
        reference = outputs(sites)
        rows = []
        for settings in tried:
            gpu.set_launch({family: settings})
            try:
                same = _same(reference, outputs(sites))
                ms = 1e3 * sum(clock(lambda site=site: [timed[site]() for _ in range(10)], 3) for site in sites) / 10
            finally:
                gpu.set_launch({family: default})
            rows.append({"settings": settings, "ms": ms, "same": same})
            log(f"  tune {family:17s} {json.dumps(settings):36s} {ms:8.3f} ms{'' if same else '  (outputs differ)'}")
        now = next((r for r in rows if r["settings"] == {k: default[k] for k in r["settings"]}), None)
        alike = [r for r in rows if r["same"]]  # the defaults' own row is, unless a kernel is not deterministic
        best = min(alike, key=lambda r: r["ms"]) if alike else {"settings": default, "ms": now and now["ms"]}
        result[family] = {"case": " + ".join(sites), "default": default, "default_ms": now and now["ms"],
                          "best": best["settings"], "best_ms": best["ms"], "rows": rows}
    return result


def tune_markdown(report):
    lines = [f"# GPU launch settings ({report['versions']['device']})", "",
             "`bench_gpu.py --tune`: each family's settings timed on the GPT-2-shaped gradient, on every call site "
             "that launches its kernel (their times added; 10 calls queued, median of 3); the fastest whose "
             "outputs equal the defaults' (bits; float64 sums to 1e-12) is kept.",
             "", "| family | timed on | default | ms | best | ms | speed-up |", "|---|---|---|---:|---|---:|---:|"]
    for family, r in report["tune"].items():
        lines.append(f"| {family} | {r['case']} | `{json.dumps(r['default'])}` | {_fmt(r['default_ms'])} | "
                     f"`{json.dumps(r['best'])}` | {_fmt(r['best_ms'])} | {_ratio(r['default_ms'], r['best_ms'], 2)} |")
    lines += ["", "Every setting tried:", "", "| family | settings | ms | outputs |", "|---|---|---:|---|"]
    for family, r in report["tune"].items():
        lines += [f"| {family} | `{json.dumps(row['settings'])}` | {row['ms']:.3f} | "
                  f"{'same' if row['same'] else 'differ'} |" for row in r["rows"]]
    return "\n".join(lines) + "\n"


def _fmt(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(slow, fast, digits=0):
    return "-" if not slow or not fast else f"{slow / fast:.{digits}f}x"


def check_targets(result, interpret):
    """The issue's targets on one layout's results: ``[(target, measured, passed)]``
    (``passed`` None where the measurement is missing)."""
    out = []
    prims = {r["primitive"]: r for r in result["primitives"]}
    uniform_ms = prims["uniform"]["ms"] if "uniform" in prims else None
    for name in HOT:
        if name not in prims:
            continue
        share = prims[name]["copy_share"]
        if name in HASHED and uniform_ms:
            ratio = prims[name]["ms"] / uniform_ms
            out.append((f"{name} >= {TARGET_COPY_SHARE:.0%} of the copy bandwidth, or within "
                        f"{TARGET_UNIFORM_RATIO:g}x of uniform alone", f"{share:.0%}, {ratio:.2f}x uniform",
                        share >= TARGET_COPY_SHARE or ratio <= TARGET_UNIFORM_RATIO))
        else:
            out.append((f"{name} >= {TARGET_COPY_SHARE:.0%} of the copy bandwidth", f"{share:.0%}",
                        share >= TARGET_COPY_SHARE))
    others = {r["name"]: r["ms"] for r in result["others"]}
    cupy_ms, powersgd_ms = others.get("DeepSpeed 1-bit, CuPy recipe"), others.get("PowerSGD hook, rank 4")
    for row in result["methods"]:
        name = row["method"]
        if name not in TARGET_MS:
            continue
        out.append((f"{name} <= {TARGET_MS[name]:g} ms", f"{row['ms']:.3f} ms", row["ms"] <= TARGET_MS[name]))
        speedup = row["host_ms"] / row["ms"] if row.get("host_ms") else None
        out.append((f"{name} >= {TARGET_HOST_SPEEDUP:g}x faster than the host path",
                    "-" if speedup is None else f"{speedup:.1f}x",
                    None if speedup is None else speedup >= TARGET_HOST_SPEEDUP))
        out.append((f"{name} faster than DeepSpeed's CuPy 1-bit recipe",
                    "-" if cupy_ms is None else f"{row['ms']:.3f} vs {cupy_ms:.3f} ms",
                    None if cupy_ms is None else row["ms"] < cupy_ms))
        out.append((f"{name} faster than PowerSGD's rank-4 compute",
                    "-" if powersgd_ms is None else f"{row['ms']:.3f} vs {powersgd_ms:.3f} ms",
                    None if powersgd_ms is None else row["ms"] < powersgd_ms))
    if interpret:
        out = [(what, measured, None) for what, measured, _ in out]
    return out


def tune_main(gpu, device, args, clock, report, log):
    """``--tune FILE``: :func:`tune`, the winners to FILE, the table to stdout and --out."""
    fast = InterpretedTorch() if args.interpret else TorchBackend(device)
    report["tune"] = tune(gpu, fast, device, args, clock, log)
    Path(args.tune).write_text(json.dumps({f: r["best"] for f, r in report["tune"].items()}, indent=1) + "\n")
    write_report(args, report, tune_markdown(report), "tune", log)
    log(f"wrote the fastest settings to {args.tune}")
    return report


def write_report(args, report, table, stem, log):
    """The table to stdout; with --out, ``STEM.json`` (the report) and ``STEM.md`` there."""
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (out / f"{stem}.md").write_text(table)
        log(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")


def markdown(report):
    lines = [f"# GPU kernels benchmark ({report['versions']['device']})", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if k != "device"), "",
             "Launch settings (`hvd_quant.kernels.gpu.LAUNCH`): `" + json.dumps(report.get("launch", {})) + "`", ""]
    if report["interpret"]:
        lines += ["**Triton's interpreter on the CPU at tiny sizes: a check of the harness; the times mean "
                  "nothing and no target is judged.**", ""]
    for res in report["layouts"]:
        lines += [f"## {res['layout']}: {res['numel']:,} elements in {res['tensors']} tensors", "",
                  f"Device-to-device copy: {res['copy_ms']:.3f} ms, {res['copy_gbps']:.0f} GB/s (read + write).", "",
                  "| primitive | ms | GB/s | % of copy | generic torch ms | host path ms | vs generic | vs host |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["primitives"]:
            lines.append(f"| {r['primitive']} | {r['ms']:.3f} | {r['gbps']:.1f} | {100 * r['copy_share']:.0f}% | "
                         f"{r['generic_ms']:.3f} | {_fmt(r.get('host_ms'))} | {r['generic_ms'] / r['ms']:.1f}x | "
                         f"{_ratio(r.get('host_ms'), r['ms'])} |")
        lines += ["", "| method, whole compute per step at 1 rank | ms | generic torch ms | host path ms | vs host |",
                  "|---|---:|---:|---:|---:|"]
        for r in res["methods"]:
            lines.append(f"| {r['method']} | {r['ms']:.3f} | {r['generic_ms']:.3f} | {_fmt(r.get('host_ms'))} | "
                         f"{_ratio(r.get('host_ms'), r['ms'])} |")
        for r in res["others"]:
            lines.append(f"| {r['name']} | {_fmt(r['ms'])} | | | {r.get('skipped', '')} |")
        for prof in res.get("profiles", []):
            lines += ["", f"Where {prof['method']}'s step goes (torch's profiler, per step): "
                      f"{prof['kernels_us']:.0f} us in {prof['kernel_count']:.0f} kernels, "
                      f"{prof['wall_us']:.0f} us of wall time (the profiler adds its own); the largest:", "",
                      "| kernel | calls | us | share of kernel time |", "|---|---:|---:|---:|"]
            for r in prof["top"]:
                kernel = r["kernel"] if len(r["kernel"]) <= 70 else r["kernel"][:67] + "..."
                lines.append(f"| `{kernel}` | {r['calls']:g} | {r['us']:.1f} | "
                             f"{100 * r['us'] / max(prof['kernels_us'], 1e-9):.0f}% |")
        if res["targets"]:
            lines += ["", "The targets of issues 39 and 56 (on this gradient):", "", "| target | measured | result |",
                      "|---|---|---|"]
            for what, measured, passed in res["targets"]:
                verdict = "n/a" if passed is None else ("pass" if passed else "FAIL")
                lines.append(f"| {what} | {measured} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for bench_gpu.json and bench_gpu.md")
    p.add_argument("--interpret", action="store_true",
                   help="run on the CPU under Triton's interpreter at tiny sizes (checks the harness)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per GPU measurement (median)")
    p.add_argument("--host-repeats", type=int, default=2, help="timed calls per host-path measurement")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="after this many seconds the remaining host-path measurements are skipped (reported)")
    p.add_argument("--no-host", action="store_true", help="skip today's host path")
    p.add_argument("--only", default="", help="comma-separated primitives and methods (default: all)")
    p.add_argument("--layouts", default="",
                   help="comma-separated layout numbers: 0 GPT-2 small, 1 one tensor (default: both)")
    p.add_argument("--profile", default="",
                   help="comma-separated methods to run under torch's profiler too (kernels by time)")
    p.add_argument("--tune", default=None, metavar="FILE",
                   help="only time the launch settings of hvd_quant.kernels.gpu.LAUNCH's families and write the "
                        "fastest to FILE (JSON, for HVD_QUANT_GPU_LAUNCH), every timing to --out's tune.json/.md")
    p.add_argument("--powersgd-child", default=None, help=argparse.SUPPRESS)  # powersgd_in_child's process
    args = p.parse_args(argv)
    if args.powersgd_child:
        spec = json.loads(args.powersgd_child)
        powersgd_child(torch.device(spec["device"]), [tuple(s) for s in spec["shapes"]], spec["repeats"])
    args.only = {s for s in args.only.split(",") if s}
    args.profile = [s for s in args.profile.split(",") if s]
    unknown = sorted(set(args.profile) - set(METHODS))
    if unknown:
        p.error(f"--profile: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    start = time.perf_counter()

    def log(msg):
        print(f"[bench_gpu {time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    if args.interpret:
        kernels.gpu_interpreted()  # before anything imports Triton for compilation
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu: no CUDA device (use --interpret to check the harness on the CPU)")
        device = torch.device("cuda", torch.cuda.current_device())
        if kernels.gpu_module() is None:
            sys.exit(f"bench_gpu: the GPU kernels are off: {kernels.why_gpu_disabled()}")
    if not kernels.enabled():
        sys.exit(f"bench_gpu: the numba kernels are off: {kernels.why_disabled()}")
    kernels.warm_up()
    gpu = kernels.gpu_interpreted() if args.interpret else kernels.gpu_module()
    report = {"versions": versions(device), "interpret": args.interpret, "layouts": [],
              "launch": {family: dict(v) for family, v in gpu.LAUNCH.items()},
              "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}}
    log("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    log("launch settings: " + json.dumps(report["launch"]))
    clock = Clock(device)
    if args.tune:
        return tune_main(gpu, device, args, clock, report, log)
    deadline = start + args.budget_s
    chosen = {int(s) for s in args.layouts.split(",") if s} or {0, 1}
    for i, (label, shapes) in enumerate(layouts(args.interpret).items()):
        if i in chosen:
            res = run_layout(label, shapes, device, args, clock, deadline, log)
            # The targets are the GPT-2-shaped gradient's (layout 0).
            res["targets"] = check_targets(res, args.interpret) if i == 0 else []
            report["layouts"].append(res)
    write_report(args, report, markdown(report), "bench_gpu", log)
    judged = [passed for res in report["layouts"] for _, _, passed in res["targets"] if passed is not None]
    log(f"the targets of issues 39 and 56: {sum(judged)} of {len(judged)} met" if judged else
        "no target judged (interpreter, or the GPT-2-shaped layout not run)")
    return report


if __name__ == "__main__":
    main()
