"""Sparse gradients (``nn.Embedding(sparse=True)``) as the dense ones hvd_quant reduces.

Every compressor and 1-bit optimizer works on dense flat buffers, so a sparse gradient is
reduced as a dense gradient of its parameter's full size (``sparse_as_dense=True``, the
default, as Horovod's option of that name does): a float32 buffer of the whole table per
step, and the compressor's passes over it. hvd_quant has no sparse reduction, so the
1-bit optimizers' ``sparse_as_dense=False`` refuses a sparse gradient with an error that
says this; ``DistributedOptimizer`` (a Horovod drop-in, where ``False`` is the default)
reduces it as dense all the same and says so once.
"""

import torch

from ..optimizers.base import same_memory


def sparse_error(name, numel, where):
    return RuntimeError(
        f"hvd_quant: the gradient of {name} is sparse (e.g. nn.Embedding(sparse=True)) and {where} "
        "has sparse_as_dense=False. hvd_quant compresses dense buffers only (a sparse reduction "
        "is not implemented): leave sparse_as_dense at its default, True, which reduces a dense "
        f"gradient of the parameter's full size ({4 * numel / 1e6:.3g} MB of float32 per step here), "
        "or use a dense embedding (sparse=False).")


def dense(g, name, numel, sparse_as_dense, where):
    """``g`` itself when dense; a sparse ``g`` made dense (``sparse_as_dense``), else the error."""
    if g is None or not g.is_sparse:
        return g
    if not sparse_as_dense:
        raise sparse_error(name, numel, where)
    return g.coalesce().to_dense()


def copy_into(dst, g):
    """Write the dense value of the (sparse or dense) gradient ``g`` into the flat float32
    ``dst`` without a dense temporary of the table's size: zeros, then the coalesced rows
    (the same values as ``g.coalesce().to_dense()``)."""
    if not g.is_sparse:
        dst.copy_(g.detach().reshape(-1))
        return dst
    g = g.coalesce().to(dst.device)  # a gradient's rows into the buffer's device
    if g.sparse_dim() != 1:
        dst.copy_(g.to_dense().reshape(-1))
        return dst
    dst.zero_()
    rows = dst.view(g.shape[0], -1)
    rows.index_add_(0, g.indices()[0], g.values().reshape(g.values().shape[0], -1).to(torch.float32))
    return dst


def fill_flat(flat, params, sparse_as_dense, name_of, where):
    """Write the gradients of ``params`` into consecutive slices of the float32 buffer
    ``flat`` (kept from step to step by the caller): zeros for a parameter without one, a
    sparse one's rows without a dense temporary (``sparse_as_dense``, else the error), and
    nothing for a gradient that already is its slice (a view a previous reduction left in
    ``.grad``, accumulated into by a later backward). Returns ``flat``."""
    offset = 0
    for p in params:
        n, g = p.numel(), p.grad
        piece = flat[offset:offset + n]
        if g is None:
            piece.zero_()
        elif g.is_sparse:
            if not sparse_as_dense:
                raise sparse_error(name_of(p), n, where)
            copy_into(piece, g)
        elif not same_memory(piece, g.detach().reshape(-1)):
            piece.copy_(g.detach().reshape(-1))
        offset += n
    return flat


def kept_flat(cache, key, numel, device=None):
    """The float32 buffer of ``numel`` elements on ``device`` (default: the CPU) kept in
    ``cache[key]`` (made or remade when the size changed): a fresh 127 MB tensor per step
    cost 49 ms of page faults, a copy into kept memory about a third of that."""
    buf = cache.get(key)
    if buf is None or buf.numel() != numel or (device is not None and buf.device != torch.device(device)):
        buf = cache[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf
