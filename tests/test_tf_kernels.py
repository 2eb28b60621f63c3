"""The fused kernels on TensorFlow tensors (hvd_quant.tensorflow.kernels), eagerly and in
``tf.function``, against the numpy oracle (and the torch backend's kernels).

Every fused primitive is reached through its generic caller (the function an algorithm
calls), so the test covers the routing too: bit for bit wherever the oracle's result
does not depend on the order of a float sum, with the same random draws. Then whole
compressors at one rank (every encode and decode pass; the collectives are identities),
several steps with their state in ``tf.Variable``s, the kept result buffers, the dense
gradient of an embedding, the fall-backs, and that nothing compiles after set-up.
"""

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import hvd_quant  # noqa: E402
from hvd_quant import kernels  # noqa: E402
from hvd_quant.compressors import exp_dithering as ed  # noqa: E402
from hvd_quant.compressors import global_qsgd as gq  # noqa: E402
from hvd_quant.compressors.marsit import MarsitSelect  # noqa: E402
from hvd_quant.core.backend import NumpyBackend  # noqa: E402
from hvd_quant.core.hierarchical import rebinarize  # noqa: E402
from hvd_quant.core.packing import (pack_signs, sign_pack_residual, sign_residual, unpack_scaled_sum,  # noqa: E402
                                    unpack_sum_residual, unpack_sums_signs)
from hvd_quant.core.rng import CounterRNG, random_bytes  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402
from hvd_quant.core.segments import block_counts, chunk_blocks, compensate_sums, compensate_sums_signs  # noqa: E402
from hvd_quant.kernels.buffers import KeptBuffers  # noqa: E402
from hvd_quant.kernels.signatures import SIGNATURES  # noqa: E402
from hvd_quant.optimizers import elementwise as ew  # noqa: E402
from hvd_quant.optimizers.binsgdm import binary_randomize  # noqa: E402
from hvd_quant.tensorflow import kernels as tfk  # noqa: E402
from hvd_quant.tensorflow.backend import TFBackend  # noqa: E402
from hvd_quant.tensorflow.tape import flatten_gradients, gradients_for_py_function  # noqa: E402

from solo_comm import SoloComm as _Solo  # noqa: E402


class SoloComm(_Solo):
    allreduce_int_dtypes = ("int8", "int32", "int64")  # TensorFlow's Horovod sums int8

    def alltoall(self, x, name):
        return x

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason=f"kernels off: {kernels.why_disabled()}")

NP = NumpyBackend()
TF = TFBackend()
D = 3 * 65536 + 5  # crosses the kernels' blocks, not a multiple of 8
COUNTS = [D // 3, 0, D - D // 3]  # one empty segment, none aligned to bytes


def data(d, seed, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(d).astype(np.float32) * np.float32(scale)
    if d >= 8:
        x[:4] = [0.0, -0.0, 1e-45, -1e-45]
    return x


class Key:
    """A random call's key as the TF backend has it: an int64 tensor of shape (1,)."""

    def __init__(self, seed):
        self.value = CounterRNG(seed).next_key()

    def np(self):
        return self.value

    def tf(self):
        return tf.constant([self.value], tf.int64)


def run_tf(mode, fn, *arrays):
    """``fn(TF backend, *tensors)`` eagerly or traced; results as numpy (nested)."""
    tensors = [tf.constant(a) for a in arrays]
    out = fn(*tensors) if mode == "eager" else tf.function(fn, autograph=False)(*tensors)
    return tf.nest.map_structure(lambda t: np.asarray(t), out)


def equal(got, want):
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        np.testing.assert_array_equal(g, w)


MODES = ["eager", "graph"]


# --- each primitive through its generic caller ---------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_sign_primitives_equal_the_oracle(mode):
    x, e = data(D, 1), data(D, 2, 0.3)
    scales = np.array([0.5, 2.0, 0.25], np.float32)
    equal(run_tf(mode, lambda t: pack_signs(TF, t), x), pack_signs(NP, x))
    equal(run_tf(mode, lambda a, b, s: sign_pack_residual(TF, a, b, s, COUNTS, out=b), x, e, scales),
          sign_pack_residual(NP, x, e, scales, COUNTS))
    equal(run_tf(mode, lambda a, s: sign_pack_residual(TF, a, None, s, COUNTS), x, scales),
          sign_pack_residual(NP, x, None, scales, COUNTS))
    equal(run_tf(mode, lambda a, b, s: sign_residual(TF, a, b, s, COUNTS, out=b), x, e, scales),
          sign_residual(NP, x, e, scales, COUNTS))
    for squares in (False, True):
        got = run_tf(mode, lambda a, b: compensate_sums_signs(TF, a, b, COUNTS, squares), x, e)
        want = compensate_sums_signs(NP, x, e, COUNTS, squares)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)  # float64 sums in another order
        equal(got[1], want[1])
        # The one-pass sums are those of compensate_sums' kernel, bit for bit.
        assert got[0].tobytes() == run_tf(mode, lambda a, b: compensate_sums(TF, a, b, COUNTS, squares), x, e).tobytes()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 3])
def test_unpack_scaled_sum_equals_the_oracle(mode, rows):
    packed = np.concatenate([pack_signs(NP, data(D, 10 + r)) for r in range(rows)])
    scales = np.random.default_rng(3).random(rows * 3).astype(np.float32)
    base = data(D, 4)
    equal(run_tf(mode, lambda p, s: unpack_scaled_sum(TF, p, s, COUNTS, D), packed, scales),
          unpack_scaled_sum(NP, packed, scales, COUNTS, D))
    equal(run_tf(mode, lambda p, s, b: unpack_scaled_sum(TF, p, s, COUNTS, D, base=b), packed, scales, base),
          unpack_scaled_sum(NP, packed, scales, COUNTS, D, base=base))
    own = np.array([0.5, 2.0, 0.25], np.float32)
    got = run_tf(mode, lambda p, s, a, b, o: unpack_sum_residual(TF, p, s, COUNTS, D, a, b, o, out=a, resid_out=b),
                 packed, scales, base, data(D, 5), own)
    equal(got[0], unpack_scaled_sum(NP, packed, scales, COUNTS, D))
    equal(got[1], sign_residual(NP, base, data(D, 5), own, COUNTS))
    # onebit's server stage (segments on whole bytes: the fused pass), decoded over its state.
    d8 = D + 3
    counts8 = [D // 3 // 8 * 8, 0, d8 - D // 3 // 8 * 8]
    packed8 = np.concatenate([pack_signs(NP, data(d8, 20 + r)) for r in range(rows)])
    for squares in (False, True):
        got = run_tf(mode, lambda p, s, b, f: unpack_sums_signs(TF, p, s, counts8, d8, base=b, base_scales=f,
                                                                out=b, squares=squares),
                     packed8, scales, data(d8, 6), own)
        want = unpack_sums_signs(NP, packed8, scales, counts8, d8, base=data(d8, 6), base_scales=own,
                                 squares=squares)
        equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12)
        equal(got[2], want[2])


class Comm:
    rank, size = 0, 3

    def __init__(self, native):
        self.allreduce_int_dtypes = ("int8", "int16", "int32") if native else ("int32",)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("width,native", [(8, True), (16, True), (8, False), (16, False)])
def test_global_qsgd_primitives_equal_the_oracle(mode, width, native):
    x = data(D, 5)
    key = Key(9)
    comm = Comm(native)
    levels = gq.max_levels("max", 3, width)
    scale, pre = np.array([3.5], np.float32), np.array([1.0], np.float32)
    want_q = gq.quantize(NP, comm, x, scale, pre, levels, width, key=key.np())
    got_q = run_tf(mode, lambda a, s, p, k: gq.quantize(TF, comm, a, s, p, levels, width, key=k),
                   x, scale, pre, key.tf())
    equal(got_q, want_q)
    equal(run_tf(mode, lambda q, s, p: gq.dequantize(TF, comm, q, D, s, p, levels, width), want_q, scale, pre),
          gq.dequantize(NP, comm, want_q, D, scale, pre, levels, width))
    for v in (x, np.where(np.arange(D) == 7, np.float32(np.inf), x)):
        got = run_tf(mode, lambda a: gq.local_scale_stat(TF, a, "max"), v)  # the max, or inf
        equal(got, gq.local_scale_stat(NP, v, "max"))
        counts = block_counts(D, 512)  # a scale per block: the fused maxima, or inf in every block
        equal(run_tf(mode, lambda a: gq.local_scale_stat(TF, a, "max", counts), v),
              gq.local_scale_stat(NP, v, "max", counts))
    # A scale and a pre per block, from element 8 of a buffer on (a chunk inside a block).
    counts = chunk_blocks(D + 8, 512, 8, D + 8)[1]
    scale = (np.arange(1, len(counts) + 1) * 1.75).astype(np.float32)
    pre = np.where(np.arange(len(counts)) % 2, np.float32(2.0 ** -64), np.float32(1.0)).astype(np.float32)
    args = (NP, comm, x, scale, pre, counts, 512, levels, width)
    want_q = gq.quantize_blocks(*args, key=key.np(), first=8)
    got_q = run_tf(mode, lambda a, s, p, k: gq.quantize_blocks(TF, comm, a, s, p, counts, 512, levels, width,
                                                                key=k, first=8), x, scale, pre, key.tf())
    equal(got_q, want_q)
    equal(run_tf(mode, lambda q, s, p: gq.dequantize(TF, comm, q, D, s, p, levels, width, counts=counts,
                                                     block=512, first=8), want_q, scale, pre),
          gq.dequantize(NP, comm, want_q, D, scale, pre, levels, width, counts=counts, block=512, first=8))


class Rng:
    """A stream whose next call has a fixed key (a Python int, or a tensor for TF)."""

    def __init__(self, key):
        self.key = key

    def next_key(self, B):
        return self.key


@pytest.mark.parametrize("mode", MODES)
def test_exponential_dithering_equals_the_oracle(mode):
    x, y = data(D, 6), data(D, 7)
    k1, k2 = Key(1), Key(2)
    scale = np.array([4.0], np.float32)
    codes = ed.encode(NP, x, scale, 3, Rng(k1.np()))
    other = ed.encode(NP, y, scale, 3, Rng(k2.np()))
    equal(run_tf(mode, lambda a, s, k: ed.encode(TF, a, s, 3, Rng(k)), x, scale, k1.tf()), codes)
    op = ed.ExpDitheringSum()
    equal(run_tf(mode, lambda a, b, k: op.combine(TF, a, 1, b, 1, Rng(k)), codes, other, k2.tf()),
          op.combine(NP, codes, 1, other, 1, Rng(k2.np())))
    equal(run_tf(mode, lambda c, s: ed.exp_decode(TF, c, s, 3), codes, scale), ed.exp_decode(NP, codes, scale, 3))


@pytest.mark.parametrize("mode", MODES)
def test_marsit_selection_binsgdm_and_draws_equal_the_oracle(mode):
    own, recv = pack_signs(NP, data(D, 8)), pack_signs(NP, data(D, 9))
    key = Key(4)
    want = MarsitSelect().combine(NP, own, 1, recv, 2, Rng(key.np()))
    halves = MarsitSelect().combine(NP, own, 1, recv, 1, Rng(key.np()))  # random bit planes
    equal(run_tf(mode, lambda a, b, k: MarsitSelect().combine(TF, a, 1, b, 1, Rng(k)), own, recv, key.tf()),
          halves)
    equal(run_tf(mode, lambda k: random_bytes(TF, k, 1001), key.tf()), random_bytes(NP, key.np(), 1001))
    equal(run_tf(mode, lambda a, b, k: MarsitSelect().combine(TF, a, 1, b, 2, Rng(k)), own, recv, key.tf()), want)
    g, m, b = data(D, 10), data(D, 11, 0.1), np.abs(data(D, 12, 0.1))
    equal(run_tf(mode, lambda *t: binary_randomize(TF, *t[:3], 0.9, t[3]), g, m, b, key.tf()),
          binary_randomize(NP, g, m, b, 0.9, key.np()))
    equal(run_tf(mode, lambda k: TF.uniform(Rng(k), 1001), key.tf()), NP.uniform(Rng(key.np()), 1001))
    rows = np.random.default_rng(13).integers(0, 256, 2 * D).astype(np.uint8)
    equal(run_tf(mode, lambda r, k: rebinarize(TF, r, 2, k), rows, key.tf()), rebinarize(NP, rows, 2, key.np()))
    rows = np.random.default_rng(14).integers(0, 256, 3 * D).astype(np.uint8)  # a draw each
    equal(run_tf(mode, lambda r, k: rebinarize(TF, r, 3, k), rows, key.tf()), rebinarize(NP, rows, 3, key.np()))
    for v in (g, np.where(np.arange(D) == D - 1, np.float32(np.nan), g)):
        assert bool(run_tf(mode, lambda a: TF.all_finite(a), v)) == bool(NP.all_finite(v))


def _adam_inputs(d):
    x, m, u, w = data(d, 21), data(d, 22, 1e-2), data(d, 23, 1e-3), data(d, 24)
    v = np.abs(data(d, 25, 1e-2)) ** 2
    return x, m, v, u, w


def _elementwise(B, x, m, v, u, w, lr):
    return [ew.ema(B, m, x, 0.9), ew.ema(B, v, x, 0.999, square=True), ew.precondition(B, u, v, 1e-8),
            ew.descend(B, x, w, lr, 0.01), ew.adam_descend(B, x, m, v, lr, 1e-8, 0.01),
            *ew.adam_descend(B, x, m, v, lr, 1e-6, 0.0, acc=u),
            *ew.zero_one_sync_result(B, x, u, w, v, 1e-8, lr),
            *ew.zero_one_sync_input(B, x, m, w, v, u, 0.9, lr, 1e-8, 0.01)]


def test_adam_family_primitives_equal_the_oracle_eagerly():
    inputs = _adam_inputs(D)
    got = _elementwise(TF, *[tf.constant(a) for a in inputs], tf.constant(1e-3))
    for g, want in zip(got, _elementwise(NP, *inputs, 1e-3)):
        equal(np.asarray(g), want)


def test_adam_family_fuses_in_graphs_with_a_tensor_learning_rate():
    """In a graph the learning rate is a tensor (a schedule, a variable): every Adam-family
    primitive still runs its kernel, with the oracle's bits."""
    inputs = _adam_inputs(D)
    routed = {}

    @tf.function(autograph=False)
    def fn(lr, *t):
        for name in ("ema", "precondition", "descend", "adam_descend", "zero_one_sync_result",
                     "zero_one_sync_input"):
            routed[name] = TF.kernel(name, *t[:3]) is not None
        return _elementwise(TF, *t[:5], lr)
    got = fn(tf.constant(1e-3), *[tf.constant(a) for a in inputs])
    assert all(routed.values()), routed
    for g, w in zip(got, _elementwise(NP, *inputs, 1e-3)):
        equal(np.asarray(g), w)


def test_the_torch_backend_runs_the_same_kernels():
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.backend import TorchBackend

    x, e = data(D, 1), data(D, 2, 0.3)
    scales = np.array([0.5, 2.0, 0.25], np.float32)
    T = TorchBackend()
    want = sign_pack_residual(T, torch.from_numpy(x), torch.from_numpy(e), torch.from_numpy(scales), COUNTS)
    for mode in MODES:
        got = run_tf(mode, lambda a, b, s: sign_pack_residual(TF, a, b, s, COUNTS), x, e, scales)
        equal(got, [w.numpy() for w in want])


def test_the_signature_table_covers_every_kernel():
    public = {name for name in kernels.NAMES}
    assert public <= set(SIGNATURES), public - set(SIGNATURES)


# --- whole compressors, state in variables, several steps ---------------------------------------
COMPRESSORS = [("ef_sign", {}), ("marsit", {}), ("marsit", {"compensation": "global"}), ("global_qsgd", {}),
               ("global_qsgd", {"norm": "l2"}), ("global_qsgd_exp", {}), ("onebit", {}), ("cascading_sign", {})]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=[f"{n}-{o}" for n, o in COMPRESSORS])
def test_compressors_at_one_rank_equal_the_oracle(mode, name, opts):
    """Three steps with the state carried in tf.Variables (adopting kept buffers): the
    oracle's results and state. At one rank the collectives are identities, every pass
    of the method runs. No subnormal inputs here: TensorFlow's own ops (the glue between
    kernels, e.g. Marsit's ``x + e`` with global compensation) flush them to zero, the
    oracle does not; the kernels themselves keep them (the tests above)."""
    segs = [("a", 700), ("b", 1300), ("c", 2 * 65536 + 3)]
    d = sum(n for _, n in segs)
    xs = [data(d, 50 + s)[4:] for s in range(3)]
    xs = [np.concatenate([x, x[:4]]) for x in xs]
    want_runner = CompressorRunner(hvd_quant.get(name, **opts), NP, seed=3)
    want = [want_runner.reduce(x, SoloComm(), "buf", segs) for x in xs]
    runner = CompressorRunner(hvd_quant.get(name, **opts), TF, seed=3,
                              make_variable=lambda n, init: tf.Variable(init))
    runner.build(0, [("buf", segs)], size=1)
    step = (lambda x: runner.reduce(x, SoloComm(), "buf", segs)) if mode == "eager" else \
        tf.function(lambda x: runner.reduce(x, SoloComm(), "buf", segs), autograph=False)
    got = [np.asarray(step(tf.constant(x))) for x in xs]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for key, value in want_runner.state_dict().items():
        np.testing.assert_array_equal(runner.state_dict()[key], value)


# --- memory: kept buffers, the dense embedding gradient -------------------------------------------
def test_a_kept_result_is_never_overwritten():
    buffers = KeptBuffers()
    a = buffers.empty(1000, np.float32)
    a[:] = 1.0
    b = buffers.empty(1000, np.float32)
    assert not np.shares_memory(a, b)  # a is still held
    view = a[10:20]
    del a
    c = buffers.empty(1000, np.float32)
    assert not np.shares_memory(c, view)  # a view of it still holds it
    del view, b, c
    d = buffers.empty(1000, np.float32)  # all three free again: one reused, aligned
    assert d.ctypes.data % 64 == 0 and buffers.nbytes() == 3 * (4000 + 64)
    held = tf.experimental.dlpack.from_dlpack(d.__dlpack__())
    address = d.ctypes.data
    del d
    assert buffers.empty(1000, np.float32).ctypes.data != address  # a tensor holds it
    assert held._numpy().ctypes.data == address
    buffers.release()
    assert buffers.nbytes() == 4000 + 64  # the one the tensor holds


@pytest.mark.parametrize("mode", MODES)
def test_results_kept_by_the_caller_survive_later_steps(mode):
    x = data(D, 30)
    fn = (lambda t: pack_signs(TF, t)) if mode == "eager" else tf.function(lambda t: pack_signs(TF, t))
    first = fn(tf.constant(x))
    for seed in range(3):
        fn(tf.constant(data(D, 31 + seed)))
    equal(np.asarray(first), pack_signs(NP, x))


@pytest.mark.parametrize("mode", MODES)
def test_state_variables_adopt_kept_buffers_without_copies(mode):
    """The new residual's buffer becomes the variable's: two buffers alternate."""
    x, e = data(D, 40), data(D, 41, 0.3)
    var = tf.Variable(e)
    scales = tf.constant([0.5, 2.0, 0.25])

    def step(t):
        var.assign(sign_residual(TF, t, var.read_value(), scales, COUNTS, out=var.read_value()))
    step = step if mode == "eager" else tf.function(step, autograph=False)
    seen = set()
    want = e
    for _ in range(4):
        step(tf.constant(x))
        seen.add(var.value()._numpy().ctypes.data)
        want = sign_residual(NP, x, want, np.array([0.5, 2.0, 0.25], np.float32), COUNTS)
    equal(var.numpy(), want)
    assert len(seen) == 2, seen


@pytest.mark.parametrize("mode", MODES)
def test_embedding_gradients_are_made_dense_bit_for_bit(mode):
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    emb = keras.layers.Embedding(50, 8)
    dense = keras.layers.Dense(3)
    tokens = tf.constant([[1, 7, 7, 49], [7, 0, 3, 1]])  # repeated rows sum

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dense(emb(tokens)) ** 2)
        variables = emb.trainable_variables + dense.trainable_variables
        return tape.gradient(loss, variables), variables

    unused = tf.Variable(tf.zeros([5]))  # no gradient: zeros

    def flat(sparse_as_dense=True):
        g, v = grads()
        assert isinstance(g[0], tf.IndexedSlices)
        return flatten_gradients(g + [None], v + [unused], sparse_as_dense)

    def generic():
        g, v = grads()
        return tf.concat([tf.reshape(tf.convert_to_tensor(t), [-1]) for t in g] + [tf.zeros([5])], 0)
    fn = flat if mode == "eager" else tf.function(flat)
    equal(np.asarray(fn()), np.asarray(generic()))
    with pytest.raises(ValueError, match="sparse_as_dense"):
        flat(sparse_as_dense=False)


def test_a_py_function_gets_a_sparse_gradient_as_rows_and_flattens_it_bit_for_bit():
    """The measured Keras step's py_function (tape.reduce_when_the_graph_runs) takes an
    embedding's gradient as its rows and indices, not as a dense table built in the
    graph, and flattens it inside to the same bits."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    emb, dense = keras.layers.Embedding(50, 8), keras.layers.Dense(3)
    tokens = tf.constant([[1, 7, 7, 49], [7, 0, 3, 1]])
    dense(emb(tokens))  # built: their variables exist
    unused = tf.Variable(tf.zeros([5]))
    variables = emb.trainable_variables + dense.trainable_variables + [unused]
    handed = []

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dense(emb(tokens)) ** 2)
        grads = tape.gradient(loss, variables[:-1]) + [None]
        passed, rebuild = gradients_for_py_function(grads, variables)
        handed.append([tuple(t.shape) for t in passed])
        flat = tf.py_function(lambda *t: flatten_gradients(rebuild(t), variables), passed, tf.float32)
        generic = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads[:-1]] + [tf.zeros([5])], 0)
        return flat, generic

    flat, generic = step()
    equal(np.asarray(flat), np.asarray(generic))
    assert handed[0][:2] == [(8, 8), (8,)], handed  # 8 looked-up rows, not the 50 x 8 table


def test_rows_of_a_sparse_gradient_add_in_order_and_drop_negative_indices():
    table = np.zeros((4, 3), np.float32)
    values = np.array([[1e8, 1, 1], [1, 1, 1], [-1e8, 2, 2], [5, 5, 5]], np.float32)
    kernels.cpu_module().add_rows(table, np.array([2, 2, 2, -1], np.int32), values)
    np.testing.assert_array_equal(table[2], ((np.float32(0) + values[0]) + values[1]) + values[2])  # [0, 4, 4]
    assert not table[[0, 1, 3]].any()
    with pytest.raises(IndexError):
        kernels.cpu_module().add_rows(table, np.array([4], np.int64), values[:1])


# --- fall-backs, threads, compilation -------------------------------------------------------------
def test_xla_runs_the_generic_path_with_one_logged_reason(caplog):
    x = data(1001, 60)[4:]  # no subnormals: XLA's generic code flushes them
    tfk._logged.clear()
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        fn = tf.function(lambda t: (pack_signs(TF, t), pack_signs(TF, t * 2.0)), jit_compile=True)
        got = fn(tf.constant(x))
    equal(np.asarray(got[0]), pack_signs(NP, x))
    reasons = [r.getMessage() for r in caplog.records if "XLA" in r.getMessage()]
    assert len(reasons) == 1 and "generic TensorFlow path" in reasons[0], reasons


def test_gpu_tensors_run_the_generic_path_with_one_logged_reason(monkeypatch, caplog):
    monkeypatch.setattr(tfk, "_on_gpu", lambda t: True)  # no GPU here: the placement test itself
    tfk._logged.clear()
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        assert TF.kernel("sign_pack", tf.zeros([8])) is None
        assert TF.kernel("unpack_scaled_sum", tf.zeros([8], tf.uint8), tf.zeros([1])) is None
    reasons = [r.getMessage() for r in caplog.records if "GPU" in r.getMessage()]
    assert len(reasons) == 1, reasons


def test_prepare_warns_once_when_tensorflow_oversubscribes_the_host(monkeypatch, caplog):
    from hvd_quant.kernels import threads

    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "2")
    monkeypatch.setattr(threads, "_horovod_modules", lambda: [])
    monkeypatch.setattr(threads, "usable_cores", lambda: (4, "affinity 4"))
    monkeypatch.setattr(threads, "_warned", set())
    monkeypatch.setattr(tf.config.threading, "get_intra_op_parallelism_threads", lambda: 0)
    monkeypatch.setattr(threads, "affinity_cores", lambda: 4)
    try:
        with caplog.at_level(logging.WARNING, logger="hvd_quant"):
            tfk.prepare_kernels()
            tfk.prepare_kernels()
    finally:
        monkeypatch.undo()
        threads.configure(log_choice=False)
    warnings = [r.getMessage() for r in caplog.records if "TensorFlow uses" in r.getMessage()]
    assert len(warnings) == 1 and "set_intra_op_parallelism_threads(2)" in warnings[0], warnings


def test_nothing_compiles_after_set_up():
    """Every signature a TensorFlow path uses (writable graph inputs, kept buffers,
    Python numbers from scalar tensors) is loaded by prepare()."""
    kernels.prepare()
    before = kernels.loaded_signatures()
    for mode in MODES:
        test_sign_primitives_equal_the_oracle(mode)
        test_unpack_scaled_sum_equals_the_oracle(mode, 3)
        test_global_qsgd_primitives_equal_the_oracle(mode, 8, True)
        test_marsit_selection_binsgdm_and_draws_equal_the_oracle(mode)
        test_exponential_dithering_equals_the_oracle(mode)
        test_embedding_gradients_are_made_dense_bit_for_bit(mode)
    test_adam_family_primitives_equal_the_oracle_eagerly()
    assert kernels.loaded_signatures() == before
