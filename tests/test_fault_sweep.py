"""Inputs that break naive implementations, for every compressor and every 1-bit optimizer.

On simulated ranks (numpy oracle): empty tensors, one element, sizes not divisible by the
world size or by 8, all zeros, subnormals, values near the float32 maximum, and one
rank's inf or NaN in one element. The same cases run under real Horovod in
tests/test_fault_sweep_mp.py.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hvd_quant
from hvd_quant import kernels
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.compressed_allreduce import compressed_allreduce, padded_size
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers import BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule
from hvd_quant.optimizers.base import initial_state
from hvd_quant.optimizers.oracle import OracleOptimizer

B = NumpyBackend()
FMAX = np.finfo(np.float32).max
COMPRESSORS = [("none", {}), ("fp16", {}), ("ef_sign", {}), ("marsit", {}),
               ("marsit", {"compensation": "global"}), ("marsit", {"scale": 0.01}),
               ("cascading_sign", {}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
               ("global_qsgd", {"bits": 16}), ("global_qsgd", {"block": 4}),
               ("global_qsgd", {"norm": "l2", "block": 4}), ("global_qsgd_exp", {}), ("onebit", {})]
IDS = [f"{n}{'-' + '-'.join(f'{k}={v}' for k, v in o.items()) if o else ''}" for n, o in COMPRESSORS]
SIZES = [0, 1, 5, 13, 1001]


def inputs(kind, n, d):
    rng = np.random.default_rng(d + 7 * n)
    if kind == "zeros":
        return [np.zeros(d, np.float32) for _ in range(n)]
    if kind == "subnormal":
        return [(rng.choice([-1, 1], d) * 1e-40 * rng.integers(1, 9, d)).astype(np.float32) for _ in range(n)]
    if kind == "near_max":  # fp16 cannot hold these at all (Horovod's own fp16 overflows too)
        return [(rng.choice([-1.0, 1.0], d) * FMAX * rng.uniform(0.25, 0.5, d)).astype(np.float32)
                for _ in range(n)]
    return [rng.standard_normal(d).astype(np.float32) for _ in range(n)]


def reduce_on(name, opts, xs, steps=1):
    n = len(xs)
    runners = [CompressorRunner(hvd_quant.get(name, **opts), B, seed=1) for _ in range(n)]
    segs = lambda d: [("w", d // 2), ("b", d - d // 2)]  # noqa: E731
    d = xs[0].size
    out = ThreadWorld(n).run(lambda c: [runners[c.rank].reduce(xs[c.rank], c, "buf", segs(d))
                                        for _ in range(steps)])
    for o in out[1:]:
        for a, b in zip(o, out[0]):
            np.testing.assert_array_equal(a, b)  # identical on every rank
    return out[0], runners


@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=IDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("kind", ["normal", "zeros", "subnormal", "near_max"])
def test_compressors_on_awkward_inputs(name, opts, n, d, kind):
    if kind == "near_max" and name in ("none", "fp16"):
        pytest.skip("a plain sum over ranks overflows there, exactly as Horovod's own fp32/fp16 "
                    "allreduce does")
    xs = inputs(kind, n, d)
    outs, _ = reduce_on(name, opts, xs, steps=2 if kind != "near_max" else 1)
    mean = np.mean(np.asarray(xs, np.float64), axis=0) if d else np.zeros(0)
    for out in outs:
        assert out.shape == (d,) and out.dtype == np.float32
        assert np.isfinite(out).all(), (name, kind, out)
        if kind == "zeros":  # (a constant-scale sign method sends +-scale: sign(0) = +1)
            assert np.all(np.abs(out) == opts.get("scale", 0.0))
        if kind == "near_max":  # no overflow: within the inputs' range (2x for stochastic sums)
            assert np.all(np.abs(out) <= 2 * np.abs(np.asarray(xs)).max(initial=0.0))
    if kind == "normal" and d and name not in ("none", "fp16"):
        # A compressed estimate, but of the right size: within a few times the largest input.
        assert np.abs(outs[0]).max() <= 4 * np.abs(np.asarray(xs)).max(initial=0.0)
    if kind == "normal" and name in ("none", "fp16"):
        np.testing.assert_allclose(outs[0], mean, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=IDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_non_finite_element_on_one_rank(name, opts, n, bad):
    """Non-finite in, non-finite out (the whole buffer, every rank); state untouched."""
    d = 37
    xs = inputs("normal", n, d)
    warm = [inputs("normal", n, d) for _ in range(2)]
    poisoned = [x.copy() for x in xs]
    poisoned[n - 1][11] = bad
    runners = [CompressorRunner(hvd_quant.get(name, **opts), B, seed=1) for _ in range(n)]
    segs = [("w", 20), ("b", 17)]

    def body(c):
        r = runners[c.rank]
        for w in warm:  # some error feedback to protect
            r.reduce(w[c.rank], c, "buf", segs)
        before = {k: v.copy() for k, v in r.state_dict().items()}
        calls = [r.rng_state().get(c.rank, 0)]
        out = r.reduce(poisoned[c.rank], c, "buf", segs)
        after = r.state_dict()
        calls.append(r.rng_state().get(c.rank, 0))
        r.reduce(xs[c.rank], c, "buf", segs)  # a finite step, for its draws
        calls.append(r.rng_state().get(c.rank, 0))
        return out, before, after, calls

    for out, before, after, calls in ThreadWorld(n).run(body):
        if name in ("none", "fp16"):  # a plain sum: the poisoned element, as Horovod's
            assert not np.isfinite(out[11]) and np.isfinite(np.delete(out, 11)).all()
        else:
            assert not np.isfinite(out).any(), (name, out)
        assert before.keys() == after.keys()
        for key in before:
            np.testing.assert_array_equal(before[key], after[key], err_msg=key)
        # The random stream is not state that a bad step leaves alone: its draws are
        # taken before the flag is known, and it advances exactly as on a finite step
        # (as documented in README, "Failure behaviour").
        assert calls[1] - calls[0] == calls[2] - calls[1], calls
        assert (calls[2] > calls[1]) == (name in ("marsit", "cascading_sign", "global_qsgd",
                                                  "global_qsgd_exp")), calls  # the stochastic ones


#: The oracle's generic arithmetic and, where numba works, the fused CPU kernels that the
#: torch and eager TensorFlow backends run.
WIRE_BACKENDS = [B] + ([NumpyKernelBackend()] if kernels.enabled() else [])


def spy_on(comm, log, int_dtypes=None):
    """Record every payload ``comm`` sends, as ``(kind, copy of the tensor)`` in ``log``.

    ``int_dtypes`` replaces the integer dtypes the communicator claims to sum natively:
    ``("int32", "int64")`` is torch's Horovod, which makes Global-QSGD pack its levels
    into int32 lanes instead of sending int8/int16 directly.
    """
    for kind in ("allreduce", "allgather", "alltoall", "sendrecv"):
        def wrapped(x, *args, _send=getattr(comm, kind), _kind=kind, **kwargs):
            log.append((_kind, np.array(x, copy=True)))
            return _send(x, *args, **kwargs)
        setattr(comm, kind, wrapped)
    if int_dtypes is not None:
        comm.allreduce_int_dtypes = int_dtypes
    return comm


@pytest.mark.parametrize("name,opts,int_dtypes", [
    ("global_qsgd", {}, None), ("global_qsgd", {"norm": "l2"}, None),
    ("global_qsgd", {"bits": 16}, None), ("global_qsgd", {}, ("int32", "int64")),
    ("global_qsgd", {"norm": "l2"}, ("int32", "int64")), ("global_qsgd", {"block": 8}, None),
    ("global_qsgd", {"norm": "l2", "block": 8}, ("int32", "int64")), ("global_qsgd_exp", {}, None)],
    ids=["max-int8", "l2-int8", "max-int16", "max-lanes", "l2-lanes", "max-blocks-int8", "l2-blocks-lanes",
         "exp-ring"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("backend", WIRE_BACKENDS, ids=[b.name for b in WIRE_BACKENDS])
def test_integer_lanes_never_carry_a_nan_as_a_number(name, opts, int_dtypes, n, bad, backend):
    """What goes on the wire on a non-finite step: every integer payload (Global-QSGD's
    summed levels, native or packed into int32 lanes; exponential dithering's codes in
    every ring hop) encodes zeros on every rank, never a level cast from inf or NaN; the
    non-finite flag travels in the float scale and the output is NaN. Both the generic
    path (the oracle's arithmetic, also TF graphs and CUDA) and the fused CPU kernels."""
    from hvd_quant.core.packing import pack_lanes

    d = 100
    good = inputs("normal", n, d)
    poisoned = [x.copy() for x in good]
    poisoned[n - 1][5] = bad

    def body(c):
        runner = CompressorRunner(hvd_quant.get(name, **opts), backend, seed=1)
        sent = {}
        for label, xs in (("good", good), ("bad", poisoned)):
            log = []
            out = runner.reduce(xs[c.rank], spy_on(c, log, int_dtypes), "buf", [("w", d)])
            sent[label] = ([p for _, p in log if p.dtype.kind in "iu"], out)
        return sent

    for rank, sent in enumerate(ThreadWorld(n).run(body)):
        ints, out = sent["bad"]
        assert np.isnan(out).all()
        assert ints, "no integer payload was sent: the test would check nothing"
        for payload in ints:
            if name == "global_qsgd" and int_dtypes is not None:
                # int32 words of packed lanes: zeros, plus the offset rank 0 adds.
                assert payload.dtype == np.int32
                np.testing.assert_array_equal(
                    payload, pack_lanes(B, np.zeros(d, np.int32), _lane_width(payload, d), rank == 0))
            else:
                assert not payload.any(), (rank, payload)
        # The same payloads on a finite step are not zeros: the check above can fail.
        good_ints, good_out = sent["good"]
        assert np.isfinite(good_out).all()
        assert any(p.any() for p in good_ints) and len(good_ints) == len(ints)


def _lane_width(words, numel):
    """Lane width (8 or 16 bits) of ``words`` int32 words holding ``numel`` lanes."""
    return {(numel + 3) // 4: 8, (numel + 1) // 2: 16}[words.size]


RULES = [("onebit_adam", lambda: OnebitAdamRule(freeze_step=3)),
         ("zero_one_adam", lambda: ZeroOneAdamRule(var_freeze_step=4, var_update_scaler=1,
                                                   local_step_scaler=2, local_step_clipper=2)),
         ("binsgdm_flat", lambda: BinSGDMRule()),
         ("binsgdm_2x2", lambda: BinSGDMRule(ranks_per_node=2))]
HP = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

#: One rank's inf/-inf/NaN in one element at step ``where`` (0-based, step 0 is
#: DeepSpeed's initialisation step) of a 1-bit optimizer, under real Horovod
#: (tests/mp/sweep_worker.py): ``(case, optimizer, options, where, kind of that step,
#: Phase B)``. The schedules: 1-bit Adam warms up on steps 1-3 and compresses from step 4;
#: 0/1 Adam has full rounds on steps 1 and 3, a 1-bit round on step 2, freezes after
#: step 3, syncs on steps 4, 5, 7 and steps locally on step 6.
ZERO_ONE_FAULTS = dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
OPTIMIZER_FAULTS = [
    ("onebit_adam/warm_up", "onebit_adam", dict(freeze_step=4), 2, "full", None),
    ("onebit_adam/onebit", "onebit_adam", dict(freeze_step=4), 5, "onebit", None),
    ("zero_one_adam/full", "zero_one_adam", ZERO_ONE_FAULTS, 1, "full", False),
    ("zero_one_adam/onebit", "zero_one_adam", ZERO_ONE_FAULTS, 2, "onebit", False),
    ("zero_one_adam/sync", "zero_one_adam", ZERO_ONE_FAULTS, 4, "onebit", True),
    ("zero_one_adam/local", "zero_one_adam", ZERO_ONE_FAULTS, 6, "local", True),
    ("binsgdm/flat", "binsgdm", {}, 3, "onebit", None),
]


def near_max_skips(label, d, steps):
    """Steps a 1-bit optimizer skips when every gradient is near the float32 maximum.

    The Adam family's second moment needs ``g**2``, which overflows float32 for
    ``|g| > ~1.8e19`` (plain Adam then stores an infinite ``v`` and never moves those
    elements again). hvd_quant treats such a full-precision step as non-finite: every
    rank skips it, state untouched. With near-maximal gradients on every step the warm-up
    (1-bit Adam) or the first full round (0/1 Adam) never completes, so every step after
    DeepSpeed's initialisation step is skipped. BinSGDM keeps ``|m| <= b`` and sends one
    bit per element: nothing overflows, nothing is skipped.
    """
    return steps - 1 if d and not label.startswith("binsgdm") else 0


@pytest.mark.parametrize("label,rule", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("kind", ["normal", "zeros", "subnormal", "near_max"])
def test_optimizers_on_awkward_inputs(label, rule, d, kind):
    n = 4 if label == "binsgdm_2x2" else 3
    steps, lr = 10, 1e-2
    grads = [inputs(kind, n, d) for _ in range(steps)]
    hp = dict(HP, betas=(0.9,)) if label.startswith("binsgdm") else HP

    def body(c):
        opt = OracleOptimizer(rule(), np.ones(d, np.float32), c, hp)
        for s in range(steps):
            opt.step(grads[s][c.rank], lr)
        return opt

    opts = ThreadWorld(n).run(body)
    # The state after DeepSpeed's initialisation step: the zero momentum or accumulator
    # went through the compressed allreduce, and everything is still zero.
    fresh, _ = initial_state(rule(), [d], n)
    for o in opts:
        assert o.x.shape == (d,) and np.isfinite(o.x).all()
        assert all(np.isfinite(v).all() for v in o.state.slots.values())
        if kind != "near_max":
            assert o.state.skipped == 0
        else:
            assert o.state.skipped == near_max_skips(label, d, steps), o.state.kinds
            # Each step moves an element by at most lr (BinSGDM: |q_bar| <= 1).
            assert np.all(np.abs(o.x - 1.0) <= steps * lr * (1 + 1e-6))
        if o.state.skipped:  # nothing but the initialisation step left a trace
            np.testing.assert_array_equal(o.x, np.ones(d, np.float32))
            assert o.state.scalars["step"] == 1
            for key, value in o.state.slots.items():
                np.testing.assert_array_equal(value, fresh[key], err_msg=key)
        if kind == "zeros" and not label.startswith("binsgdm"):
            np.testing.assert_array_equal(o.x, np.ones(d, np.float32))  # nothing to do


def test_compressed_allreduce_of_huge_values_does_not_overflow_its_norms():
    n, d = 3, 1000
    xs = inputs("near_max", n, d)

    def body(c):
        total = padded_size(d, n)
        return compressed_allreduce(B, c, xs[c.rank], np.zeros(total, np.float32),
                                    np.zeros(total // n, np.float32), "c")

    for out, w, e, finite in ThreadWorld(n).run(body):
        assert finite and np.isfinite(out).all() and np.isfinite(w).all() and np.isfinite(e).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), d=st.integers(0, 200), seed=st.integers(0, 2 ** 31),
       name=st.sampled_from(["ef_sign", "marsit", "global_qsgd", "global_qsgd_exp", "onebit"]))
def test_any_world_size_any_length(n, d, seed, name):
    """Property: whatever the world size and length, every rank gets the same finite
    vector of the right length, and the unbiased compressors stay within their bounds."""
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(n)]
    outs, _ = reduce_on(name, {}, xs)
    assert outs[0].shape == (d,) and np.isfinite(outs[0]).all()
    if name.startswith("global_qsgd") and d:
        assert np.abs(outs[0]).max() <= 2 * max(np.abs(x).max() for x in xs) + 1e-30
