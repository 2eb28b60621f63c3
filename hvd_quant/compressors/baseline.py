"""Uncompressed baselines, expressed as compressors so every path can use them.

``none`` and ``fp16`` match Horovod's ``Compression.none`` / ``Compression.fp16``:
a float sum over ranks, divided by the number of ranks.
"""

from ..core.compressor import Compressor
from ..core.costmodel import Collective, ring_memory_bytes


class NoCompression(Compressor):
    """fp32 allreduce (sum, then divide by the number of ranks)."""

    name = "none"
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
    horovod_wire_dtype = "float16"

    def reduce(self, x, ctx):
        B = ctx.backend
        total = ctx.comm.allreduce(B.cast(x, "float16"), "sum", ctx.collective_name("sum"))
        return B.cast(total, "float32") / float(ctx.comm.size)

    def wire_bytes(self, numel, world_size, segments=1):
        return 2.0 * (world_size - 1) / world_size * 2 * numel

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        return [Collective("allreduce", 2.0 * numel, world_size)]

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        # the casts (read fp32, write fp16; read fp16, write fp32), half a ring's passes
        return 3.0 * (4.0 * float(numel)) + ring_memory_bytes(numel, world_size) / 2.0
