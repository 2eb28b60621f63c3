"""The 1-bit compressed allreduce, 1-bit Adam and 0/1 Adam against DeepSpeed's rules.

hvd_quant's rules run on simulated ranks (ThreadWorld, numpy oracle and numpy + fused
kernels); tests/deepspeed_reference.py transcribes DeepSpeed's code for all ranks at once.
Gradients are dyadic (multiples of 2**-10), so fp32 sums over ranks are exact in any order
and the comparisons can be bit for bit.
"""

import numpy as np
import pytest

import deepspeed_reference as ds
from mp.optim_cases import count_collectives as counting
from hvd_quant import kernels
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.compressed_allreduce import compressed_allreduce, compressed_allreduce_bytes, padded_size, server_residual
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers import BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule
from hvd_quant.optimizers.base import non_freeze_flag
from hvd_quant.optimizers.oracle import OracleOptimizer, OracleParamGroups
from hvd_quant.optimizers.compressed_rounds import floored_variance

BACKENDS = [NumpyBackend()] + ([NumpyKernelBackend()] if kernels.enabled() else [])
BACKEND_IDS = [b.name for b in BACKENDS]
HP = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def dyadic(shape, seed):
    return (np.random.default_rng(seed).integers(-1024, 1025, shape) / 1024.0).astype(np.float32)


@pytest.mark.parametrize("n,expected", [(1, 8), (2, 16), (3, 72), (4, 32), (5, 200), (8, 64)])
def test_padding_follows_deepspeed(n, expected):
    assert padded_size(1, n) == expected == ds.padded_size(1, n)
    for d in (0, 7, 1000, 4099):
        assert padded_size(d, n) == ds.padded_size(d, n) or d == 0


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("d", [1, 7, 100, 1001])
def test_compressed_allreduce_equals_deepspeed(backend, n, d):
    steps = 4
    data = [[np.random.default_rng(100 * r + s).standard_normal(d).astype(np.float32)
             for s in range(steps)] for r in range(n)]
    total = padded_size(d, n)
    ref_w = [np.zeros(total, np.float32) for _ in range(n)]
    ref_s = [np.zeros(total // n, np.float32) for _ in range(n)]
    expected = [ds.compressed_allreduce([data[r][s] for r in range(n)], ref_w, ref_s)[0]
                for s in range(steps)]

    def body(comm):
        w, e = np.zeros(total, np.float32), np.zeros(total // n, np.float32)
        outs = []
        for s in range(steps):
            out, w, e, finite = compressed_allreduce(backend, comm, data[comm.rank][s], w, e, f"c{s}")
            assert finite
            outs.append(out)
        return outs, w, e

    world = ThreadWorld(n)
    results = world.run(body)
    for rank, (outs, w, e) in enumerate(results):
        for s in range(steps):
            np.testing.assert_array_equal(outs[s], expected[s])  # every rank, bit for bit
        np.testing.assert_array_equal(w, ref_w[rank])
        np.testing.assert_array_equal(e, ref_s[rank])
    for m in world.meters:
        assert m.bytes_sent == pytest.approx(steps * compressed_allreduce_bytes(d, n))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("counts", [[1, 0, 7, 100], [1001, 3], [16, 16, 16]])
def test_compressed_allreduce_per_tensor_equals_deepspeed_per_tensor(backend, n, counts):
    """``counts``: one set of collectives, the numbers of DeepSpeed's ``step()`` compressing
    every tensor on its own (own scales, own error buffers, concatenated in tensor order)."""
    steps, d = 3, sum(counts)
    data = [[np.random.default_rng(100 * r + s).standard_normal(d).astype(np.float32)
             for s in range(steps)] for r in range(n)]
    bounds = np.cumsum([0] + counts)
    ref_w = [[np.zeros(padded_size(c, n), np.float32) for _ in range(n)] for c in counts]
    ref_s = [[np.zeros(padded_size(c, n) // n, np.float32) for _ in range(n)] for c in counts]
    expected = [np.concatenate([
        ds.compressed_allreduce([data[r][s][bounds[i]:bounds[i + 1]] for r in range(n)],
                                ref_w[i], ref_s[i])[0] for i in range(len(counts))])
        for s in range(steps)]
    total = padded_size(counts, n)
    assert total == sum(padded_size(c, n) for c in counts)

    def body(comm):
        w, e = np.zeros(total, np.float32), np.zeros(total // n, np.float32)
        outs = []
        for s in range(steps):
            out, w, e, finite = compressed_allreduce(backend, comm, data[comm.rank][s], w, e,
                                                     f"c{s}", counts=counts)
            assert finite
            outs.append(out)
        return outs, w, e

    world = ThreadWorld(n)
    for rank, (outs, w, e) in enumerate(world.run(body)):
        for s in range(steps):
            np.testing.assert_array_equal(outs[s], expected[s])
        np.testing.assert_array_equal(w, np.concatenate([ref_w[i][rank] for i in range(len(counts))]))
        np.testing.assert_array_equal(e, np.concatenate([ref_s[i][rank] for i in range(len(counts))]))
    # 3 collectives per step however many tensors: 2 scale gathers, 1 alltoall, 1 gather.
    for m in world.meters:
        assert m.bytes_sent == pytest.approx(steps * compressed_allreduce_bytes(counts, n))
    assert compressed_allreduce_bytes(counts, n) == pytest.approx(
        sum(compressed_allreduce_bytes(c, n) for c in counts))


def test_compressed_allreduce_refuses_sizes_that_do_not_add_up():
    def body(comm):
        compressed_allreduce(NumpyBackend(), comm, np.ones(10, np.float32), np.zeros(32, np.float32),
                             np.zeros(16, np.float32), "c", counts=[4, 5])

    with pytest.raises(ValueError, match="do not add up"):
        ThreadWorld(2).run(body)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_compressed_allreduce_non_finite_leaves_errors_untouched(bad):
    n, d = 3, 50
    total = padded_size(d, n)
    w0 = [np.random.default_rng(r).standard_normal(total).astype(np.float32) for r in range(n)]
    e0 = [np.random.default_rng(9 + r).standard_normal(total // n).astype(np.float32) for r in range(n)]

    def body(comm):
        x = np.ones(d, np.float32)
        if comm.rank == 1:
            x[17] = bad
        return compressed_allreduce(NumpyBackend(), comm, x, w0[comm.rank].copy(),
                                    e0[comm.rank].copy(), "c")

    for rank, (out, w, e, finite) in enumerate(ThreadWorld(n).run(body)):
        assert not finite and np.isnan(out).all()
        np.testing.assert_array_equal(w, w0[rank])
        np.testing.assert_array_equal(e, e0[rank])


def run_rule(rule_factory, n, grads, lrs, hp=HP, backend=None, mask=None, x0=None, counts=None,
             in_place=False):
    """Each rank's OracleOptimizer over the steps; returns the per-rank optimizers."""
    d = grads[0][0].size
    x0 = dyadic(d, 7) if x0 is None else x0

    def body(comm):
        opt = OracleOptimizer(rule_factory(), x0, comm, hp, backend=backend, mask=mask, counts=counts,
                              in_place=in_place)
        for s, lr in enumerate(lrs):
            opt.step(grads[comm.rank][s], lr)
        return opt

    return ThreadWorld(n).run(body), x0


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("wd,masked", [(0.0, False), (0.01, True)])
def test_onebit_adam_equals_deepspeed(backend, n, wd, masked):
    d, steps, freeze = 300, 12, 5
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    mask = (np.arange(d) % 7 != 0).astype(np.float32) if masked else None
    hp = dict(HP, weight_decay=wd)
    opts, x0 = run_rule(lambda: OnebitAdamRule(freeze_step=freeze, bias_correction=False, variance_floor=0), n, grads,
                        [1e-2] * steps, hp, backend, mask)
    ref = ds.OnebitAdam([x0] * n, 1e-2, freeze, weight_decay=wd, mask=mask)
    for s in range(steps):
        ref.step([grads[r][s] for r in range(n)])
    for rank, opt in enumerate(opts):
        np.testing.assert_array_equal(opt.x, ref.x[rank])
        np.testing.assert_array_equal(opt.state.slots["exp_avg"], ref.state[rank]["exp_avg"])
        np.testing.assert_array_equal(opt.state.slots["exp_avg_sq"], ref.state[rank]["exp_avg_sq"])
        np.testing.assert_array_equal(opt.state.slots["worker_error"], ref.state[rank]["worker_error"])
        assert opt.state.kinds == ref.kinds
    assert opts[0].state.kinds == ["init"] + ["full"] * (freeze - 1) + ["onebit"] * (steps - freeze)
    for a in opts[1:]:
        np.testing.assert_array_equal(a.x, opts[0].x)  # ranks agree after the warm-up too


def deepspeed_slot(slots, key, counts, n):
    """Slot ``key`` in DeepSpeed's form: the rules keep the server's compensated values and
    their scales, whose residual is DeepSpeed's server error."""
    if key != "server_error":
        return slots[key]
    return server_residual(NumpyBackend(), slots["server_error"], slots["server_scale"], counts, n)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("wd,masked", [(0.0, False), (0.01, True)])
def test_zero_one_adam_equals_deepspeed(backend, n, wd, masked):
    d, steps = 200, 40
    options = dict(var_freeze_step=14, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    lrs = [1e-2 * (1.0 - s / (2 * steps)) for s in range(steps)]  # a scheduler: lr changes
    mask = (np.arange(d) % 5 != 0).astype(np.float32) if masked else None
    hp = dict(HP, weight_decay=wd)
    opts, x0 = run_rule(lambda: ZeroOneAdamRule(bias_correction=False, variance_floor=0, **options), n, grads, lrs, hp,
                        backend, mask)
    ref = ds.ZeroOneAdam([x0] * n, lrs[0], weight_decay=wd, mask=mask, **options)
    for s in range(steps):
        ref.step([grads[r][s] for r in range(n)], lrs[s])
    for rank, opt in enumerate(opts):
        st, rs = opt.state, ref.state[rank]
        np.testing.assert_array_equal(opt.x, ref.x[rank])
        for key in ("exp_avg", "exp_avg_sq", "momentum_accumulator", "worker_error", "server_error"):
            np.testing.assert_array_equal(deepspeed_slot(st.slots, key, [d], n), rs[key], err_msg=key)
        for key in ("step", "var_interval", "var_counter", "local_step_interval", "local_step_counter"):
            assert st.scalars[key] == rs[key], key
        assert st.scalars["lrs"] == pytest.approx(rs["lrs"], rel=1e-12)
        assert st.kinds == ref.kinds
    kinds = opts[0].state.kinds
    # The schedule as DeepSpeed defines it: full rounds at gaps 1, 1, 2, 2, 4, 4 ... until
    # var_freeze_step; then local steps with syncs every 1, 2, 4 (clipped) steps.
    assert kinds[:15] == ["init", "full", "full", "full", "onebit", "full", "onebit", "full",
                          "onebit", "onebit", "onebit", "full", "onebit", "onebit", "onebit"]
    assert "local" in kinds[15:] and kinds.count("onebit") > 8
    for a in opts[1:]:
        assert not np.array_equal(a.x, opts[0].x) or kinds[-1] == "onebit"  # local steps differ


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_per_tensor_scales_equal_deepspeed_per_tensor(backend, n, which):
    """A group of three tensors with ``scales="tensor"`` steps exactly as DeepSpeed's
    ``step()`` does on the three tensors one by one; ``"group"`` as on their concatenation."""
    counts, steps = [40, 3, 157], 30
    d = sum(counts)
    bounds = np.cumsum([0] + counts)
    options = (dict(freeze_step=5) if which == "onebit_adam" else
               dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4))
    Rule, Ref = ((OnebitAdamRule, ds.OnebitAdam) if which == "onebit_adam" else (ZeroOneAdamRule, ds.ZeroOneAdam))
    # Tensors of very different magnitudes, as a LayerNorm's and an embedding's gradients.
    magnitude = np.repeat([1.0, 2.0 ** -8, 2.0 ** 4], counts).astype(np.float32)
    grads = [[dyadic(d, 1000 * r + s) * magnitude for s in range(steps)] for r in range(n)]
    lrs = [1e-2] * steps
    x0 = dyadic(d, 7)

    def reference(parts):
        out = []
        for a, b in parts:
            ref = Ref([x0[a:b]] * n, lrs[0], **options)
            for s in range(steps):
                ref.step([grads[r][s][a:b] for r in range(n)])
            out.append(ref)
        return [np.concatenate([ref.x[r] for ref in out]) for r in range(n)]

    per_tensor = reference(list(zip(bounds[:-1], bounds[1:])))
    flat = reference([(0, d)])
    for scales, expected in (("tensor", per_tensor), ("group", flat)):
        opts, _ = run_rule(lambda: Rule(scales=scales, bias_correction=False, variance_floor=0, **options), n, grads, lrs,
                           backend=backend,
                           x0=x0, counts=counts)
        for rank, opt in enumerate(opts):
            np.testing.assert_array_equal(opt.x, expected[rank], err_msg=scales)
        rule = Rule(scales=scales, **options)
        assert opts[0].state.bytes_sent == pytest.approx(
            sum(rule.wire_bytes(k, counts, n) for k in opts[0].state.kinds))
    assert not np.array_equal(per_tensor[0], flat[0])


def test_zero_one_adam_one_rank_is_local_adam_with_the_schedule():
    d, steps = 64, 30
    options = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
    grads = [[dyadic(d, s) for s in range(steps)]]
    opts, x0 = run_rule(lambda: ZeroOneAdamRule(bias_correction=False, variance_floor=0, **options), 1, grads, [1e-2] * steps)
    ref = ds.ZeroOneAdam([x0], 1e-2, one_rank_updates_momentum=True, **options)
    for s in range(steps):
        ref.step([grads[0][s]])
    np.testing.assert_array_equal(opts[0].x, ref.x[0])
    assert set(opts[0].state.kinds) == {"init", "full", "local"}
    assert opts[0].state.bytes_sent == 0.0


def test_onebit_adam_one_rank_sends_nothing():
    grads = [[dyadic(32, s) for s in range(8)]]
    opts, x0 = run_rule(lambda: OnebitAdamRule(freeze_step=3, bias_correction=False, variance_floor=0), 1, grads, [1e-2] * 8)
    ref = ds.OnebitAdam([x0], 1e-2, 3)
    for s in range(8):
        ref.step([grads[0][s]])
    np.testing.assert_array_equal(opts[0].x, ref.x[0])
    assert opts[0].state.bytes_sent == 0.0


def test_bytes_and_rounds_follow_the_schedule():
    n, d, steps = 3, 1000, 30
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    rule = ZeroOneAdamRule(var_freeze_step=8, var_update_scaler=2, local_step_scaler=4, local_step_clipper=8)
    opts, _ = run_rule(lambda: ZeroOneAdamRule(**rule.options()), n, grads, [1e-2] * steps)
    kinds = opts[0].state.kinds
    expected = sum(rule.wire_bytes(k, d, n) for k in kinds)
    assert opts[0].state.bytes_sent == pytest.approx(expected)
    full = rule.wire_bytes("full", d, n)
    assert rule.wire_bytes("onebit", d, n) < full / 20  # ~1/32 of fp32
    assert rule.wire_bytes("local", d, n) == 0


@pytest.mark.parametrize("rule_factory,where,n", [
    (lambda: OnebitAdamRule(freeze_step=4), 2, 3),          # a warm-up (fp32) step
    (lambda: OnebitAdamRule(freeze_step=4), 6, 3),          # a compressed step
    (lambda: ZeroOneAdamRule(var_freeze_step=6, var_update_scaler=1), 2, 3),  # a full round
    (lambda: ZeroOneAdamRule(var_freeze_step=6, var_update_scaler=1), 3, 3),  # a 1-bit round
    (lambda: ZeroOneAdamRule(var_freeze_step=3, local_step_scaler=100), 6, 3),  # a sync (interval 1)
    (lambda: BinSGDMRule(), 3, 3),                           # the flat 1-bit allgather
    (lambda: BinSGDMRule(ranks_per_node=2), 3, 4),           # hierarchical, 2 nodes x 2
], ids=["onebit-warmup", "onebit-compressed", "zero_one-full", "zero_one-onebit", "zero_one-sync",
        "binsgdm-flat", "binsgdm-2x2"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_step_leaves_no_trace(rule_factory, where, n, bad):
    """One rank, one element: every rank skips the step, state and parameters untouched
    (counters and BinSGDM's random-stream position included), and the run then continues
    exactly like a run without that step."""
    d, steps = 40, 10
    grads = [[dyadic(d, 100 * r + s) for s in range(steps)] for r in range(n)]
    bad_grads = [list(g) for g in grads]
    poisoned = grads[1][where].copy()
    poisoned[5] = bad
    bad_grads[1].insert(where, poisoned)  # an extra, poisoned step on rank 1
    for r in range(n):
        if r != 1:
            bad_grads[r].insert(where, grads[r][where])
    lrs = [1e-2] * steps
    clean, _ = run_rule(rule_factory, n, grads, lrs)
    skipped, _ = run_rule(rule_factory, n, bad_grads, lrs + [1e-2])
    for a, b in zip(clean, skipped):
        np.testing.assert_array_equal(a.x, b.x)
        assert b.state.skipped == 1
        assert a.state.scalars == b.state.scalars
        for key, value in a.state.slots.items():
            np.testing.assert_array_equal(value, b.state.slots[key], err_msg=key)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_zero_one_adam_non_finite_local_step_is_skipped_by_that_rank_only(bad):
    """A Phase-B local step has no collective, so only the rank that sees the bad gradient
    knows: that rank keeps its parameters, moments, accumulator and error buffers; its
    step and schedule counters and the learning-rate sum (Gamma) advance as on every
    rank, so all ranks still sync on the same step; the other ranks step as usual. The
    next sync is finite and leaves every rank with the same momentum and counters."""
    n, d, steps, where = 3, 40, 9, 6  # step 6 is local, step 7 a sync (schedule below)
    make = lambda: ZeroOneAdamRule(var_freeze_step=3, var_update_scaler=1,  # noqa: E731
                                   local_step_scaler=2, local_step_clipper=4)
    grads = [[dyadic(d, 100 * r + s) for s in range(steps)] for r in range(n)]
    lrs = [1e-2] * steps

    def body(comm):
        opt = OracleOptimizer(make(), dyadic(d, 7), comm, HP)
        history = []
        for s, lr in enumerate(lrs):
            g = grads[comm.rank][s].copy()
            if s == where and comm.rank == 1:
                g[5] = bad
            before = (opt.x.copy(), {k: v.copy() for k, v in opt.state.slots.items()}, dict(opt.state.scalars))
            opt.step(g, lr)
            history.append((before, opt.x.copy(), {k: v.copy() for k, v in opt.state.slots.items()},
                            dict(opt.state.scalars), opt.state.skipped))
        return opt, history

    clean, _ = run_rule(make, n, grads, lrs)
    assert clean[0].state.kinds[where:where + 2] == ["local", "onebit"]  # the schedule
    ranks = ThreadWorld(n).run(body)
    for rank, (opt, history) in enumerate(ranks):
        (x0, slots0, scalars0), x, slots, scalars, skipped = history[where]
        if rank == 1:
            assert skipped == 1
            np.testing.assert_array_equal(x, x0)
            for key in slots0:
                np.testing.assert_array_equal(slots[key], slots0[key], err_msg=key)
        else:
            assert skipped == 0 and not np.array_equal(x, x0)
        # Counters and Gamma advance everywhere, as in the run without a bad gradient.
        assert scalars == ranks[0][1][where][3]
        assert scalars["step"] == scalars0["step"] + 1 and scalars["lrs"] == scalars0["lrs"] + lrs[where]
        assert opt.state.kinds == clean[0].state.kinds  # every rank synced on the same steps
    # Right after the sync: finite everywhere, the same momentum and counters on every
    # rank (the sync divides the ranks' average by the same Gamma everywhere).
    synced = [history[where + 1] for _, history in ranks]
    for _, x, slots, scalars, _ in synced:
        assert np.isfinite(x).all() and scalars["lrs"] == 0.0
        np.testing.assert_array_equal(slots["exp_avg"], synced[0][2]["exp_avg"])
        assert scalars == synced[0][3]


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("bias_correction", [False, True])
def test_zero_one_adam_sync_after_zero_learning_rates_keeps_the_momentum(backend, bias_correction):
    """A sync after local steps whose learning rates were all 0 (Γ = 0: an lr schedule
    that starts or ends at 0 past var_freeze_step). DeepSpeed re-estimates the momentum as
    -(w / Γ), and w holds the error feedback of earlier syncs, so its momentum becomes
    ±inf or NaN there, and every later step of ours was skipped as non-finite. The
    momentum keeps its value instead; the parameters are DeepSpeed's, and training goes on."""
    n, d, steps, zero = 2, 64, 12, 6  # freeze after step 4; step 7 (index 6) syncs at lr 0
    options = dict(var_freeze_step=3, var_update_scaler=1)
    if not bias_correction:  # DeepSpeed's rule: compared with its code below
        options["variance_floor"] = 0
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    lrs = [1e-2] * zero + [0.0] + [1e-2] * (steps - zero - 1)
    before, _ = run_rule(lambda: ZeroOneAdamRule(bias_correction=bias_correction, **options), n, grads,
                         lrs[:zero], backend=backend)
    at, _ = run_rule(lambda: ZeroOneAdamRule(bias_correction=bias_correction, **options), n, grads,
                     lrs[:zero + 1], backend=backend)
    after, _ = run_rule(lambda: ZeroOneAdamRule(bias_correction=bias_correction, **options), n, grads, lrs,
                        backend=backend)
    assert at[0].state.kinds[-1] == "onebit" and at[0].state.scalars["frozen"] == 1
    for b, a in zip(before, at):
        np.testing.assert_array_equal(a.state.slots["exp_avg"], b.state.slots["exp_avg"])
        assert np.isfinite(a.x).all() and a.state.scalars["lrs"] == 0.0
    for a, b in zip(after, at):
        assert np.isfinite(a.x).all() and np.isfinite(a.state.slots["exp_avg"]).all()
        assert not np.array_equal(a.x, b.x)  # the steps after it were kept
    if not bias_correction:  # DeepSpeed's parameters at the zero-lr sync; its momentum is not finite
        ref = ds.ZeroOneAdam([dyadic(d, 7)] * n, lrs[0], var_freeze_step=3, var_update_scaler=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            for s in range(zero + 1):
                ref.step([grads[r][s] for r in range(n)], lrs[s])
        for rank, a in enumerate(at):
            np.testing.assert_array_equal(a.x, ref.x[rank])
            assert not np.isfinite(ref.state[rank]["exp_avg"]).all()


def test_zero_one_adam_exact_sync_leaves_ranks_identical():
    """DeepSpeed's x - u agrees across ranks only to rounding; exact_sync bit for bit, and
    otherwise the same trajectory."""
    n, d, steps = 3, 300, 30
    options = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=100, local_step_clipper=4)
    grads = [[np.random.default_rng(100 * r + s).standard_normal(d).astype(np.float32) for s in range(steps)]
             for r in range(n)]
    lrs = [1e-2] * steps
    plain, _ = run_rule(lambda: ZeroOneAdamRule(**options), n, grads, lrs)
    exact, _ = run_rule(lambda: ZeroOneAdamRule(exact_sync=True, **options), n, grads, lrs)
    assert exact[0].state.kinds[-1] == "onebit"  # the last step is a sync (interval 1)
    for opt in exact[1:]:
        np.testing.assert_array_equal(opt.x, exact[0].x)
    assert any(not np.array_equal(o.x, plain[0].x) for o in plain[1:])  # DeepSpeed's rounding
    for a, b in zip(plain, exact):
        np.testing.assert_allclose(a.x, b.x, rtol=1e-4, atol=1e-5)


# --- 0/1 Adam's final sync (ours), param groups with their own learning rates ------------------
FINAL_OPTIONS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("exact", [False, True])
def test_zero_one_adam_final_sync_is_the_sync_branch_on_the_accumulator(backend, n, exact):
    """After local steps, ``final_sync`` is DeepSpeed's sync block (zoadam.py) run on the
    current accumulator and Γ, checked against the transcription's compressed allreduce:
    back to the last sync's parameters (``x - u``, or the stored ones with exact_sync),
    plus the averaged ``u * (sqrt(v) + eps)`` over ``sqrt(v) + eps``; momentum ``-(w / Γ)``;
    ``u`` and Γ zeroed, counters untouched. With exact_sync the ranks end bit-identical.
    A second call, and a call in Phase A, do nothing and send nothing."""
    d, steps = 150, 22  # 22 steps with FINAL_OPTIONS end on a local step (asserted)
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    lrs = [1e-2 * (1.0 - s / 50) for s in range(steps)]
    mask = (np.arange(d) % 9 != 0).astype(np.float32)
    hp = dict(HP, weight_decay=0.01)

    def body(comm):
        opt = OracleOptimizer(ZeroOneAdamRule(exact_sync=exact, **FINAL_OPTIONS), dyadic(d, 7), comm, hp,
                              backend=backend, mask=mask)
        early = None
        for s, lr in enumerate(lrs):
            opt.step(grads[comm.rank][s], lr)
            if s == 3:  # Phase A: nothing to synchronise
                x, sent = opt.x.copy(), opt.state.bytes_sent
                early = (opt.final_sync(), np.array_equal(opt.x, x), opt.state.bytes_sent == sent)
        before = ({k: v.copy() for k, v in opt.state.slots.items()}, dict(opt.state.scalars), opt.x.copy(),
                  opt.state.bytes_sent)
        synced = opt.final_sync()
        after = (opt.x.copy(), {k: v.copy() for k, v in opt.state.slots.items()}, dict(opt.state.scalars),
                 opt.state.bytes_sent)
        again = opt.final_sync()
        return early, before, synced, after, again, opt

    results = ThreadWorld(n).run(body)
    kinds = results[0][5].state.kinds
    assert kinds[-1] == "local" and kinds[-2] == "local", kinds
    slots = [r[1][0] for r in results]
    w = [s["momentum_accumulator"] * (np.sqrt(s["exp_avg_sq"]) + np.float32(HP["eps"])) for s in slots]
    errors_w = [s["worker_error"].copy() for s in slots]
    errors_s = [deepspeed_slot(s, "server_error", [d], n).copy() for s in slots]
    avg = ds.compressed_allreduce(w, errors_w, errors_s)
    gamma = results[0][1][1]["lrs"]
    phase_b = [i for i, k in enumerate(kinds) if i > FINAL_OPTIONS["var_freeze_step"]]
    last_sync = max(i for i in phase_b if kinds[i] == "onebit")
    assert gamma == sum(lrs[last_sync + 1:])  # Γ: the learning rates of the local steps since
    for rank, (early, (st, scalars, x, sent), synced, (x1, st1, scalars1, sent1), again, opt) in enumerate(results):
        assert early == (False, True, True)
        assert synced and not again
        wbar = avg[rank] * mask  # exp_avg_mask, as in a sync
        base = st["synced_params"] if exact else x - st["momentum_accumulator"]
        denom = np.sqrt(st["exp_avg_sq"]) + np.float32(HP["eps"])
        np.testing.assert_array_equal(x1, base + wbar / denom)
        np.testing.assert_array_equal(st1["exp_avg"], -(wbar / np.float32(gamma)))
        np.testing.assert_array_equal(st1["momentum_accumulator"], np.zeros(d, np.float32))
        np.testing.assert_array_equal(st1["worker_error"], errors_w[rank])
        np.testing.assert_array_equal(deepspeed_slot(st1, "server_error", [d], n), errors_s[rank])
        np.testing.assert_array_equal(st1["exp_avg_sq"], st["exp_avg_sq"])
        assert scalars1 == dict(scalars, lrs=0.0)
        assert sent1 - sent == pytest.approx(ZeroOneAdamRule().wire_bytes("onebit", d, n))
        np.testing.assert_array_equal(opt.x, x1)  # the second call changed nothing
        assert opt.state.bytes_sent == sent1
    xs = [r[3][0] for r in results]
    if exact:
        for x in xs[1:]:
            np.testing.assert_array_equal(x, xs[0])
    else:
        for x in xs[1:]:
            np.testing.assert_allclose(x, xs[0], rtol=1e-6, atol=1e-7)
    assert not all(np.array_equal(r[1][2], results[0][1][2]) for r in results[1:])  # differed before


def test_zero_one_adam_training_goes_on_after_a_final_sync():
    """final_sync leaves the counters alone: the schedule after it is the one without it,
    and the next sync covers only the steps taken after it."""
    n, d, steps = 2, 64, 30
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]

    def body(comm, at):
        opt = OracleOptimizer(ZeroOneAdamRule(exact_sync=True, **FINAL_OPTIONS), dyadic(d, 7), comm, HP)
        gammas = []
        for s in range(steps):
            opt.step(grads[comm.rank][s], 1e-2)
            if s == at:
                opt.final_sync()
            gammas.append(opt.state.scalars["lrs"])
        opt.final_sync()  # the run ends with one model
        return opt, gammas

    plain = ThreadWorld(n).run(lambda comm: body(comm, None))
    synced = ThreadWorld(n).run(lambda comm: body(comm, 17))
    assert plain[0][0].state.kinds == synced[0][0].state.kinds
    assert plain[0][0].state.kinds[17] == "local" and plain[0][1][17] > 0
    assert synced[0][1][17] == 0.0 and synced[0][1][18] == 1e-2  # Γ restarted at the final sync
    np.testing.assert_array_equal(synced[0][0].x, synced[1][0].x)
    assert not np.array_equal(synced[0][0].x, plain[0][0].x)


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_two_param_groups_follow_their_own_lr_schedules(backend, n, which):
    """Two groups with different base learning rates under one schedule factor (as
    ``torch.optim.lr_scheduler.LambdaLR`` computes them), stepped together as the torch
    optimizer steps them (one verdict per step; the smaller group waits for it in buffers
    of its own): each equals DeepSpeed's transcription of its own group, and 0/1
    Adam's Γ follows its group's learning rates step by step (0 after each sync, the sum
    of the learning rates since, in float64)."""
    counts, steps = [(120, 17), (33,)], 30
    factor = [1.0 - s / (2 * steps) if s >= 3 else (s + 1) / 4 for s in range(steps)]  # warm-up, decay
    bases = [1e-2, 3e-3]
    lrs = [[b * f for f in factor] for b in bases]
    options = (dict(freeze_step=6) if which == "onebit_adam" else FINAL_OPTIONS)
    Rule, Ref = ((OnebitAdamRule, ds.OnebitAdam) if which == "onebit_adam" else (ZeroOneAdamRule, ds.ZeroOneAdam))
    sizes = [sum(c) for c in counts]
    grads = [[[dyadic(size, 1000 * r + 100 * gi + s) for s in range(steps)] for gi, size in enumerate(sizes)]
             for r in range(n)]
    x0 = [dyadic(size, 7 + gi) for gi, size in enumerate(sizes)]

    def body(comm):
        opt = OracleParamGroups(Rule(scales="group", bias_correction=False, variance_floor=0, **options), x0, comm, [HP, HP],
                                backend=backend,
                                counts=[list(c) for c in counts])
        gammas = [[], []]
        for s in range(steps):
            opt.step([grads[comm.rank][gi][s] for gi in range(2)], [lrs[gi][s] for gi in range(2)])
            for gi, group in enumerate(opt.groups):
                gammas[gi].append(group.state.scalars.get("lrs"))
        return opt.groups, gammas

    results = ThreadWorld(n).run(body)
    for gi in range(2):
        ref = Ref([x0[gi]] * n, lrs[gi][0], **options)
        ref_gammas = []
        for s in range(steps):
            if which == "onebit_adam":
                ref.lr = lrs[gi][s]
                ref.step([grads[r][gi][s] for r in range(n)])
            else:
                ref.step([grads[r][gi][s] for r in range(n)], lrs[gi][s])
                ref_gammas.append(ref.state[0]["lrs"])
        for rank, (opts, gammas) in enumerate(results):
            np.testing.assert_array_equal(opts[gi].x, ref.x[rank], err_msg=f"group {gi}")
            assert opts[gi].state.kinds == ref.kinds
            if which == "zero_one_adam":
                assert gammas[gi] == ref_gammas  # exact: the same float64 sums
                kinds, expected, total = ref.kinds, [], 0.0
                for s in range(steps):
                    in_phase_b = s > options["var_freeze_step"]
                    total = 0.0 if not in_phase_b or kinds[s] == "onebit" else total + lrs[gi][s]
                    expected.append(total)
                assert gammas[gi] == expected
                assert "local" in kinds and max(gammas[gi]) > 0
    if which == "zero_one_adam":
        g0, g1 = results[0][1]
        assert [a / b for a, b in zip(g0, g1) if b] == pytest.approx([bases[0] / bases[1]] * sum(map(bool, g1)))


# --- One verdict per step for all param groups ---------------------------------------------------
# Sizes differ so that groups do not run in index order: the largest runs last (in place when
# the others kept the step), the others wait for the verdict in buffers of their own.
GROUP_COUNTS = {2: [[40, 3], [17]], 3: [[40, 3], [17], [90]]}
GROUP_BASE_LRS = [1e-2, 3e-3, 5e-3]
SKIP_CASES = {  # rule, 0-based step at which the bad gradient comes, ranks
    "onebit-warmup": (lambda: OnebitAdamRule(freeze_step=4), 2, 3),
    "onebit-compressed": (lambda: OnebitAdamRule(freeze_step=4), 6, 3),
    "zero_one-full": (lambda: ZeroOneAdamRule(var_freeze_step=6, var_update_scaler=1), 2, 3),
    "zero_one-onebit": (lambda: ZeroOneAdamRule(var_freeze_step=6, var_update_scaler=1), 3, 3),
    "zero_one-sync": (lambda: ZeroOneAdamRule(var_freeze_step=3, local_step_scaler=100), 6, 3),
    "binsgdm": (lambda: BinSGDMRule(), 3, 3),
}
GROUP_POSITIONS = [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]  # (groups, the group with the bad value)
GROUP_POSITION_IDS = [f"{g}groups-bad{b}" for g, b in GROUP_POSITIONS]
# The oracle as is, and run like the torch optimizer (kept steps written in place by the
# fused kernels, temporaries in kept buffers): the paths a shared verdict must hold back.
GROUP_MODES = [(b, False) for b in BACKENDS] + (
    [(NumpyKernelBackend(), True)] if kernels.enabled() else [])
GROUP_MODE_IDS = BACKEND_IDS + (["kernels-in-place"] if kernels.enabled() else [])


def group_inputs(groups, n, steps):
    """Per rank and step, each group's dyadic gradient; per step, each group's learning rate."""
    sizes = [sum(c) for c in GROUP_COUNTS[groups]]
    grads = [[[dyadic(size, 1000 * r + 100 * g + s) for g, size in enumerate(sizes)] for s in range(steps)]
             for r in range(n)]
    lrs = [[GROUP_BASE_LRS[g] * (1.0 - s / 40) for g in range(groups)] for s in range(steps)]
    return grads, lrs


def run_groups(rule_factory, n, grads, lrs, backend=None, hps=None, count_collectives=False, in_place=False):
    """Every rank's OracleParamGroups over ``grads[r][s][g]`` with ``lrs[s][g]``. Returns per
    rank ``(opt, skipped, calls)``: whether each step was skipped, and (when asked) how
    many collectives each step issued."""
    groups = len(lrs[0])
    counts = GROUP_COUNTS[groups]
    x0 = [dyadic(sum(c), 7 + g) for g, c in enumerate(counts)]
    hps = hps or [HP] * groups

    def body(comm):
        calls = counting(comm) if count_collectives else [0]
        opt = OracleParamGroups(rule_factory(), x0, comm, hps, backend=backend, counts=counts,
                                in_place=in_place)
        skipped, per_step = [], []
        for s, lr in enumerate(lrs):
            before = calls[0]
            opt.step(grads[comm.rank][s], lr)
            skipped.append(opt.last_step_skipped)
            per_step.append(calls[0] - before)
        return opt, skipped, per_step

    return ThreadWorld(n).run(body)


def schedule(state):
    """A group's counters (Γ aside: it follows the group's own learning rates)."""
    return {k: v for k, v in state.scalars.items() if k != "lrs"}


@pytest.mark.parametrize("backend,in_place", GROUP_MODES, ids=GROUP_MODE_IDS)
@pytest.mark.parametrize("groups,bad_group", GROUP_POSITIONS, ids=GROUP_POSITION_IDS)
@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_a_non_finite_group_skips_the_step_for_every_group(backend, in_place, groups, bad_group, case):
    """inf in one group of one rank: every group on every rank skips the step (parameters,
    slots, counters untouched; the smaller groups' 1-bit error buffers too, which the
    fused kernels would update in place), every rank reports it (``last_step_skipped``,
    one ``skipped`` per group), the groups' counters stay equal, and the run then
    continues exactly like a run without that step."""
    rule_factory, where, n = SKIP_CASES[case]
    steps = 10
    grads, lrs = group_inputs(groups, n, steps)
    poisoned = [list(g) for g in grads]
    for r in range(n):
        extra = [g.copy() for g in grads[r][where]]
        if r == 1:
            extra[bad_group][5] = np.inf
        poisoned[r].insert(where, extra)  # an extra step, bad on rank 1 in one group
    clean = run_groups(rule_factory, n, grads, lrs, backend, in_place=in_place)
    skipped = run_groups(rule_factory, n, poisoned, lrs[:where] + [lrs[where]] + lrs[where:], backend,
                         in_place=in_place)
    for (a, _, _), (b, flags, _) in zip(clean, skipped):
        assert flags == [s == where for s in range(steps + 1)]
        assert b.skipped_steps == 1
        for ga, gb in zip(a.groups, b.groups):
            np.testing.assert_array_equal(ga.x, gb.x)
            assert gb.state.skipped == 1
            assert ga.state.scalars == gb.state.scalars
            for key, value in ga.state.slots.items():
                np.testing.assert_array_equal(value, gb.state.slots[key], err_msg=key)
        assert all(schedule(g.state) == schedule(b.groups[0].state) for g in b.groups)
        assert all(g.state.kinds == b.groups[0].state.kinds for g in b.groups)


@pytest.mark.parametrize("backend,in_place", GROUP_MODES, ids=GROUP_MODE_IDS)
@pytest.mark.parametrize("groups,bad_group", GROUP_POSITIONS, ids=GROUP_POSITION_IDS)
def test_zero_one_adam_local_step_skip_covers_every_group_of_that_rank(backend, in_place, groups, bad_group):
    """A Phase-B local step has no collective: the rank whose gradient (in one group) is
    not finite skips the step in every group (parameters, moments, accumulators and
    error buffers stay), the other ranks step; every group's counters and Γ advance on
    every rank alike, and the next sync is finite with the same momentum on every rank."""
    n, steps, where = 3, 9, 6  # step 6 is local, step 7 a sync
    make = lambda: ZeroOneAdamRule(var_freeze_step=3, var_update_scaler=1,  # noqa: E731
                                   local_step_scaler=2, local_step_clipper=4)
    grads, lrs = group_inputs(groups, n, steps)
    bad = [list(g) for g in grads]
    bad[1][where] = [g.copy() for g in grads[1][where]]
    bad[1][where][bad_group][5] = np.inf
    clean = run_groups(make, n, grads, lrs, backend, in_place=in_place)
    assert clean[0][0].groups[0].state.kinds[where:where + 2] == ["local", "onebit"]

    def body(comm):
        counts = GROUP_COUNTS[groups]
        opt = OracleParamGroups(make(), [dyadic(sum(c), 7 + g) for g, c in enumerate(counts)], comm,
                                [HP] * groups, backend=backend, counts=counts, in_place=in_place)
        history = []
        for s in range(steps):
            before = [(g.x.copy(), {k: v.copy() for k, v in g.state.slots.items()}) for g in opt.groups]
            opt.step(bad[comm.rank][s], lrs[s])
            after = [(g.x.copy(), {k: v.copy() for k, v in g.state.slots.items()}, dict(g.state.scalars))
                     for g in opt.groups]
            history.append((before, after, opt.last_step_skipped))
        return opt, history

    ranks = ThreadWorld(n).run(body)
    for rank, (opt, history) in enumerate(ranks):
        before, after, skipped = history[where]
        assert skipped == (rank == 1) and opt.skipped_steps == int(rank == 1)
        for g, ((x0, slots0), (x, slots, scalars)) in enumerate(zip(before, after)):
            assert opt.groups[g].state.skipped == int(rank == 1)
            if rank == 1:
                np.testing.assert_array_equal(x, x0)
                for key in slots0:
                    np.testing.assert_array_equal(slots[key], slots0[key], err_msg=key)
            else:
                assert not np.array_equal(x, x0)
            # Counters and Γ advance on every rank, as in the run without a bad gradient.
            assert scalars == ranks[0][1][where][1][g][2]
        assert [g.state.kinds for g in opt.groups] == [g.state.kinds for g in clean[0][0].groups]
        assert [g.state.scalars for g in opt.groups] == [g.state.scalars for g in clean[rank][0].groups]
    for g in range(groups):  # right after the sync: finite, one momentum on every rank
        synced = [history[where + 1][1][g] for _, history in ranks]
        for x, slots, scalars in synced:
            assert np.isfinite(x).all() and scalars["lrs"] == 0.0
            np.testing.assert_array_equal(slots["exp_avg"], synced[0][1]["exp_avg"])


@pytest.mark.parametrize("backend,in_place", GROUP_MODES, ids=GROUP_MODE_IDS)
@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "binsgdm"])
def test_one_verdict_for_all_groups_costs_no_collective(backend, in_place, name):
    """Three groups stepped together (one verdict) issue exactly the collectives and bytes
    of the three groups stepped one by one on their own, and compute the same bits;
    0/1 Adam's local steps issue none."""
    n, steps = 3, 24
    make = {"onebit_adam": lambda: OnebitAdamRule(freeze_step=5),
            "zero_one_adam": lambda: ZeroOneAdamRule(**FINAL_OPTIONS),
            "binsgdm": lambda: BinSGDMRule()}[name]
    hp = HP if name != "binsgdm" else dict(HP, betas=(0.9,), eps=0.0)
    grads, lrs = group_inputs(3, n, steps)
    world = ThreadWorld(n)
    together = world.run(lambda comm: _groups_body(comm, make, hp, grads, lrs, backend, in_place, False))
    meters = [m.bytes_sent for m in world.meters]
    world = ThreadWorld(n)
    alone = world.run(lambda comm: _groups_body(comm, make, hp, grads, lrs, backend, in_place, True))
    assert [m.bytes_sent for m in world.meters] == meters
    for (xs, calls, kinds), (xs1, calls1, kinds1) in zip(together, alone):
        assert calls == calls1
        assert kinds == kinds1
        for x, x1 in zip(xs, xs1):
            np.testing.assert_array_equal(x, x1)
        assert all(c == 0 for c, k in zip(calls, kinds[0]) if k == "local")
    if name == "zero_one_adam":
        assert "local" in together[0][2][0]


def _groups_body(comm, make, hp, grads, lrs, backend, in_place, one_by_one):
    """Three groups: one OracleParamGroups, or (``one_by_one``) one OracleOptimizer per
    group stepped in turn. Returns the groups' parameters, collectives per step, kinds."""
    calls = counting(comm)
    counts = GROUP_COUNTS[3]
    x0 = [dyadic(sum(c), 7 + g) for g, c in enumerate(counts)]
    if one_by_one:
        opts = [OracleOptimizer(make(), x0[g], comm, hp, backend=backend, name=f"opt.g{g}", counts=c,
                                in_place=in_place) for g, c in enumerate(counts)]
    else:
        together = OracleParamGroups(make(), x0, comm, [hp] * 3, backend=backend, counts=counts,
                                     in_place=in_place)
        opts = together.groups
    per_step = []
    for s, lr in enumerate(lrs):
        before = calls[0]
        if one_by_one:
            for g, opt in sorted(enumerate(opts), key=lambda item: item[1].x.size):  # the same order
                opt.step(grads[comm.rank][s][g], lr[g])
        else:
            together.step(grads[comm.rank][s], lr)
        per_step.append(calls[0] - before)
    return [opt.x for opt in opts], per_step, [opt.state.kinds for opt in opts]


@pytest.mark.parametrize("where", [2, 3])
def test_onebit_adam_groups_keep_one_schedule_after_a_skip(where):
    """Where per-group verdicts drifted: 2 ranks, 2 groups, freeze_step=3, inf in group 1 (rank 0)
    at the third or fourth of 5 steps. Both groups skip that step: both end at step 4,
    freeze on the same call, and the skip is reported once (a loss scaler backs off).
    Before, group 0 ended at step 5 and group 1 at step 4 (a bad warm-up step made group 1
    freeze one call after group 0), and the skip went unreported."""
    n, steps = 2, 5
    grads, lrs = group_inputs(2, n, steps)
    grads[0][where] = [g.copy() for g in grads[0][where]]
    grads[0][where][1][0] = np.inf
    for opt, skipped, _ in run_groups(lambda: OnebitAdamRule(freeze_step=3), n, grads, lrs):
        assert skipped == [s == where for s in range(steps)] and opt.skipped_steps == 1
        assert [g.state.scalars for g in opt.groups] == [{"step": 4, "initialized": 1, "frozen": 1}] * 2
        # The skipped step still sent its round: a warm-up round at the third call delays
        # the freeze by one call in both groups, a 1-bit round at the fourth does not.
        kinds = ["init", "full", "full"] + (["full", "onebit"] if where == 2 else ["onebit", "onebit"])
        assert opt.groups[0].state.kinds == opt.groups[1].state.kinds == kinds


# --- DeepSpeed's non_freeze param groups (1-bit Adam only) -----------------------------------------
@pytest.mark.parametrize("backend,in_place", GROUP_MODES, ids=GROUP_MODE_IDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_onebit_adam_non_freeze_group_equals_deepspeed(backend, in_place, n):
    """DeepSpeed's ``OnebitAdam.step`` (runtime/fp16/onebit/adam.py) for a group with
    ``non_freeze=True``: Adam with an fp32 average at every step, the initialisation step
    included (its moments take the averaged gradient; no update), the variance never
    frozen, no ``exp_avg_mask``, no compression (the error buffers stay zero)."""
    d, steps, freeze = 300, 12, 5
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    mask = (np.arange(d) % 7 != 0).astype(np.float32)  # ignored, as by DeepSpeed
    hp = dict(HP, weight_decay=0.01, non_freeze=True)
    opts, x0 = run_rule(lambda: OnebitAdamRule(freeze_step=freeze, bias_correction=False, variance_floor=0), n, grads,
                        [1e-2] * steps, hp, backend, mask, in_place=in_place)
    ref = ds.OnebitAdam([x0] * n, 1e-2, freeze, non_freeze=True, weight_decay=0.01, mask=mask)
    for s in range(steps):
        ref.step([grads[r][s] for r in range(n)])
    assert ref.kinds == ["full"] * steps
    for rank, opt in enumerate(opts):
        np.testing.assert_array_equal(opt.x, ref.x[rank])
        np.testing.assert_array_equal(opt.state.slots["exp_avg"], ref.state[rank]["exp_avg"])
        np.testing.assert_array_equal(opt.state.slots["exp_avg_sq"], ref.state[rank]["exp_avg_sq"])
        assert not opt.state.slots["worker_error"].any() and not opt.state.slots["server_error"].any()
        assert opt.state.kinds == ref.kinds
        assert opt.state.scalars == {"step": steps, "initialized": 1, "frozen": 1}
        assert opt.state.bytes_sent == pytest.approx(steps * OnebitAdamRule().wire_bytes("full", d, n))
        np.testing.assert_array_equal(opt.x, opts[0].x)


@pytest.mark.parametrize("backend,in_place", GROUP_MODES, ids=GROUP_MODE_IDS)
@pytest.mark.parametrize("n", [2, 3])
def test_onebit_adam_non_freeze_beside_a_frozen_group(backend, in_place, n):
    """Group 0 follows the freeze (1-bit momentum, frozen variance), group 1 is
    ``non_freeze`` (fp32 Adam throughout); stepped together, each equals DeepSpeed's
    transcription of its own group, and both keep one step counter."""
    steps, freeze = 14, 5
    grads, lrs = group_inputs(2, n, steps)
    hps = [HP, dict(HP, non_freeze=True)]
    results = run_groups(lambda: OnebitAdamRule(freeze_step=freeze, scales="group", bias_correction=False, variance_floor=0),
                         n, grads, lrs,
                         backend, hps, in_place=in_place)
    x0 = [dyadic(sum(c), 7 + g) for g, c in enumerate(GROUP_COUNTS[2])]
    for g, non_freeze in enumerate([False, True]):
        ref = ds.OnebitAdam([x0[g]] * n, lrs[0][g], freeze, non_freeze=non_freeze)
        for s in range(steps):
            ref.lr = lrs[s][g]
            ref.step([grads[r][s][g] for r in range(n)])
        for rank, (opt, skipped, _) in enumerate(results):
            np.testing.assert_array_equal(opt.groups[g].x, ref.x[rank], err_msg=f"group {g}")
            np.testing.assert_array_equal(opt.groups[g].state.slots["exp_avg_sq"],
                                          ref.state[rank]["exp_avg_sq"])
            assert opt.groups[g].state.kinds == ref.kinds
            assert not any(skipped)
    opt = results[0][0]
    assert opt.groups[0].state.kinds[freeze:] == ["onebit"] * (steps - freeze)
    assert opt.groups[1].state.kinds == ["full"] * steps
    assert opt.groups[0].state.scalars == opt.groups[1].state.scalars


def test_non_freeze_is_refused_where_deepspeed_has_none():
    """Only DeepSpeed's OnebitAdam reads ``non_freeze``; 0/1 Adam and BinSGDM refuse the
    flag (torch: at construction) rather than silently freezing the group."""
    for rule in (OnebitAdamRule(), ZeroOneAdamRule(), BinSGDMRule()):
        assert non_freeze_flag(rule, None) is False and non_freeze_flag(rule, False) is False
    assert non_freeze_flag(OnebitAdamRule(), True) is True
    with pytest.raises(ValueError, match="zoadam.py.*never reads"):
        non_freeze_flag(ZeroOneAdamRule(), True, "param group 1")
    with pytest.raises(ValueError, match="BinSGDM"):
        non_freeze_flag(BinSGDMRule(), True)
    with pytest.raises(ValueError, match="True or False"):
        non_freeze_flag(OnebitAdamRule(), 1)  # DeepSpeed tests ``is True``: 1 would be ignored there


# --- bias_correction (Adam's, Kingma & Ba 2015; DeepSpeed's code has none) ---------------------
def torch_adam_params(x0, grads, lr, betas=(0.9, 0.999), eps=1e-8):
    """torch.optim.Adam (no weight decay) from ``x0`` over ``grads``: the parameters after
    each step."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.from_numpy(x0.copy()))
    opt = torch.optim.Adam([p], lr=lr, betas=betas, eps=eps)
    out = []
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_bias_corrected_warm_up_is_torch_adam(backend, which):
    """With ``bias_correction=True`` (the default) the full-precision stage is Adam: at one
    rank every warm-up step equals ``torch.optim.Adam``'s on the same gradients, to float
    rounding (eps outside the square root of the corrected variance in both). Step 1 is
    DeepSpeed's initialisation step (no update), so Adam's step s is the rule's s + 1. 0/1
    Adam with a ``var_update_scaler`` past the run has a full round at every step."""
    d, steps, lr = 257, 20, 1e-2
    rule = (OnebitAdamRule(freeze_step=1000) if which == "onebit_adam" else
            ZeroOneAdamRule(var_freeze_step=1000, var_update_scaler=1000))
    assert rule.bias_correction is True
    grads = [[dyadic(d, s) * np.float32(0.01 * (s + 1)) for s in range(steps)]]
    x0 = dyadic(d, 7)

    def body(comm):
        opt = OracleOptimizer(rule, x0, comm, HP, backend=backend)
        xs = []
        for s in range(steps):
            opt.step(grads[0][s], lr)
            xs.append(opt.x.copy())
        return opt, xs

    (opt, xs), = ThreadWorld(1).run(body)
    adam = torch_adam_params(x0, grads[0][1:], lr)
    np.testing.assert_array_equal(xs[0], x0)  # the initialisation step
    for s in range(1, steps):
        # Each step moves by ~lr: a few float32 ulps of the parameters apart at most.
        np.testing.assert_allclose(xs[s], adam[s - 1], rtol=0, atol=2e-6, err_msg=f"step {s + 1}")
    assert set(opt.state.kinds) == {"init", "full"}
    # DeepSpeed's rule on the same gradients moves much further (v is far from warm).
    plain, _ = run_rule(lambda: type(rule)(**dict(rule.options(), bias_correction=False, variance_floor=0)), 1, grads,
                        [lr] * steps, x0=x0, backend=backend)
    assert np.abs(plain[0].x - x0).max() > 3 * np.abs(xs[-1] - x0).max()


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_frozen_moments_are_bias_corrected(backend, n, which):
    """Before the freeze the stored moments are the raw averages under either setting (so a
    checkpoint crosses between them); at the freeze ``bias_correction=True`` stores ``m /
    (1 - beta1**t)`` and ``v / (1 - beta2**k)``, ``k`` the variance updates so far (the
    full rounds, for 0/1 Adam: fewer than its steps) and ``t`` the momentum updates; the
    frozen variance then stays. ``False`` is DeepSpeed's rule (the tests above)."""
    d, steps = 300, 30
    if which == "onebit_adam":
        options, before = dict(freeze_step=9), 8
    else:
        options = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
        before = 12
    Rule = OnebitAdamRule if which == "onebit_adam" else ZeroOneAdamRule
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    beta1, beta2 = HP["betas"]
    runs = {}
    for correct in (False, True):
        for length in (before, before + 1, steps):
            runs[correct, length] = run_rule(lambda: Rule(bias_correction=correct, **options), n, grads,
                                             [1e-2] * length, backend=backend)[0]
    # Just before the freeze: raw moments, identical under both settings (the gradients
    # and averages do not depend on the parameters).
    for slot in ("exp_avg", "exp_avg_sq"):
        for rank in range(n):
            np.testing.assert_array_equal(runs[True, before][rank].state.slots[slot],
                                          runs[False, before][rank].state.slots[slot])
    plain, fixed = runs[False, before + 1][0], runs[True, before + 1][0]
    assert fixed.state.scalars["frozen"] == plain.state.scalars["frozen"] == 1
    kinds = plain.state.kinds
    k = kinds.count("full")
    t = len(kinds) - 1  # every step but the initialisation step updated the momentum
    assert k == Rule(bias_correction=False, variance_floor=0, **options).frozen_variance_updates()
    if which == "zero_one_adam":
        assert k < t  # the 1-bit rounds update the momentum only
    v_hat = plain.state.slots["exp_avg_sq"] / (1.0 - beta2 ** k)
    m_hat = plain.state.slots["exp_avg"] / (1.0 - beta1 ** t)
    np.testing.assert_allclose(fixed.state.slots["exp_avg_sq"], v_hat, rtol=1e-6)
    np.testing.assert_allclose(fixed.state.slots["exp_avg"], m_hat, rtol=1e-6, atol=1e-12)
    end = runs[True, steps]
    for rank in range(n):
        np.testing.assert_array_equal(end[rank].state.slots["exp_avg_sq"], fixed.state.slots["exp_avg_sq"])
    assert end[0].state.kinds == runs[False, steps][0].state.kinds  # the same schedule
    # The derived count of variance updates is what the schedule did.
    assert Rule(**options).variance_updates(NumpyBackend(), fixed.state) == k


def test_zero_one_adam_variance_count_follows_the_schedule():
    """``k = var_update_scaler * log2(var_interval) + var_counter`` counts the full rounds
    (what checkpoints of every version hold), step by step."""
    rule = ZeroOneAdamRule(var_freeze_step=60, var_update_scaler=3, bias_correction=False, variance_floor=0)
    grads = [[dyadic(16, s) for s in range(60)]]
    opts, _ = run_rule(lambda: rule, 1, grads, [1e-3] * 60)
    kinds = opts[0].state.kinds
    assert kinds.count("full") == rule.variance_updates(NumpyBackend(), opts[0].state)
    assert kinds.count("full") == ZeroOneAdamRule(var_freeze_step=58, var_update_scaler=3).frozen_variance_updates()


def test_short_warm_up_warning_for_deepspeeds_rule():
    """``bias_correction=False`` with a variance frozen far from warm is warned about, with
    its warmth, the factor on later steps and the settings that avoid it; the default and
    a long enough warm-up are silent."""
    from hvd_quant.optimizers.compressed_rounds import short_warm_up_warning
    betas = HP["betas"]
    message = short_warm_up_warning(OnebitAdamRule(freeze_step=80, bias_correction=False, variance_floor=0), betas)
    assert "7.6% warm" in message and "3.63x Adam's" in message and "bias_correction=True" in message
    assert "freeze_step" in message and "2000" in message and "diverged" in message
    message = short_warm_up_warning(ZeroOneAdamRule(var_freeze_step=80, var_update_scaler=16,
                                                    bias_correction=False, variance_floor=0), betas)
    assert "after 40 update(s)" in message and "3.9% warm" in message and "5.05x" in message
    assert "var_freeze_step" in message and "var_update_scaler" in message
    # DeepSpeed's own 0/1 Adam defaults freeze after 201 variance updates: 18% warm.
    assert "18.2% warm" in short_warm_up_warning(ZeroOneAdamRule(var_update_scaler=16, bias_correction=False, variance_floor=0),
                                                  betas)
    assert short_warm_up_warning(OnebitAdamRule(freeze_step=80), betas) is None
    assert short_warm_up_warning(ZeroOneAdamRule(var_freeze_step=80), betas) is None
    assert short_warm_up_warning(OnebitAdamRule(freeze_step=2100, bias_correction=False, variance_floor=0), betas) is None
    assert short_warm_up_warning(OnebitAdamRule(freeze_step=80, bias_correction=False, variance_floor=0), (0.9, 0.95)) is None
    assert short_warm_up_warning(ZeroOneAdamRule(var_freeze_step=2100, var_update_scaler=4000,
                                                 bias_correction=False, variance_floor=0), betas) is None


# --- variance_floor: the held variance of an element with no gradient yet (issue 51) ------------
def test_floored_variance_per_tensor():
    """``max(v, ratio * mean(v))`` with the mean per tensor; ratio 0 is ``v`` itself; a NaN stays."""
    B = NumpyBackend()
    v = np.array([0.0, 1.0, 3.0, 0.0, 100.0, 300.0, np.nan], np.float32)
    out = floored_variance(B, v[:6], [3, 3], 0.5)
    np.testing.assert_array_equal(out, np.array([2 / 3, 1.0, 3.0, 200 / 3, 100.0, 300.0], np.float32))
    assert floored_variance(B, v, [7], 0.0) is v
    assert np.isnan(floored_variance(B, v, [7], 0.5)[6])
    for bad in (-0.1, float("nan"), float("inf"), True, "0.01"):
        with pytest.raises(ValueError, match="variance_floor"):
            OnebitAdamRule(variance_floor=bad)
        with pytest.raises(ValueError, match="variance_floor"):
            ZeroOneAdamRule(variance_floor=bad)


def _unseen_row_grads(d, steps, first_seen, n=1):
    """Gradients where elements ``[0, 8)`` (an embedding row of a word not yet seen) are
    zero until step ``first_seen`` and as large as the others from then on."""
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    for r in range(n):
        for s in range(first_seen):
            grads[r][s][:8] = 0.0
    return grads


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_variance_floor_bounds_the_step_of_an_element_first_seen_after_the_freeze(backend, which):
    """Frozen at step 6; the unseen elements get their first gradient at step 9. Without
    the floor (DeepSpeed's rule) their frozen variance is 0 and they step by ``m / eps``,
    about 1e6 here; with the default floor every step is at most a few ``lr`` (Adam's own
    bound is ``(1 - beta1) / sqrt(1 - beta2)``, 3.2 ``lr``), and the elements whose variance
    is above the floor move exactly as without it."""
    d, steps, first_seen, lr = 64, 12, 8, 1e-2
    grads = _unseen_row_grads(d, steps, first_seen)
    Rule, options = ((OnebitAdamRule, dict(freeze_step=6)) if which == "onebit_adam"
                     else (ZeroOneAdamRule, dict(var_freeze_step=5, var_update_scaler=100, local_step_clipper=1)))
    (bare,), x0 = run_rule(lambda: Rule(variance_floor=0, **options), 1, grads, [lr] * steps, backend=backend)
    (floored,), _ = run_rule(lambda: Rule(**options), 1, grads, [lr] * steps, backend=backend)
    assert Rule(**options).variance_floor == 0.01
    assert np.abs(bare.x[:8] - x0[:8]).max() > 1e4  # DeepSpeed's rule: m / eps
    assert np.abs(floored.x - x0).max() < 10 * lr * steps
    v = floored.state.slots["exp_avg_sq"]
    above = np.arange(d) >= 8
    floor = 0.01 * v[above].sum(dtype=np.float64) / d  # the mean of v frozen: 0 for the unseen
    np.testing.assert_allclose(v[:8], floor, rtol=1e-5)  # the unseen elements sit on the floor
    assert (v[above] > floor).all()  # every other element is above it here, so unchanged:
    np.testing.assert_array_equal(floored.x[above], bare.x[above])


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_zero_one_adam_full_rounds_use_their_fresh_variance(backend):
    """Phase A's full rounds are Adam's steps: the floor touches only the variance a 1-bit
    round reuses, and the stored average until the freeze. With every step a full round
    (``var_update_scaler`` past the run) the floor changes nothing before the freeze."""
    d, steps = 64, 8
    grads = _unseen_row_grads(d, steps, 4, n=2)
    options = dict(var_freeze_step=100, var_update_scaler=100)
    bare, _ = run_rule(lambda: ZeroOneAdamRule(variance_floor=0, **options), 2, grads, [1e-2] * steps,
                       backend=backend)
    floored, _ = run_rule(lambda: ZeroOneAdamRule(**options), 2, grads, [1e-2] * steps, backend=backend)
    for a, b in zip(floored, bare):
        assert set(a.state.kinds) == {"init", "full"}
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.state.slots["exp_avg_sq"], b.state.slots["exp_avg_sq"])
