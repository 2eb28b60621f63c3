"""Element-wise steps of the Adam-family rules, as fused primitives.

Each function is the generic implementation (a few backend operations, each a pass over
memory with a full-size temporary) of a fused primitive of :mod:`hvd_quant.kernels`: it
asks ``B.kernel(name, ...)`` first, and CPU torch tensors get a one-pass numba loop that
does the same float32 operations in the same order, so the result is bit-identical
(``tests/test_kernels.py``). On a 25M-element group one such temporary costs about as
much as the 1-bit allreduce's own encoding, so the rules' arithmetic, not the wire, was
what made a 1-bit step slower than an fp32 allreduce on a 1 Gbit/s link.

Formulas follow DeepSpeed's ``runtime/fp16/onebit/adam.py`` and ``zoadam.py`` (see
:mod:`hvd_quant.optimizers.onebit_adam` and :mod:`hvd_quant.optimizers.zero_one_adam`).
"""


def ema(B, avg, value, beta, square=False, in_place=False, out=None):
    """``avg * beta + value * (1 - beta)`` (``value * value`` in place of ``value`` when
    ``square``): Adam's moment updates. Fused primitive ``ema``; ``in_place`` lets it
    write into ``avg`` itself, ``out`` into a buffer of the caller's (the generic path
    returns a new tensor either way)."""
    fast = B.kernel("ema", avg, value)
    if fast is not None:
        return fast(avg, value, float(beta), square, in_place, out=out)
    if square:
        value = value * value
    return avg * beta + value * (1.0 - beta)


def descend(B, x, step, lr, weight_decay, into=None, out=None, divisor=1):
    """``x - lr * (step / divisor + weight_decay * x)``: BinSGDM's update, ``step`` the sum
    of its ranks' signs and ``divisor`` their count (the mean is formed here, in the same
    pass, rather than as a full-size tensor of its own). Fused primitive ``descend`` (in
    place when ``into`` is ``x``, else into ``out`` if given; the generic path returns a
    new tensor)."""
    fast = B.kernel("descend", x, step)
    if fast is not None:
        # lr as given (a graph tensor under TensorFlow: the kernel reads its value), no float()
        return fast(x, step, lr, float(weight_decay), in_place=into is not None, out=out,
                    divisor=float(divisor))
    if divisor != 1:
        step = B.divide(step, float(divisor))
    if weight_decay > 0.0:
        step = step + x * weight_decay
    return x - step * lr


def adam_descend(B, x, m, v, lr, eps, weight_decay, acc=None, into=None, acc_into=None):
    """``x - delta`` with Adam's ``delta = lr * (m / (sqrt(v) + eps) + weight_decay * x)``;
    with ``acc``, also ``acc - delta`` (0/1 Adam's momentum accumulator). Fused primitive
    ``adam_descend``, which writes the results into ``into`` / ``acc_into`` when given
    (they may be ``x`` / ``acc`` themselves; the generic path ignores them).

    Returns
    -------
    new_x, or (new_x, new_acc) when ``acc`` is given
    """
    fast = B.kernel("adam_descend", x, m, v)
    if fast is not None:
        out = fast(x, m, v, lr, float(eps), float(weight_decay), acc, x_out=into, acc_out=acc_into)
        return out if acc is not None else out[0]
    upd = m / (B.sqrt(v) + eps)
    if weight_decay > 0.0:
        upd = upd + x * weight_decay
    delta = upd * lr
    return (x - delta, acc - delta) if acc is not None else x - delta


def precondition(B, u, v, eps, out=None):
    """``u * (sqrt(v) + eps)``: 0/1 Adam's accumulated update in the units of the
    momentum, what its sync compresses. Fused primitive ``precondition`` (into ``out``
    if given)."""
    fast = B.kernel("precondition", u, v)
    if fast is not None:
        return fast(u, v, float(eps), out=out)
    return u * (B.sqrt(v) + eps)


def zero_one_sync_input(B, x, m, g, v, u, beta, lr, eps, weight_decay, out=None):
    """0/1 Adam's sync step up to its allreduce, in one pass: the momentum ``m' = ema(m,
    g, beta)``, Adam's ``delta`` from it (:func:`adam_descend`), ``x' = x - delta``, ``u'
    = u - delta``, and what the sync needs of them: the parameters of the last sync ``x' -
    u'`` and the update to compress ``w = u' * (sqrt(v) + eps)`` (:func:`precondition`).
    ``m'``, ``x'`` and ``u'`` themselves are not kept: the sync replaces the momentum and
    the accumulator, and returns to ``x' - u'``. Fused primitive
    ``zero_one_sync_input`` (into the pair ``out`` if given): the same floats as the
    three primitives in a row, 7 full-size reads and writes instead of 12.

    Returns
    -------
    base, w
    """
    fast = B.kernel("zero_one_sync_input", x, m, g)
    if fast is not None:
        base, w = out if out is not None else (None, None)
        return fast(x, m, g, v, u, float(beta), lr, float(eps), float(weight_decay), base=base, w=w)
    x, u = adam_descend(B, x, ema(B, m, g, beta), v, lr, eps, weight_decay, acc=u)
    return x - u, precondition(B, u, v, eps)


def zero_one_sync_result(B, base, u, w, v, eps, lrs, out=None):
    """After 0/1 Adam's sync of ``w``: the synced parameters ``(base - u) + w / (sqrt(v)
    + eps)`` (``base`` alone when ``u`` is None) and the new momentum ``-(w / lrs)``.
    Fused primitive ``zero_one_sync_result`` (into the pair ``out`` if given)."""
    fast = B.kernel("zero_one_sync_result", base, w, v)
    if fast is not None:
        synced, momentum = out if out is not None else (None, None)
        return fast(base, u, w, v, float(eps), lrs, synced=synced, momentum=momentum)
    if u is not None:
        base = base - u
    return base + w / (B.sqrt(v) + eps), -(w / lrs)
