"""Global-QSGD, exponential dithering: one byte per element, a stochastic sum at every hop.

Xin, Canini, Richtárik, Horváth, arXiv 2305.18627 (Global-QSGD); reference code
https://github.com/sands-lab/global-qsgd (``exponential_dithering_hook`` and its pairwise
reduction). Written from the formulas, not from that code.

Values are normalised by the global max ``M`` (one scalar allreduce) and rounded
stochastically, without bias, to signed powers of two, one uint8 *code* each:

* ``0`` is zero; otherwise bits 0-6 hold ``c`` in [1, 127] for the magnitude
  ``2**(1 - c)`` (1 down to 2**-126, all normal float32) and bit 7 is the sign.
* encode: ``z = x / (M * 2**(n-1))``; ``|z|`` in ``[2**k, 2**(k+1))`` goes up to
  ``2**(k+1)`` with probability ``|z| / 2**k - 1``, else down to ``2**k`` (mean ``|z|``).
  Below ``2**-126`` it becomes ``2**-126`` with probability ``|z| * 2**126``, else 0.
* decode of the reduced codes: ``mean ~= M * 2**(n-1) / n * value(code)``.

The codes cannot be added by a plain allreduce, so a ring applies :class:`ExpDitheringSum`
hop by hop (:func:`hvd_quant.core.ring.ring_allreduce`; from 5 ranks on the direct
allreduce instead, :func:`~hvd_quant.core.ring.direct_allreduce`: one alltoall, the same
sums pairwise in a tree, one allgather, where a ring's ``2 (n - 1)`` hops were as many
Horovod collectives; the bits differ from the ring's): for ``±2**-e1`` and ``±2**-e2``
with ``e = min(e1, e2)`` and ``d = |e1 - e2|`` (in code units), the sum is exactly

* same sign: ``2**-e (1 + 2**-d)``: one binade up w.p. ``2**-d``, else ``2**-e``;
* opposite signs: ``2**-e (1 - 2**-d)``: one binade down w.p. ``2**-(d-1)``, else
  ``2**-e``, with the sign of the larger; ``d = 0`` gives exactly 0;
* a zero operand passes the other through.

Each hop is unbiased given its inputs, so the result is an unbiased estimate of the *sum*
of the ``z`` (tower rule); the codes always stand for sums, so the ranks' counts are not
needed.

Small buffers from 5 ranks on (:func:`~hvd_quant.core.ring.gathers`: at most 256 KiB more
per rank than the direct layout) go by one allgather of every rank's codes instead, and
every rank adds the ``n`` decoded rows in rank order: no stochastic sum at all, so the
same expectation with less variance, identical on every rank. One collective after the
scale instead of two: at 16 ranks a collective's latency outweighed such a buffer's bytes
(docs/benchmarks/scaling.md).

Headroom (why ``2**(n-1)``, not the reference's ``2 n``). A hop's result is at most
twice its larger operand, so a result standing for ``m`` ranks is at most ``2**(m-1)``
times the largest fresh value ``2**(1-n)``: by induction ``2 * max(2**(m1-1), 2**(m2-1))
<= 2**(m1+m2-1)``. So every partial result is ``<= 2**(m-n) <= 1``, the largest code, in
*any* reduction order. The reference's ``|y| <= 1/(2n)`` bounds the *true* sum only; it
is safe for its power-of-two binary tree (equal halves double at most), but on a ring the
stochastic partial sums drift: with every rank at the max and ``n = 3``, a coordinate
overflows the top magnitude with probability 1/9 (tests/test_global_qsgd.py). The cost
of ``2**(n-1)`` is dynamic range, not precision (codes are relative): fresh values use
codes ``n..127``, so :data:`EXP_MAX_WORLD` = 104 keeps 24 binades (float32's precision)
below ``M``.

Limits: under TensorFlow's flush-to-zero, ``|z| < 2**-126`` is flushed before rounding
(a bias below ``2**-126 * M * 2**(n-1)``); Bernoulli draws with probability below the
uniform grid (2**-23 or 2**-24) are taken as 0 (bias below that grid times the operand).
"""

from ..core.compressor import Compressor
from ..core.costmodel import Collective, level_memory_bytes, ring_hops
from ..core.hops import HopOperator
from ..core.ring import DIRECT_FROM, direct_allreduce, direct_padded_numel, gathers, ring_allreduce
from ..core.rng import draws
from .global_qsgd import FLOAT32_MAX, global_scale, normalise

#: Largest world size: fresh values keep codes ``n..127``, i.e. at least 24 binades.
EXP_MAX_WORLD = 104
_MANTISSA = 0x7FFFFF


def _shift(B, value):
    return B.full(1, value, "int32")


def pow2_neg(B, k):
    """float32 ``2**-k`` for an int32 tensor ``k`` in [0, 126], built from its bits."""
    return B.bitcast(B.left_shift(127 - k, _shift(B, 23)), "float32")


def exp_encode(B, x, scale, world_size, u):
    """uint8 codes of ``x / (scale * 2**(world_size - 1))``, unbiased stochastic rounding.

    ``scale`` is the global max (shape (1,)); ``u`` holds ``U[0, 1)`` samples like ``x``.
    """
    z = normalise(B, x, scale) * 2.0 ** (1 - world_size)  # power of two: exact
    mag = B.abs(z)
    bits = B.bitcast(mag, "int32")
    expo = B.right_shift(bits, _shift(B, 23))  # biased exponent; 0 for zero/subnormal
    normal = B.greater_equal(expo, _shift(B, 1))
    frac = B.cast(B.bitwise_and(bits, _shift(B, _MANTISSA)), "float32") * 2.0 ** -23
    p = B.where(normal, frac, mag * 2.0 ** 126)  # probability of the upper power of two
    up = B.cast(B.less(u, p), "int32")
    # |z| in [2**(expo-127), 2**(expo-126)): code 128 - expo, one less when rounded up.
    code = B.where(normal, 128 - expo - up, up * 127)
    nonzero = B.cast(B.greater_equal(code, _shift(B, 1)), "int32")
    negative = B.cast(B.less(z, B.zeros(1)), "int32") * nonzero  # no "negative zero" code
    return B.cast(code + negative * 128, "uint8")


def encode(B, x, scale, world_size, rng):
    """:func:`exp_encode` with one call of ``rng``'s stream for the draws (fused
    primitive ``exp_encode``)."""
    key = rng.next_key(B)
    fast = B.kernel("exp_encode", x)
    if fast is not None:
        return fast(x, B.kernel_scalar(scale), world_size, key)
    return exp_encode(B, x, scale, world_size, draws(B, key, B.numel(x)))


def exp_decode(B, codes, scale, world_size, into=None):
    """float32 mean estimate ``value(codes) * 2**(n-1) / n * scale`` (``n = world_size``).

    Multiplied in that order, so a scale near the float32 maximum does not overflow the
    factor; an estimate beyond the float32 range saturates at the maximum. Fused
    primitive ``exp_decode`` (which writes into ``into`` when given).
    """
    factor = 2.0 ** (world_size - 1) / world_size
    fast = B.kernel("exp_decode", codes)
    if fast is not None:
        return fast(codes, factor, B.kernel_scalar(scale), out=into)
    c = B.cast(codes, "int32")
    mag_code = B.bitwise_and(c, _shift(B, 127))
    mag = B.bitcast(B.left_shift(128 - mag_code, _shift(B, 23)), "float32")  # 2**(1-c)
    mag = B.where(B.less(mag_code, _shift(B, 1)), B.zeros(1), mag)
    sign = 1.0 - 2.0 * B.cast(B.right_shift(c, _shift(B, 7)), "float32")
    return B.clip(mag * sign * factor * scale, -FLOAT32_MAX, FLOAT32_MAX)


def decode_rows(B, rows, scale, world_size, numel):
    """The mean estimate from every rank's codes (``world_size`` rows of ``numel``): each
    row decoded (:func:`exp_decode`, ``value * 2**(n-1) / n * scale``: that rank's share
    of the mean) and the rows added in rank order, so every rank gets the same bits."""
    total = None
    for r in range(world_size):
        part = exp_decode(B, B.slice(rows, r * numel, (r + 1) * numel), scale, world_size)
        total = part if total is None else total + part
    return total


def combine_codes(B, a, b, u):
    """Unbiased stochastic sum of two uint8 code tensors (module docstring), given the
    uniform samples ``u`` (one per element)."""
    a, b = B.cast(a, "int32"), B.cast(b, "int32")
    m127, one = _shift(B, 127), _shift(B, 1)
    ca, cb = B.bitwise_and(a, m127), B.bitwise_and(b, m127)
    sa, sb = B.right_shift(a, _shift(B, 7)), B.right_shift(b, _shift(B, 7))
    a_larger = B.less(ca, cb)  # smaller code = larger magnitude
    e = B.where(a_larger, ca, cb)
    sign = B.where(a_larger, sa, sb)
    d = B.abs(ca - cb)
    same = B.less(B.abs(sa - sb), one)
    # Probability exponent: 2**-d up (same sign), 2**-(d-1) down (opposite, d >= 1).
    t = B.clip(B.where(same, d, d - 1), 0, 126)
    # u >= 1 - 2**-t has probability exactly 2**-t on the uniform grid (0 below it).
    jump = B.cast(B.greater_equal(u, 1.0 - pow2_neg(B, t)), "int32")
    out = sign * 128 + B.where(same, e - jump, e + jump)
    cancel = B.less(d + B.cast(same, "int32"), one)  # opposite signs, equal magnitude
    out = B.where(cancel, B.zeros(1, "int32"), out)
    out = B.where(B.less(ca, one), b, out)
    out = B.where(B.less(cb, one), a, out)
    return B.cast(out, "uint8")


class ExpDitheringSum(HopOperator):
    """Per-hop stochastic sum of exponential-dithering codes (uint8, unit 1).

    The codes stand for sums, so the counts are not used; the result is unbiased for the
    sum of what ``own`` and ``received`` stand for.
    """

    name = "exp_dithering_sum"
    unit = 1

    def combine(self, B, own, own_count, received, received_count, rng):
        key = rng.next_key(B)
        fast = B.kernel("exp_combine", own, received)
        if fast is not None:
            return fast(own, received, key)
        return combine_codes(B, own, received, draws(B, key, B.numel(own)))


class GlobalQSGDExpCompressor(Compressor):
    """Global-QSGD with exponential dithering (stateless, unbiased, no options).

    One fp32 max allreduce, then a ring of uint8 codes reduced with
    :class:`ExpDitheringSum`. Valid for up to :data:`EXP_MAX_WORLD` ranks.
    """

    multi_hop = True
    name = "global_qsgd_exp"

    def validate(self, world_size):
        if world_size > EXP_MAX_WORLD:
            raise ValueError(
                f"global_qsgd_exp supports at most {EXP_MAX_WORLD} ranks (its overflow-free "
                f"headroom 2**(n-1) would leave fewer than 24 binades below the max for "
                f"{world_size}); use global_qsgd (linear, bits=16) instead")

    def reduce(self, x, ctx):
        B, comm = ctx.backend, ctx.comm
        n, d = comm.size, B.numel(x)
        self.validate(n)
        # Phase 1: the global max (its allreduce also carries the non-finite flag).
        scale, _, finite = global_scale(B, comm, x, "max", ctx.collective_name("scale"))
        ctx.sent_scales(scale)
        # Phase 2: encode (zeros on a non-finite step), then the ring of stochastic sums.
        codes = B.cond(finite, lambda: encode(B, x, scale, n, ctx.rng),
                       lambda: encode(B, B.zeros(d), scale, n, ctx.rng))
        if gathers(n, d):  # one byte per element: every rank's codes, decoded and added here
            rows = B.reshape(comm.allgather(codes, ctx.collective_name("codes.gather")), (-1,))
            return B.cond(finite, lambda: decode_rows(B, rows, scale, n, d),
                          lambda: B.full(d, float("nan")))
        reduce = direct_allreduce if n >= DIRECT_FROM else ring_allreduce
        total = reduce(B, comm, codes, ExpDitheringSum(), ctx.collective_name("codes"), ctx.rng)
        return B.cond(finite, lambda: exp_decode(B, total, scale, n, into=ctx.out),
                      lambda: B.full(d, float("nan")))

    def wire_bytes(self, numel, world_size, segments=1):
        """Average bytes sent per rank: the fp32 scale by allreduce, one byte per element
        round the ring (``2 (n-1) / n`` of the codes; from 5 ranks, of the codes padded to
        a multiple of ``n``, or every code to every rank for a small buffer)."""
        if world_size > 1 and gathers(world_size, numel):
            return 2.0 * (world_size - 1) / world_size * 4 + (world_size - 1) * numel
        if world_size >= DIRECT_FROM:
            numel = direct_padded_numel(numel, world_size)
        return 2.0 * (world_size - 1) / world_size * (4 + numel) if world_size > 1 else 0.0

    def collectives(self, numel, world_size, ranks_per_node=None, segments=1, rank=0):
        """The max allreduce, then the codes: gathered (small buffers, one byte each), an
        alltoall and an allgather (from :data:`~hvd_quant.core.ring.DIRECT_FROM` ranks),
        or the ring's hops."""
        d, n = numel, world_size
        scale = Collective("allreduce", 4.0, n)
        if gathers(n, d):
            return [scale, Collective("allgather", float(d), n)]
        if n >= DIRECT_FROM:
            per = direct_padded_numel(d, n) // n
            return [scale, Collective("alltoall", float(n * per), n), Collective("allgather", float(per), n)]
        return [scale] + ring_hops(d, n, n, rank)

    def memory_bytes(self, numel, world_size, ranks_per_node=None, segments=1):
        return level_memory_bytes(numel, world_size)
