"""``Compression.onebit``: the two-stage 1-bit compressed allreduce as a compressor.

One process, simulated ranks (ThreadWorld, numpy oracle, and numpy + fused kernels): the
compressor, run through a :class:`~hvd_quant.core.runner.CompressorRunner` per rank as the
optimizers and tapes run it, equals :func:`hvd_quant.core.compressed_allreduce.compressed_allreduce` on
the same inputs with the error buffers carried by hand, and DeepSpeed's rules
(tests/deepspeed_reference.py); its state (buffer slots) checkpoints per rank and world
size. The multi-process runs are in tests/test_multiprocess.py, tests/test_keras.py and
tests/test_mixed_precision.py (``-k onebit``).
"""

import warnings

import numpy as np
import pytest

import deepspeed_reference as ds
import hvd_quant
from hvd_quant import kernels
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.handle import CompressorHandle
from hvd_quant.core.compressed_allreduce import (compressed_allreduce, compressed_allreduce_bytes,
                                   compressed_allreduce_compensated, gathered_allreduce, padded_size,
                                   server_residual)
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.core.state import BUFFER_PREFIX, StateStore, buffer_key

B = NumpyBackend()
BACKENDS = [B] + ([NumpyKernelBackend()] if kernels.enabled() else [])
BACKEND_IDS = [b.name for b in BACKENDS]
STEPS = 4


def segs(d):
    """Two named parameters (one may be empty): the buffer is a fusion of both."""
    return [("layer.w", d // 3), ("layer.b", d - d // 3)]


def data(n, d, steps=STEPS, seed=0):
    return [[np.random.default_rng(seed + 1000 * r + 17 * s + d).standard_normal(d).astype(np.float32)
             for s in range(steps)] for r in range(n)]


def run_compressor(runners, xs, steps, group="fused0", segments=None, backend=B):
    """Every rank's runner over ``steps`` steps; returns (per-rank outputs, world)."""
    d = xs[0][0].size
    segments = segs(d) if segments is None else segments
    world = ThreadWorld(len(runners))
    outs = world.run(lambda c: [runners[c.rank].reduce(xs[c.rank][s], c, group, segments)
                                for s in steps])
    return outs, world


def by_hand(backend, xs, steps):
    """compressed_allreduce with the error buffers carried by hand, on every rank."""
    n, d = len(xs), xs[0][0].size
    total = padded_size(d, n)

    def body(c):
        w, e, outs = np.zeros(total, np.float32), np.zeros(total // n, np.float32), []
        for s in steps:
            out, w, e, finite = compressed_allreduce(backend, c, xs[c.rank][s], w, e, f"c{s}")
            assert finite
            outs.append(out)
        return outs, w.copy(), e.copy()
    return ThreadWorld(n).run(body)


def errors(runner):
    """(worker error, server error) of a runner with one buffer, the server's in
    DeepSpeed's form: the compressor keeps its compensated values and their scale."""
    state = runner.state_dict()
    get = lambda slot: next(v for k, v in state.items() if k.endswith("/" + slot))  # noqa: E731
    server, scale = get("server_error"), get("server_scale")
    assert scale.shape == (1,)
    return get("worker_error"), server - np.where(server >= 0, scale, -scale)


# --- the gather layout: one allgather, the exact average of the worker signs --------------------
def gather_by_hand(xs, steps):
    """Every rank's worker stage in numpy (DeepSpeed's padding and RMS scale), and the
    average of every rank's scaled signs in rank order: (outputs, worker errors) per rank."""
    n, d = len(xs), xs[0][0].size
    total = padded_size(d, n)
    w = [np.zeros(total, np.float32) for _ in range(n)]
    outs = [[] for _ in range(n)]
    for s in steps:
        c = [np.concatenate([xs[r][s], np.zeros(total - d, np.float32)]) + w[r] for r in range(n)]
        sign = [np.where(v >= 0, np.float32(1), np.float32(-1)) for v in c]
        sigma = [np.float32(np.float32(np.sqrt(np.sum(v.astype(np.float64) ** 2))) / np.float32(np.sqrt(total)))
                 for v in c]
        mean = np.zeros(total, np.float32)
        for r in range(n):
            mean = mean + np.float32(sigma[r] * np.float32(1.0 / n)) * sign[r]
        for r in range(n):
            w[r] = c[r] - sigma[r] * sign[r]
            outs[r].append(mean[:d])
    return outs, w


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n,layout", [(2, "gather"), (3, "gather"), (6, "auto"), (8, "auto")])
@pytest.mark.parametrize("d", [1, 13, 1001])
def test_gather_layout_averages_every_ranks_scaled_signs(backend, n, layout, d):
    """layout="gather" (and "auto" from 5 ranks on for a small buffer): one allgather,
    the exact average the two stages' server would re-sign, identical on every rank;
    the worker error as in the two stages, the server's state untouched."""
    xs = data(n, d, seed=3)
    comp = hvd_quant.get("onebit", layout=layout)
    assert comp.buffer_layout(d, n) == "gather"
    runners = [CompressorRunner(comp, backend) for _ in range(n)]
    outs, world = run_compressor(runners, xs, range(STEPS), backend=backend)
    want, want_w = gather_by_hand(xs, range(STEPS))
    for r in range(n):
        for s in range(STEPS):
            np.testing.assert_array_equal(outs[r][s], outs[0][s])
            np.testing.assert_allclose(outs[r][s], want[r][s], rtol=2e-6, atol=1e-7)
        w, e = errors(runners[r])
        np.testing.assert_allclose(w, want_w[r], rtol=2e-6, atol=1e-6)
        assert not e.any()  # no server stage ran
    for m in world.meters:
        assert set(m.by_kind) == {"allgather"}
        assert m.bytes_sent == pytest.approx(STEPS * comp.wire_bytes(d, n))


def test_auto_layout_is_the_two_stages_up_to_four_ranks_and_for_large_buffers():
    comp = hvd_quant.get("onebit")
    assert comp.options() == {"layout": "auto"}
    for n in (2, 3, 4):
        assert comp.buffer_layout(10, n) == "two_stage"
    assert comp.buffer_layout(132_000, 16) == "gather"  # the digits MLP at 16 ranks
    assert comp.buffer_layout(3_700_000, 16) == "two_stage"
    assert comp.buffer_layout(10, 16) == hvd_quant.get("onebit", layout="gather").buffer_layout(10, 16)
    assert hvd_quant.get("onebit", layout="two_stage").buffer_layout(10, 16) == "two_stage"
    with pytest.raises(ValueError, match="layout must be one of"):
        hvd_quant.get("onebit", layout="ring")


def test_gather_layout_with_a_non_finite_rank_returns_nan_and_keeps_the_worker_error():
    n, d = 6, 100
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    run_compressor(runners, data(n, d), range(1))
    before = [errors(r)[0].copy() for r in runners]
    xs = data(n, d, steps=1, seed=9)
    xs[4][0][7] = np.nan
    outs, _ = run_compressor(runners, xs, range(1))
    for r in range(n):
        assert np.isnan(outs[r][0]).all()
        np.testing.assert_array_equal(errors(runners[r])[0], before[r])


# --- the compressor equals the core collective -------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("d", [0, 1, 2, 7, 13, 100, 1001])
def test_equals_compressed_allreduce_over_steps(backend, n, d):
    xs = data(n, d)
    runners = [CompressorRunner(hvd_quant.get("onebit", layout="two_stage"), backend) for _ in range(n)]
    outs, world = run_compressor(runners, xs, range(STEPS), backend=backend)
    expected = by_hand(backend, xs, range(STEPS))
    total = padded_size(d, n)
    for rank in range(n):
        for s in range(STEPS):
            assert outs[rank][s].shape == (d,) and outs[rank][s].dtype == np.float32
            np.testing.assert_array_equal(outs[rank][s], outs[0][s])  # identical on every rank
            np.testing.assert_array_equal(outs[rank][s], expected[rank][0][s])
        w, e = errors(runners[rank])
        assert w.shape == (total,) and e.shape == (total // n,)
        np.testing.assert_array_equal(w, expected[rank][1])
        np.testing.assert_array_equal(e, expected[rank][2])
    comp = hvd_quant.get("onebit", layout="two_stage")
    for m in world.meters:
        assert m.bytes_sent == pytest.approx(STEPS * comp.wire_bytes(d, n))
        assert m.bytes_sent == pytest.approx(STEPS * compressed_allreduce_bytes(d, n))


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("d", [1, 7, 1001])
def test_equals_deepspeed(n, d):
    xs = data(n, d, seed=5)
    runners = [CompressorRunner(hvd_quant.get("onebit", layout="two_stage"), B) for _ in range(n)]
    outs, _ = run_compressor(runners, xs, range(STEPS))
    total = padded_size(d, n)
    ref_w = [np.zeros(total, np.float32) for _ in range(n)]
    ref_s = [np.zeros(total // n, np.float32) for _ in range(n)]
    for s in range(STEPS):
        expected = ds.compressed_allreduce([xs[r][s] for r in range(n)], ref_w, ref_s)
        for r in range(n):
            np.testing.assert_array_equal(outs[r][s], expected[r])
    for r in range(n):
        w, e = errors(runners[r])
        np.testing.assert_array_equal(w, ref_w[r])
        np.testing.assert_array_equal(e, ref_s[r])


def test_one_rank_compresses_and_sends_nothing():
    xs = data(1, 13)
    runner = CompressorRunner(hvd_quant.get("onebit"), B)
    outs, world = run_compressor([runner], xs, range(2))
    expected = by_hand(B, xs, range(2))
    np.testing.assert_array_equal(outs[0][1], expected[0][0][1])
    assert world.meters[0].bytes_sent == 0.0 == hvd_quant.get("onebit").wire_bytes(13, 1)


def test_error_feedback_tracks_the_mean():
    """Biased per step, but the errors carry what was lost: averaged over many steps of a
    constant input, the output approaches the true mean."""
    n, d, steps = 3, 64, 400
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    outs, _ = run_compressor(runners, [[x] * steps for x in xs], range(steps))
    mean = np.mean(xs, axis=0)
    running = np.mean(np.asarray(outs[0], np.float64), axis=0)
    assert np.abs(running - mean).max() < 0.05 * np.abs(mean).max()
    assert np.abs(outs[0][0] - mean).max() > 0.1  # one step alone is far off


def test_registry_and_options():
    comp = hvd_quant.get("onebit")
    assert "onebit" in hvd_quant.available()
    assert comp.stateful and not comp.multi_hop and comp.horovod_wire_dtype is None
    assert comp.buffer_state_sizes(1001, 3) == {"worker_error": 1008, "server_error": 336,
                                                "server_scale": 1}
    assert comp.fingerprint() == hvd_quant.get("onebit").fingerprint() != hvd_quant.get("ef_sign").fingerprint()
    with pytest.raises(ValueError, match="bad options"):
        hvd_quant.get("onebit", bits=2)


# --- non-finite input ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_on_one_rank_leaves_state_untouched(n, bad):
    d = 37
    xs = data(n, d, steps=4)
    poisoned = [x[3].copy() for x in xs]
    poisoned[n - 1][11] = bad
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    world = ThreadWorld(n)

    def body(c):
        r = runners[c.rank]
        for s in range(3):  # some error feedback to protect
            r.reduce(xs[c.rank][s], c, "fused0", segs(d))
        before = {k: v.copy() for k, v in r.state_dict().items()}
        sent = c.meter.bytes_sent
        out = r.reduce(poisoned[c.rank], c, "fused0", segs(d))
        return out, before, r.state_dict(), c.meter.bytes_sent - sent

    for out, before, after, sent in world.run(body):
        assert np.isnan(out).all() and out.shape == (d,)
        assert before.keys() == after.keys() and len(before) == 3
        for key in before:
            np.testing.assert_array_equal(before[key], after[key], err_msg=key)
        assert sent == pytest.approx(hvd_quant.get("onebit").wire_bytes(d, n))  # no extra collective
    # The next finite step continues from the untouched errors, exactly as if the
    # poisoned step had never happened.
    fresh = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    run_compressor(fresh, xs, range(3))
    again, _ = run_compressor(runners, xs, [2])
    fresh_next, _ = run_compressor(fresh, xs, [2])
    np.testing.assert_array_equal(again[0][0], fresh_next[0][0])


# --- state: checkpoints, world size, owners ---------------------------------------------------
class NumpyHandle(CompressorHandle):
    framework = "numpy"

    def make_backend(self):
        return B


class Owner:
    """Stands for an optimizer."""


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("d", [0, 1, 13, 1001])
def test_state_dict_round_trip_resumes_exactly(n, d):
    xs = data(n, d, steps=5)
    handle = NumpyHandle("onebit")
    owners = [Owner() for _ in range(n)]
    runners = [handle.owned(o).runner for o in owners]
    for runner in runners:  # one process stands for n: give the n owners one scope
        runner.scope = "o"
    run_compressor(runners, xs, range(2))
    saved = [handle.state_dict(o) for o in owners]
    for r, state in enumerate(saved):
        total = padded_size(d, n)
        assert sorted(state) == sorted(buffer_key(segs(d), (r, n), k) for k in ("server_error", "server_scale", "worker_error"))
        assert state[buffer_key(segs(d), (r, n), "worker_error")].shape == (total,)
        assert state[buffer_key(segs(d), (r, n), "server_error")].shape == (total // n,)
    uninterrupted, _ = run_compressor(runners, xs, range(2, 5))

    restored_owners = [Owner() for _ in range(n)]
    for o, state in zip(restored_owners, saved):  # before the first step: waits for the buffer
        handle.load_state_dict(state, o)
    restored = [handle.owned(o).runner for o in restored_owners]
    for runner in restored:
        runner.scope = "o"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped
        resumed, _ = run_compressor(restored, xs, range(2, 5))
    for r in range(n):
        for a, b in zip(uninterrupted[r], resumed[r]):
            np.testing.assert_array_equal(a, b)

    # Loading into a runner that has already stepped overwrites its errors.
    late = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    run_compressor(late, xs, range(1))
    for runner, state in zip(late, saved):
        runner.load_state_dict(state)
    again, _ = run_compressor(late, xs, range(2, 5))
    np.testing.assert_array_equal(again[0][-1], uninterrupted[0][-1])


def test_torch_style_state_dict_values_load():
    """Values may come back as other array types (torch tensors from torch.load)."""
    torch = pytest.importorskip("torch")
    n, d = 2, 21
    xs = data(n, d)
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    run_compressor(runners, xs, range(2))
    saved = [{k: torch.from_numpy(v) for k, v in r.state_dict().items()} for r in runners]
    restored = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    for runner, state in zip(restored, saved):
        runner.load_state_dict(state)
    a, _ = run_compressor(runners, xs, [2, 3])
    b, _ = run_compressor(restored, xs, [2, 3])
    np.testing.assert_array_equal(a[1][1], b[1][1])


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("counts", [[1000], [4096 * 70 + 5], [100, 37, 163], [150_000, 3, 49_997]])
def test_compensated_server_state_gives_deepspeeds_bits(backend, n, counts):
    """The server's state kept as compensated values and scales (what the compressor keeps)
    gives the plain function's outputs and worker errors bit for bit, and its residual is
    the plain function's server error, over steps, per-tensor scales and a non-finite
    step (state untouched)."""
    d, k, steps = sum(counts), len(counts), 5
    xs = data(n, d, steps=steps, seed=11)
    xs[1][2][3] = np.inf
    total = padded_size(counts, n)

    def body(c):
        w1, e1 = np.zeros(total, np.float32), np.zeros(total // n, np.float32)
        w2, c2, s2 = np.zeros(total, np.float32), np.zeros(total // n, np.float32), np.zeros(k, np.float32)
        for s in range(steps):
            before = (c2.copy(), s2.copy())
            o1, w1, e1, f1 = compressed_allreduce(backend, c, xs[c.rank][s].copy(), w1, e1, f"a{s}",
                                                  counts=counts)
            o2, w2, c2, s2, f2 = compressed_allreduce_compensated(
                backend, c, xs[c.rank][s].copy(), w2, c2, s2, f"b{s}", counts=counts)
            assert bool(f1) == bool(f2) == (s != 2)
            np.testing.assert_array_equal(o1, o2)
            np.testing.assert_array_equal(w1, w2)
            np.testing.assert_array_equal(e1, server_residual(backend, c2, s2, counts, n))
            if s == 2:
                np.testing.assert_array_equal(c2, before[0])
                np.testing.assert_array_equal(s2, before[1])
        return True
    assert all(ThreadWorld(n).run(body))


@pytest.mark.skipif(not kernels.enabled(), reason="numba kernels not available")
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("counts", [[1024, 4096 * 70], [100, 37, 163], [150_000, 3, 49_997]])
def test_fused_kernels_give_the_oracles_bits(n, counts):
    """With the fused kernels (the decode writes the worker error in the same pass, one
    worker scale per tensor over its n chunks) every output and state equals the numpy
    oracle's bit for bit, over steps and a non-finite one, with the result written into
    the input itself as the optimizers do (where no tensor needs padding) or not."""
    fast = NumpyKernelBackend()
    d, k, steps = sum(counts), len(counts), 4
    xs = data(n, d, steps=steps, seed=23)
    xs[0][1][5] = np.nan
    total = padded_size(counts, n)

    def run(backend, c):
        w, cs, sc, got = None, np.zeros(total // n, np.float32), np.zeros(k, np.float32), []
        for s in range(steps):
            x = xs[c.rank][s].copy()
            out, w, cs, sc, finite = compressed_allreduce_compensated(
                backend, c, x, w, cs, sc, f"s{s}", counts=counts, out=x)
            assert bool(finite) == (s != 1)
            got.append((out.copy(), w.copy(), cs.copy(), sc.copy()))
        return got

    def body(c):
        for a, b in zip(run(B, c), run(fast, c)):
            for u, v in zip(a, b):
                np.testing.assert_array_equal(u, v)
        return True
    assert all(ThreadWorld(n).run(body))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("d", [13, 104, 1001])
def test_torch_tensors_give_the_same_bits(n, d):
    """torch CPU tensors (torch's backend, its kernels where enabled) against numpy with
    the same kernels, including one rank and chunks whose signs end off a 4-byte boundary
    (the gathered scales then start mid-word: 104 elements, 13 bytes)."""
    pytest.importorskip("torch")
    from solo_comm import FrameworkComm
    from hvd_quant.torch.backend import TorchBackend

    T, ref = TorchBackend(), BACKENDS[-1]
    xs = data(n, d, steps=3, seed=2)
    total = padded_size(d, n)

    def body(c, B):
        comm = c if B is ref else FrameworkComm(c, B)
        state = [B.constant(np.zeros(k, np.float32), "float32") for k in (total, total // n, 1)]
        outs = []
        for s in range(3):
            out, *state, finite = compressed_allreduce_compensated(
                B, comm, B.constant(xs[c.rank][s], "float32"), *state, f"t{s}")
            assert bool(finite)
            outs.append(np.asarray(B.to_numpy(out)))
        return outs, [np.asarray(B.to_numpy(v)) for v in state]

    got = ThreadWorld(n).run(lambda c: body(c, T))
    want = ThreadWorld(n).run(lambda c: body(c, ref))
    for (outs, state), (outs_ref, state_ref) in zip(got, want):
        for a, b in zip(outs + state, outs_ref + state_ref):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_gather_layout_gives_the_same_bits_in_each_framework(framework):
    """gathered_allreduce on torch CPU tensors and TensorFlow tensors (eager) against the
    numpy oracle with the same kernels: outputs and worker errors bit for bit, over steps."""
    if framework == "torch":
        T = pytest.importorskip("hvd_quant.torch.backend").TorchBackend()
    else:
        T = pytest.importorskip("hvd_quant.tensorflow.backend").TFBackend()
    from solo_comm import FrameworkComm

    ref = BACKENDS[-1]
    n, d = 6, 1001
    xs = data(n, d, steps=3, seed=4)
    total = padded_size(d, n)

    def body(c, B):
        comm = c if B is ref else FrameworkComm(c, B)
        worker = B.constant(np.zeros(total, np.float32), "float32")
        outs = []
        for s in range(3):
            out, worker, finite = gathered_allreduce(B, comm, B.constant(xs[c.rank][s], "float32"),
                                                     worker, f"t{s}")
            assert bool(finite)
            outs.append(np.asarray(B.to_numpy(out)))
        return outs + [np.asarray(B.to_numpy(worker))]

    got = ThreadWorld(n).run(lambda c: body(c, T))
    want = ThreadWorld(n).run(lambda c: body(c, ref))
    for a_rank, b_rank in zip(got, want):
        for a, b in zip(a_rank, b_rank):
            np.testing.assert_array_equal(a, b)


def test_a_server_error_saved_as_a_residual_resumes_exactly():
    """A checkpoint of the residual form (DeepSpeed's, or this compressor before it kept
    compensated values: no ``server_scale``) resumes bit for bit: a residual is the
    compensated state with zero scale."""
    n, d = 3, 1001
    xs = data(n, d, steps=4)
    plain = by_hand(B, xs, range(2))  # the residual form after 2 steps
    expected = by_hand(B, xs, range(4))
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(n)]
    for r, runner in enumerate(runners):
        runner.load_state_dict({buffer_key(segs(d), (r, n), "worker_error"): plain[r][1],
                                buffer_key(segs(d), (r, n), "server_error"): plain[r][2]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs, _ = run_compressor(runners, xs, range(2, 4))
    for r in range(n):
        for s in (2, 3):
            np.testing.assert_array_equal(outs[r][s - 2], expected[r][0][s])
        w, e = errors(runners[r])
        np.testing.assert_array_equal(w, expected[r][1])
        np.testing.assert_array_equal(e, expected[r][2])


def test_state_of_another_world_size_or_rank_is_dropped():
    d = 50
    xs2, xs3 = data(2, d), data(3, d)
    two = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(2)]
    run_compressor(two, xs2, range(2))
    saved = [r.state_dict() for r in two]

    # Loaded before the buffer exists, then run on 3 ranks: dropped, restarts from zero.
    three = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(3)]
    for r in range(3):
        three[r].load_state_dict(saved[r % 2])
    with pytest.warns(UserWarning, match="restarts from zero"):
        got, _ = run_compressor(three, xs3, range(2))
    expected = by_hand(B, xs3, range(2))
    np.testing.assert_array_equal(got[0][1], expected[0][0][1])
    for r in range(3):  # nothing stale is carried into the next save
        assert all("of3/" in k for k in three[r].state_dict())

    # Loaded after the buffer exists: the same rule.
    with pytest.warns(UserWarning, match="rank0of2"):
        three[0].load_state_dict(saved[0])
    assert all("of3/" in k for k in three[0].state_dict())

    # Same world size, another rank's file: dropped too (the server error is a chunk).
    swapped = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(2)]
    swapped[0].load_state_dict(saved[1])
    swapped[1].load_state_dict(saved[0])
    with pytest.warns(UserWarning, match="restarts from zero") as caught:
        got, _ = run_compressor(swapped, xs2, range(1))
    assert sorted(str(w.message).split("kept for ")[1].split(";")[0] for w in caught) == ["rank0of2", "rank1of2"]
    np.testing.assert_array_equal(got[0][0], by_hand(B, xs2, range(1))[0][0][0])


def test_state_of_another_buffer_layout_waits_for_it():
    d = 30
    xs = data(2, d)
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(2)]
    run_compressor(runners, xs, range(1))
    saved = runners[0].state_dict()
    other = CompressorRunner(hvd_quant.get("onebit"), B)
    other.load_state_dict(saved)
    two = [other, CompressorRunner(hvd_quant.get("onebit"), B)]
    run_compressor(two, xs, range(1), segments=[("layer.w", 10), ("other.b", 20)])
    kept = other.state_dict()
    for key, value in saved.items():  # not this buffer's: kept for the next save
        np.testing.assert_array_equal(kept[key], value)
    assert len(kept) == 6 and all(k.startswith(BUFFER_PREFIX) for k in kept)


def test_a_live_world_change_restarts_the_errors():
    """An elastic job that resized: the same runner reduces on 3 ranks after 2."""
    d = 40
    runners = [CompressorRunner(hvd_quant.get("onebit"), B) for _ in range(3)]
    run_compressor(runners[:2], data(2, d), range(2))
    xs3 = data(3, d)
    with pytest.warns(UserWarning, match="restarts from zero") as caught:
        got, _ = run_compressor(runners, xs3, range(2))
    assert {str(w.message).split("kept for ")[1].split(";")[0] for w in caught} == {"rank0of2", "rank1of2"}
    np.testing.assert_array_equal(got[2][1], by_hand(B, xs3, range(2))[2][0][1])
    w, e = errors(runners[0])
    assert w.size == padded_size(d, 3) and e.size == padded_size(d, 3) // 3


def test_owner_made_variables_are_built_for_the_world_size():
    """Keras' path: the optimizer creates the tensors when it is built."""
    made = {}

    def make_variable(name, initial):
        made[name] = initial.shape
        return B.variable(initial)

    d, n = 100, 3
    runners = [CompressorRunner(hvd_quant.get("onebit"), B, make_variable=make_variable) for _ in range(n)]
    with pytest.raises(TypeError, match="size="):
        runners[0].build(0, [("fused0", segs(d))])
    for r, runner in enumerate(runners):
        runner.build(r, [("fused0", segs(d))], size=n)
    assert made == {"fused0_worker_error": (padded_size(d, n),),
                    "fused0_server_error": (padded_size(d, n) // n,), "fused0_server_scale": (1,)}
    xs = data(n, d)
    outs, _ = run_compressor(runners, xs, range(3))
    expected = by_hand(B, xs, range(3))
    np.testing.assert_array_equal(outs[1][2], expected[1][0][2])
    # A world of another size does not fit tensors of a fixed shape: refused clearly.
    with pytest.raises(ValueError, match="another world size"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_compressor(runners[:2], data(2, d), range(1))


def test_store_keeps_per_element_slots_as_before():
    """ef_sign's residual is still saved per parameter; a view without buffer slots is
    what it always was."""
    store = StateStore(B)
    view = store.view("g", [("w", 5), ("b", 3)])
    view.set("residual", view.get("residual") + np.arange(8, dtype=np.float32))
    assert sorted(store.state_dict()) == ["b/residual", "w/residual"]
    runner = CompressorRunner(hvd_quant.get("ef_sign"), B)
    assert runner.buffer_sizes([("w", 5)], 2) == {}
