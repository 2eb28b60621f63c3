"""Uncompressed baselines, expressed as compressors so every path can use them, and the
cost of the baselines we compare with that are not ours.

``none`` and ``fp16`` match Horovod's ``Compression.none`` / ``Compression.fp16``:
a float sum over ranks, divided by the number of ranks. ``horovod_fp32`` (Horovod's own
``DistributedOptimizer``: one fused allreduce of up to 64 MB) and ``ddp_powersgd`` (torch
DDP's ``powerSGD_hook``, Vogels et al., NeurIPS 2019) are known to the cost model
(:func:`hvd_quant.core.costmodel.register_cost`) only, for the benchmarks' predictions.
"""

import math

from ..core.compressor import Compressor
from ..core.costmodel import Collective, MethodCost, register_cost, ring_memory_bytes


class NoCompression(Compressor):
    """fp32 allreduce (sum, then divide by the number of ranks)."""

    name = "none"
    compresses = False
    #: Through Horovod's stock optimizers these need no collectives of their own: they
    #: are a cast before and after Horovod's allreduce, exactly like Horovod's own classes.
    horovod_wire_dtype = "float32"

    def reduce(self, x, ctx):
        total = ctx.comm.allreduce(x, "sum", ctx.collective_name("sum"))
        return total / float(ctx.comm.size)

    def wire_bytes(self, numel, world_size, segments=1):
        return 2.0 * (world_size - 1) / world_size * 4 * numel

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        return [Collective("allreduce", 4.0 * numel, world_size)]

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        return ring_memory_bytes(numel, world_size)


class FP16Compression(Compressor):
    """fp16 allreduce: 2 bytes per element on the wire, summed in fp16."""

    name = "fp16"
    compresses = False
    horovod_wire_dtype = "float16"

    def reduce(self, x, ctx):
        B = ctx.backend
        total = ctx.comm.allreduce(B.cast(x, "float16"), "sum", ctx.collective_name("sum"))
        return B.cast(total, "float32") / float(ctx.comm.size)

    def wire_bytes(self, numel, world_size, segments=1):
        return 2.0 * (world_size - 1) / world_size * 2 * numel

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        return [Collective("allreduce", 2.0 * numel, world_size, dtype="float16")]

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        # the casts (read fp32, write fp16; read fp16, write fp32), half a ring's passes
        return 3.0 * (4.0 * float(numel)) + ring_memory_bytes(numel, world_size) / 2.0


def powersgd_collectives(shapes, n, rank=4, min_compression_rate=2):
    """torch DDP's ``powerSGD_hook`` on one bucket holding tensors of ``shapes``: an
    allreduce of the tensors it leaves uncompressed (1-D ones, and matrices that would not
    shrink ``min_compression_rate`` times), then of the ``P`` factors, then of the ``Q``
    factors (rank ``rank``), one after the other. (torch's code, not hvd_quant's: not
    checked against a recording here.)"""
    plain = ps = qs = 0
    for shape in shapes:
        if len(shape) <= 1:
            plain += max(1, shape[0] if shape else 1)
            continue
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            ps, qs = ps + rows * r, qs + cols * r
        else:
            plain += rows * cols
    return [Collective("allreduce", 4.0 * x, n) for x in (plain, ps, qs) if x]


def powersgd_flops(shapes, rank=4, min_compression_rate=2):
    """Floating-point operations of one PowerSGD step on the matrices it compresses:
    ``P = M Q``, ``Q = M^T P`` and the approximation ``P Q^T`` (``2 rows cols r`` each)."""
    total = 0.0
    for shape in shapes:
        if len(shape) <= 1:
            continue
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            total += 6.0 * rows * cols * r
    return total


def _horovod_fp32_collectives(numel, world_size, ranks_per_node, segments, options):
    return [Collective("allreduce", 4.0 * numel, world_size)]


def _powersgd_collectives(numel, world_size, ranks_per_node, segments, options):
    return powersgd_collectives(options.get("shapes") or [(numel,)], world_size, options.get("rank", 4))


def _powersgd_flops(options):
    return powersgd_flops(options["shapes"], options.get("rank", 4)) if options.get("shapes") else 0.0


register_cost("horovod_fp32", MethodCost(_horovod_fp32_collectives, lambda numel, n: ring_memory_bytes(numel, n),
                                         compresses=False))
# One DDP bucket holding the model (as the benchmarks configure it); its passes: the
# factors' products and the approximation, about two copies of the buffer.
register_cost("ddp_powersgd", MethodCost(_powersgd_collectives, lambda numel, n: 8.0 * 4.0 * float(numel),
                                         one_buffer=True, flops=_powersgd_flops))
