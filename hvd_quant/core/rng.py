"""Counter-based random numbers: the same draws on every backend, kernel and thread count.

Stochastic rounding, Marsit's bit selection and BinSGDM's binary randomization all need
uniform draws. A stateful generator (``torch.rand``, ``tf.random.Generator``) gives
different numbers on different frameworks and cannot be shared by a multi-threaded
kernel without fixing the order in which threads consume it. Here every draw is a pure
function of three integers instead (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011, call this a counter-based generator)::

    key_c   = mix32(stream_key ^ mix32(c * 0x9E3779B9))     c: the stream's call counter
    bits(i) = mix32(mix32(i ^ key_c) ^ key_c)               i: element index in the call
    u(i)    = (bits(i) >> 8) * 2**-24                       float32 in [0, 1)

``mix32`` is the "lowbias32" integer hash (C. Wellons, "Prospecting for hash functions",
2018; a bijection on 32-bit words: xor-shift, multiply, xor-shift, multiply, xor-shift).
So the numpy oracle, the torch and TensorFlow graphs and the numba kernels
(:mod:`hvd_quant.kernels`) draw *identical* numbers for the same seed, and a kernel may
split an index range over any number of threads.

Tensor arithmetic is done in int64 on values below ``2**32``: the second multiplier is
used as ``M2 - 2**32`` (same low 32 bits of the product), so no product leaves the int64
range on any framework and no code relies on signed overflow.
"""

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_M2_LOW = _M2 - (1 << 32)  # x * _M2_LOW == x * _M2 (mod 2**32); |product| < 2**63
_GOLDEN = 0x9E3779B9
#: Uniform draws keep the top 24 bits: exactly representable in float32.
UNIFORM_BITS = 24


def mix32(x):
    """lowbias32 of the Python int ``x`` (taken modulo ``2**32``)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def stream_key(seed):
    """The 32-bit key of the stream seeded by the int ``seed`` (any size)."""
    seed = int(seed)
    return mix32(mix32(seed & MASK32) ^ ((seed >> 32) & MASK32) ^ 0x3C6EF372)


def call_key(key, call):
    """Key of call number ``call`` (Python ints) of the stream with key ``key``."""
    return mix32(key ^ mix32(call * _GOLDEN))


def mix32_tensor(B, x):
    """lowbias32 of an int64 tensor holding values in ``[0, 2**32)``."""
    mask = B.full(1, MASK32, "int64")
    x = B.bitwise_xor(x, B.right_shift(x, B.full(1, 16, "int64")))
    x = B.bitwise_and(x * _M1, mask)
    x = B.bitwise_xor(x, B.right_shift(x, B.full(1, 15, "int64")))
    x = B.bitwise_and(x * _M2_LOW, mask)
    return B.bitwise_xor(x, B.right_shift(x, B.full(1, 16, "int64")))


def call_key_tensor(B, key, call):
    """:func:`call_key` for an int64 scalar tensor ``call`` (graph-mode counters)."""
    golden = B.bitwise_and(B.bitwise_and(call, B.full(1, 0x7FFFFFFF, "int64")) * _GOLDEN,
                           B.full(1, MASK32, "int64"))
    return mix32_tensor(B, B.bitwise_xor(B.full(1, key, "int64"), mix32_tensor(B, golden)))


def hash_bits(B, key, n, offset=0):
    """int64 tensor of the 32-bit draws ``bits(offset) ... bits(offset + n - 1)`` of one
    call with key ``key`` (a Python int, or an int64 tensor of shape (1,))."""
    if not isinstance(key, int):
        k = key
    else:
        k = B.full(1, key, "int64")
    i = B.arange(n, "int64") + offset if offset else B.arange(n, "int64")
    return mix32_tensor(B, B.bitwise_xor(mix32_tensor(B, B.bitwise_xor(i, k)), k))


def uniform_from_bits(B, bits):
    """float32 in [0, 1) from 32-bit draws: the top 24 bits times ``2**-24``."""
    return B.cast(B.right_shift(bits, B.full(1, 32 - UNIFORM_BITS, "int64")), "float32") * 2.0 ** -UNIFORM_BITS


def draws(B, key, n):
    """``n`` uniform float32 draws of the call with key ``key`` (see the module docstring)."""
    return uniform_from_bits(B, hash_bits(B, key, n))


def random_bytes(B, key, n):
    """uint8 tensor of ``n`` random bytes of the call with key ``key``: byte ``i`` is the
    byte ``i % 4`` (least significant first) of the 32-bit draw ``bits(i // 4)``, so 8
    random bits per byte where a uniform draw gives one number per element (fused
    primitive ``random_bytes``)."""
    fast = B.kernel("random_bytes")
    if fast is not None:
        return fast(key, n)
    words = -(-n // 4)
    # int64 as 8 bytes, little-endian (every platform torch and TF run on): the draw's 4
    # bytes, then 4 zero bytes.
    table = B.reshape(B.bitcast(hash_bits(B, key, words), "uint8"), (words, 8))
    return B.slice(B.reshape(B.slice_columns(table, 0, 4), (-1,)), 0, n)


def random_planes(B, key, planes, width):
    """``planes`` uint8 tensors of ``width`` random bytes each (bit planes: a random bit
    per element, 8 per byte): plane ``p`` is bytes ``p * width ... (p + 1) * width - 1`` of
    :func:`random_bytes`. A choice among ``2**L`` equally likely outcomes per element
    takes ``L`` planes, where a draw against a threshold takes a draw per element."""
    flat = random_bytes(B, key, planes * width)
    return [B.slice(flat, p * width, (p + 1) * width) for p in range(planes)]


def dyadic_bits(B, key, a, levels, width):
    """``width`` bytes of independent bits, each ``1`` with probability ``a / 2**levels``
    exactly (``0 < a < 2**levels``): :func:`bits_below` of ``levels`` random planes of the
    call with key ``key``, ``32 / levels`` elements per 32-bit draw."""
    return bits_below(B, random_planes(B, key, levels, width), a)


def bits_below(B, planes, a):
    """Packed bits of ``j < a`` per element, ``j`` the number whose bit ``L - 1 - p`` is
    the element's bit of ``planes[p]`` (plane 0 the most significant), for an int
    ``0 < a < 2**L``: with uniform planes, each bit is 1 with probability ``a / 2**L``.
    A comparison of ``j`` with the constant ``a`` from the top bit down: where ``j`` still
    equals ``a``'s leading bits and ``a`` has a 1, a 0 in ``j`` decides below."""
    less, equal = None, None  # None: no plane yet (no bit set / every bit set)
    for p, r in enumerate(planes):
        zero = B.bitwise_not(r)
        if (a >> (len(planes) - 1 - p)) & 1:
            found = zero if equal is None else B.bitwise_and(equal, zero)
            less = found if less is None else B.bitwise_or(less, found)
            equal = r if equal is None else B.bitwise_and(equal, r)
        else:
            equal = zero if equal is None else B.bitwise_and(equal, zero)
    return less


def select_bits(B, ones, zeros, mask):
    """Bitwise select on packed bytes: ``ones``' bit where ``mask``'s is 1, else
    ``zeros``' (``zeros ^ ((ones ^ zeros) & mask)``: three byte-wise operations)."""
    return B.bitwise_xor(zeros, B.bitwise_and(B.bitwise_xor(ones, zeros), mask))


class CounterRNG:
    """One random stream: a 32-bit key and a call counter (a Python int).

    Each :meth:`next_key` hands out the key of the next call; a draw of ``n`` numbers
    uses indices ``0 .. n-1`` under that key. ``calls`` is part of a checkpoint: restoring
    it resumes the stream exactly.
    """

    def __init__(self, seed):
        self.seed = int(seed)
        self.key = stream_key(seed)
        self.calls = 0

    def next_key(self, B=None):
        k = call_key(self.key, self.calls)
        self.calls += 1
        return k

    def __repr__(self):
        return f"CounterRNG(seed={self.seed}, calls={self.calls})"
