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
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.onebit import compressed_allreduce, padded_size
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers import BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule
from hvd_quant.optimizers.oracle import OracleOptimizer

B = NumpyBackend()
FMAX = np.finfo(np.float32).max
COMPRESSORS = [("none", {}), ("fp16", {}), ("ef_sign", {}), ("marsit", {}),
               ("marsit", {"compensation": "global"}), ("marsit", {"scale": 0.01}),
               ("cascading_sign", {}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
               ("global_qsgd", {"bits": 16}), ("global_qsgd_exp", {}), ("onebit", {})]
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
        out = r.reduce(poisoned[c.rank], c, "buf", segs)
        return out, before, r.state_dict()

    for out, before, after in ThreadWorld(n).run(body):
        if name in ("none", "fp16"):  # a plain sum: the poisoned element, as Horovod's
            assert not np.isfinite(out[11]) and np.isfinite(np.delete(out, 11)).all()
        else:
            assert not np.isfinite(out).any(), (name, out)
        assert before.keys() == after.keys()
        for key in before:
            np.testing.assert_array_equal(before[key], after[key], err_msg=key)


def test_integer_lanes_never_carry_a_nan_as_a_number():
    """The integers Global-QSGD sums are zeros on a non-finite step (and the output NaN)."""
    for norm in ("max", "l2"):
        xs = inputs("normal", 3, 100)
        xs[0][5] = np.nan
        outs, _ = reduce_on("global_qsgd", {"norm": norm}, xs)
        assert np.isnan(outs[0]).all()


RULES = [("onebit_adam", lambda: OnebitAdamRule(freeze_step=3)),
         ("zero_one_adam", lambda: ZeroOneAdamRule(var_freeze_step=4, var_update_scaler=1,
                                                   local_step_scaler=2, local_step_clipper=2)),
         ("binsgdm_flat", lambda: BinSGDMRule()),
         ("binsgdm_2x2", lambda: BinSGDMRule(ranks_per_node=2))]
HP = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@pytest.mark.parametrize("label,rule", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("kind", ["normal", "zeros", "subnormal"])
def test_optimizers_on_awkward_inputs(label, rule, d, kind):
    n = 4 if label == "binsgdm_2x2" else 3
    steps = 10
    grads = [inputs(kind, n, d) for _ in range(steps)]
    hp = dict(HP, betas=(0.9,)) if label.startswith("binsgdm") else HP

    def body(c):
        opt = OracleOptimizer(rule(), np.ones(d, np.float32), c, hp)
        for s in range(steps):
            opt.step(grads[s][c.rank], 1e-2)
        return opt

    opts = ThreadWorld(n).run(body)
    for o in opts:
        assert o.x.shape == (d,) and np.isfinite(o.x).all()
        assert all(np.isfinite(v).all() for v in o.state.slots.values())
        assert o.state.skipped == 0
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
