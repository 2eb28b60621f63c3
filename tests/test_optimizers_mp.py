"""hvd_quant's 1-bit optimizers under real Horovod (torch), against the numpy oracle.

One horovodrun job per world size runs tests/mp/optim_worker.py; every rank's final
parameters must equal the oracle's (the same rules on simulated ranks, same inputs and
seeds) bit for bit, local steps must issue no collective, checkpoints must restore
bit-identically, and bad input must fail on every rank with a clear error. The same
job covers param groups under an LR scheduler, one verdict for all param groups (with
``hq.GradScaler``), 1-bit Adam's ``non_freeze`` groups, ``exp_avg_mask`` and 0/1 Adam's
``final_sync``; the TensorFlow job (tests/mp/optim_worker_tf.py) the Keras twins. At 2
and 3 ranks the same workers run under MPI too (full tier), inside the MPI job of each
framework and rank count (tests/mp/mpi_worker.py, shared with tests/test_multiprocess.py).
"""

import sys

import numpy as np
import pytest

from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers import BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule
from hvd_quant.optimizers.oracle import OracleOptimizer, OracleParamGroups

from horovod_launch import HERE, MPI_TEST_TIMEOUT, load_rank_results, mpi_job, run_horovod, skip_gloo_twin

sys.path.insert(0, str(HERE / "mp"))
import optim_cases as cases  # noqa: E402

# Jobs run in module fixtures (up to 600 s), whose setup pytest-timeout counts against the
# first test that uses them: the limit must exceed the job's own, not pyproject's 300 s.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(660)]
WORKER = HERE / "mp" / "optim_worker.py"
# The quick tier (./scripts/test.sh) runs every optimizer in torch at 2 and 3 ranks and in
# TensorFlow at 3 (TF at 2 ranks only in the full tier: its one 2-rank branch, the fp32
# round's, is the optimizers' core, which torch's 2-rank job runs); 4 ranks as 2 nodes x 2, the 1-rank world and the MPI jobs only in the full tier,
# where an MPI job replaces the Gloo job of its framework and rank count
# (horovod_launch.skip_gloo_twin).
JOBS = [(2, None, "gloo"), (3, None, "gloo"), (4, 2, "gloo"), (1, None, "gloo"), (2, None, "mpi"), (3, None, "mpi")]
MPI = [pytest.mark.mpi, pytest.mark.timeout(MPI_TEST_TIMEOUT)]
MARKS = {(2, None, "gloo"): pytest.mark.quick, (3, None, "gloo"): pytest.mark.quick,
         (2, None, "mpi"): MPI, (3, None, "mpi"): MPI}


@pytest.fixture(scope="module", params=[pytest.param(j, marks=MARKS.get(j, ())) for j in JOBS],
                ids=[f"np{n}-k{k}" + ("-mpi" if launcher == "mpi" else "") for n, k, launcher in JOBS])
def job(request, tmp_path_factory):
    n, k, launcher = request.param
    if launcher == "mpi":
        out = mpi_job("torch", n, tmp_path_factory) / "optim"
    else:
        if k is None and n in (2, 3):
            skip_gloo_twin("torch", n)
        out = tmp_path_factory.mktemp(f"optim{n}")
        run_horovod(WORKER, n, ["torch", out] + ([k] if k else []), timeout=420)
    return {"size": n, "k": k, "ranks": load_rank_results(out, n)}


def oracle(name, n, k, drop_rank=None, mask=None, lrs=None, final_sync=False, **extra):
    """The same steps on the numpy oracle. ``mask``: exp_avg_mask; ``lrs``: the learning
    rate of each step (default cases.lr); ``final_sync``: 0/1 Adam's final sync after the
    last step; ``extra``: more rule options."""
    rules = {"onebit_adam": lambda: OnebitAdamRule(**cases.CONFIGS["onebit_adam"], **extra),
             "zero_one_adam": lambda: ZeroOneAdamRule(**cases.CONFIGS["zero_one_adam"], **extra),
             "binsgdm": lambda: BinSGDMRule(ranks_per_node=k)}
    hp = cases.HP if name != "binsgdm" else dict(cases.HP, betas=(0.9,), eps=0.0)
    lrs = lrs or [cases.lr(s) for s in range(cases.STEPS)]

    def body(comm):
        opt = OracleOptimizer(rules[name](), cases.initial_params(), comm, hp, counts=cases.COUNTS, mask=mask)
        opt.gammas = []
        for s in range(cases.STEPS):
            g = cases.grad(comm.rank, s)
            if drop_rank == comm.rank and s == 3:  # parameter p1 had no gradient
                g = g.copy()
                g[91:120] = 0.0
            opt.step(g, lrs[s])
            opt.gammas.append(opt.state.scalars.get("lrs"))
        if final_sync:
            opt.synced = opt.final_sync()
        return opt

    return ThreadWorld(n).run(body)


def group_parts(flat):
    """``flat`` (all of cases.COUNTS) cut into cases.GROUPS' flat parts."""
    bounds = np.cumsum([0] + cases.COUNTS)
    return [np.concatenate([flat[bounds[i]:bounds[i + 1]] for i in idx]) for idx in cases.GROUPS]


def oracle_groups(name, n, lr=None, steps=cases.STEPS, poison=None, non_freeze=False, **extra):
    """cases.GROUPS as two param groups, stepped together with one verdict per step as the
    torch optimizer does. ``lr(g, s)``: group ``g``'s learning rate at step ``s`` (default
    cases.group_lr); ``poison``: ``(step, group)``, inf in that group's first element on
    the last rank; ``non_freeze``: group 1 is 1-bit Adam's non_freeze group."""
    rule = {"onebit_adam": OnebitAdamRule, "zero_one_adam": ZeroOneAdamRule}[name]
    lr = lr or cases.group_lr
    hps = [cases.HP, dict(cases.HP, non_freeze=True) if non_freeze else cases.HP]

    def body(comm):
        counts = [[cases.COUNTS[i] for i in idx] for idx in cases.GROUPS]
        opt = OracleParamGroups(rule(**dict(cases.CONFIGS[name], **extra)),
                                group_parts(cases.initial_params()), comm, hps, counts=counts)
        gammas, skipped = [[], []], []
        for s in range(steps):
            grads = group_parts(cases.grad(comm.rank, s))
            if poison == (s, 1) and comm.rank == comm.size - 1:
                grads[1][0] = np.inf
            opt.step(grads, [lr(g, s) for g in range(2)])
            skipped.append(opt.last_step_skipped)
            for g, group in enumerate(opt.groups):
                gammas[g].append(group.state.scalars.get("lrs"))
        return opt.groups, gammas, skipped

    return ThreadWorld(n).run(body)


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def test_torch_rounds_are_measured_without_changing_a_bit(job):
    """Issue 54: ``opt.metrics()`` of the 1-bit optimizers, a probe every 4 rounds of a
    kind: the parameters of the unmeasured run, the measured bytes those the optimizer
    counts, the probe's figures are the same on every rank; BinSGDM's sign sums and the
    fp32 rounds are never probed."""
    for name in cases.CONFIGS:
        runs = [rank[f"metrics/{name}"] for rank in job["ranks"]]
        for rank, run in zip(job["ranks"], runs):
            assert "error" not in run, run
            m = run["metrics"]
            assert run["x"] == rank[f"train/{name}"]["x"]
            # The meter counts this rank's bytes, bytes_sent the cost model's mean over ranks
            # (equal at 2 ranks; a ring's uneven chunks differ by a few bytes at 3).
            assert m["steps"] == cases.STEPS and run["measured_bytes"] == pytest.approx(run["bytes"], rel=0.01)
            assert m["sync_s.mean"] > 0 and m["update_s.mean"] > 0
            if name == "binsgdm" or job["size"] == 1:
                continue
            assert m["probes"] >= 2 and 0 < m["probe_rel_error"] < 10 and m["residual_ratio"] > 0
            assert all(m[f"bucket{i}/probe_rel_error"] is None for i, b in enumerate(run["buckets"]) if b.endswith(".grad"))
        for key in ("probes", "probe_rel_error", "probe_cosine", "residual_ratio"):
            assert len({run["metrics"][key] for run in runs}) == 1, (name, key)
        if name == "binsgdm":
            assert all(run["metrics"]["probes"] == 0 for run in runs)


def test_torch_optimizers_say_whether_they_pay_after_their_warm_up(job):
    """Issue 54: a 1-bit optimizer's "does it pay" line comes ``report_after`` (8) steps
    after its warm-up (``Rule.steady_after``: 1-bit Adam's ``freeze_step``, 0/1 Adam's
    ``var_freeze_step``, none for BinSGDM), with fp32 timed on every group as the slowest
    rank saw it: the same figure on every rank. One rank has nothing to compare."""
    start = {"onebit_adam": cases.CONFIGS["onebit_adam"]["freeze_step"],
             "zero_one_adam": cases.CONFIGS["zero_one_adam"]["var_freeze_step"], "binsgdm": 0}
    for name in cases.CONFIGS:
        verdicts = [rank[f"metrics/{name}"]["verdict"] for rank in job["ranks"]]
        if job["size"] == 1:
            assert verdicts == [None]
            continue
        for v in verdicts:
            assert v["step"] == start[name] + 8 and v["fp32_s"] == verdicts[0]["fp32_s"] > 0, (name, v)
            assert v["method_s"] > 0 and v["text"].startswith(f"hvd_quant: `{name}`"), (name, v)


def test_torch_rounds_report_the_scales_they_send(job):
    """Issue 54: the 1-bit rounds' worker and server scales, the same on every rank;
    BinSGDM sends no scale."""
    for name in cases.CONFIGS:
        runs = [rank[f"metrics/{name}"]["metrics"] for rank in job["ranks"]]
        for key in ("scale_max", "scale_avg", "scale_count", "scale_max.mean"):
            assert len({m[key] for m in runs}) == 1, (name, key)
        if name == "binsgdm" or job["size"] == 1:
            assert runs[0]["scale_max"] is None or job["size"] == 1
            continue
        # each compressed kind of round: the worker's and the server's scale of every
        # tensor and rank (0/1 Adam has two such kinds; the fp32 rounds send none)
        buckets = job["ranks"][0][f"metrics/{name}"]["buckets"]
        for i, bucket in enumerate(buckets):
            count = runs[0][f"bucket{i}/scale_count.mean"]
            assert count == (None if bucket.endswith(".grad") else 2 * job["size"] * len(cases.SHAPES)), bucket
        assert runs[0]["scale_max.mean"] >= runs[0]["scale_avg.mean"] > 0


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_torch_guard_falls_back_on_every_rank_alike(job, name):
    """Issue 54: a guarded 1-bit optimizer's compressed round falls back to fp32 on every
    rank at the same step, comes back after its fallback steps, keeps the parameters
    finite, and its guard's state goes through a checkpoint."""
    if job["size"] == 1:
        pytest.skip("one rank: nothing is compressed")
    runs = [_ok(rank[f"guarded/{name}"]) for rank in job["ranks"]]
    assert len({repr(run["flags"]) for run in runs}) == 1
    run = runs[0]
    compressed = [i for i, b in enumerate(run["buckets"]) if not b.endswith(".grad")]
    column = [row[compressed[0]] if len(row) > compressed[0] else 0.0 for row in run["flags"]]
    assert 1.0 in column and run["fallbacks"] >= 1 and run["finite"]
    assert run["loaded"]["buckets"] == run["guard"]["buckets"]


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_torch_guard_warns_once_of_nonfinite_rounds_with_the_1bit_hint(job, name):
    for rank in job["ranks"]:
        got = _ok(rank[f"guard_nonfinite/{name}"])
        assert got["skipped"] == 4 and got["metrics_skipped"] >= 4
        if rank["rank"] == 0:
            assert len(got["warnings"]) == 1 and "freeze_step" in got["warnings"][0]
        else:
            assert got["warnings"] == []


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_on_a_process_group_the_same_bits_as_on_horovod(job, name):
    """Issue 55: ``process_group=`` runs the same rule over torch.distributed (Gloo): fed
    the same gradients, the same parameters bit for bit, the same steps and bytes."""
    if job["k"] is not None:
        pytest.skip("the 2x2 job registers Horovod node process sets: BinSGDM's hierarchy takes another route")
    for rank in job["ranks"]:
        got, ref = _ok(rank[f"group/{name}"]), _ok(rank[f"train/{name}"])
        assert got["comm"] == "DistComm"
        assert got["x"] == ref["x"], f"rank {rank['rank']}"
        assert (got["kinds"], got["bytes"], got["rounds"]) == (ref["kinds"], ref["bytes"], ref["rounds"])


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_broadcast_state_over_a_process_group(job, name):
    """Rank 0's state reaches every rank over the group (error buffers stay each rank's)."""
    if job["k"] is not None:
        pytest.skip("run on the flat jobs")
    root = _ok(job["ranks"][0][f"group_broadcast/{name}"])
    assert root["state"] == root["trained"]
    for rank in job["ranks"]:
        assert _ok(rank[f"group_broadcast/{name}"])["state"] == root["trained"], f"rank {rank['rank']}"


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_every_rank_equals_the_oracle(job, name):
    """Equal to float32 rounding: torch's CPU ``sqrt`` is not correctly rounded (it differs
    from numpy's in the last bit for about one value in six), and Adam divides by it.
    Ranks equal each other bit for bit wherever the method synchronises them."""
    n, k = job["size"], job["k"]
    expected = oracle(name, n, k)
    for rank in job["ranks"]:
        got = _ok(rank[f"train/{name}"])
        np.testing.assert_allclose(np.float32(got["x"]), expected[rank["rank"]].x, rtol=1e-5, atol=1e-6)
        assert got["kinds"] == expected[0].state.kinds
        assert got["bytes"] == pytest.approx(expected[0].state.bytes_sent)
    xs = [np.float32(r[f"train/{name}"]["x"]) for r in job["ranks"]]
    if name != "zero_one_adam" or xs[0].size and expected[0].state.kinds[-1] != "local":
        for x in xs[1:]:  # ranks agree wherever the method synchronises them
            np.testing.assert_array_equal(x, xs[0])


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_staged_collectives_step_the_same_bits(job, name):
    """``HVD_QUANT_WIRE=staged`` (each collective's tensors through host buffers, as GPU
    tensors go with a Horovod without GPU operations): the parameters, step kinds, bytes
    and collectives of the plain run, on every rank; what crossed is the collectives'
    payload, nothing else."""
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    for rank in job["ranks"]:
        plain, staged = _ok(rank[f"train/{name}"]), _ok(rank[f"train_staged/{name}"])
        for key in ("x", "kinds", "bytes", "calls"):
            assert staged[key] == plain[key], key
        assert staged["host_bytes"] == staged["payload"] > 0


def test_local_steps_issue_no_collective(job):
    got = _ok(job["ranks"][0]["train/zero_one_adam"])
    kinds, calls = got["kinds"], got["calls"]
    assert "local" in kinds or job["size"] == 1
    for kind, count in zip(kinds, calls):
        if kind == "local":
            assert count == 0, (kinds, calls)
        elif job["size"] > 1 and kind != "init":
            assert count > 0
    assert got["rounds"] == sum(k != "local" for k in kinds)
    if job["size"] == 1:
        assert got["bytes"] == 0.0


def test_onebit_rounds_cost_a_32nd_of_fp32(job):
    if job["size"] == 1:
        pytest.skip("nothing is sent with one rank")
    kinds = _ok(job["ranks"][0]["train/onebit_adam"])["kinds"]
    assert kinds[0] == "init" and kinds[1:6] == ["full"] * 5 and set(kinds[6:]) == {"onebit"}
    rule = OnebitAdamRule()
    assert rule.wire_bytes("onebit", 10 ** 6, job["size"]) < rule.wire_bytes("full", 10 ** 6, job["size"]) / 25


def test_a_rank_without_a_gradient_counts_zeros(job):
    expected = oracle("zero_one_adam", job["size"], job["k"], drop_rank=1)
    for rank in job["ranks"]:
        np.testing.assert_allclose(np.float32(_ok(rank["missing_grad"])["x"]), expected[rank["rank"]].x,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", ["checkpoint/phase_a", "checkpoint/phase_b", "checkpoint/onebit_adam",
                                 "checkpoint/binsgdm", "checkpoint/phase_b_earlier",
                                 "checkpoint/onebit_adam_earlier"])
def test_checkpoints_restore_bit_identically(job, key):
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    for rank in job["ranks"]:
        got = _ok(rank[key])
        assert got["restored"] == got["uninterrupted"]


def test_bad_input_fails_clearly_on_every_rank(job):
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    for rank in job["ranks"]:
        if job["size"] > 1:
            err = rank["lr_disagreement"]
            assert err["error"] == "RankDisagreement" and "learning rates" in err["message"], err
            err = rank["schedule_disagreement"]
            assert err["error"] == "RankDisagreement" and "options" in err["message"], err
            assert "var_freeze_step=8" in err["message"] or "var_freeze_step=9" in err["message"], err
        else:
            assert rank["schedule_disagreement"] == "no error"
        err = rank["sparse"]
        assert err["error"] == "RuntimeError" and "sparse_as_dense=False" in err["message"], err
        runs = _ok(rank["sparse_as_dense"])  # by default: the dense embedding's very results
        assert runs and all(run["sparse"] == run["dense"] for run in runs.values()), runs
        err = rank["meta_parameters"]
        assert (err["error"] == "ValueError" and "the CPU and on CUDA GPUs" in err["message"]
                and "meta" in err["message"]), err


def test_deepspeed_only_arguments_are_accepted_with_a_warning(job):
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    got = _ok(job["ranks"][0]["deepspeed_arguments"])
    for cls in ("OnebitAdam", "ZeroOneAdam"):
        assert got[f"defaults/{cls}"] == []  # DeepSpeed's defaults: silent
        warned = got[f"others/{cls}"]
        for name in ("deepspeed", "eps_inside_sqrt", "max_grad_norm", "cuda_aware", "comm_backend_name"):
            assert any(f"{cls}: {name}=" in w and "ignored" in w for w in warned), (name, warned)
        assert any("clip_grad_norm_" in w for w in warned)
    assert "pass lr= by keyword" in got["engine_as_lr"]


def test_param_groups_with_their_own_lr_under_lambda_lr(job):
    """Two groups with different base learning rates under ``LambdaLR``: each step uses
    base * factor, each group equals its oracle, and 0/1 Adam's Γ follows the group's
    learning rates exactly (float64, as DeepSpeed's Python float). 1-bit Adam's groups:
    tests/test_onebit_optimizers.py (oracle against DeepSpeed's transcription)."""
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    name = "zero_one_adam"
    expected = oracle_groups(name, job["size"])
    for rank in job["ranks"]:
        got = _ok(rank[f"groups/{name}"])
        opts, gammas, _ = expected[rank["rank"]]
        assert got["lrs"] == [[cases.group_lr(g, s) for s in range(cases.STEPS)] for g in range(2)]
        assert got["lrs"][0] != got["lrs"][1]
        for part, opt in zip(group_parts(np.float32(got["x"])), opts):
            np.testing.assert_allclose(part, opt.x, rtol=1e-5, atol=1e-6)
        assert got["kinds"] == opts[0].state.kinds
        assert got["gammas"] == gammas
        assert "local" in got["kinds"] or job["size"] == 1
        assert max(gammas[1]) > 0 and gammas[1][-1] > 0  # ends between syncs
        ratio = [a / b for a, b in zip(gammas[0], gammas[1]) if b]
        assert ratio == pytest.approx([cases.GROUP_LRS[0] / cases.GROUP_LRS[1]] * len(ratio))


def _constant_group_lr(g, s):
    return cases.GROUP_LRS[g]


@pytest.mark.parametrize("key,steps,where", [("groups/skip", 5, 3), ("groups/grad_scaler", 4, 2)])
def test_a_bad_gradient_in_one_group_skips_the_step_in_every_group(job, key, steps, where):
    """1-bit Adam, freeze_step=3, two param groups; inf in group 1 on the last rank only.
    Every rank skips the step in both groups (before, only group 1 did, and its counters
    fell one step behind group 0's): both groups end at the same step, every rank reports
    one skipped step, and the parameters equal the oracle's (one verdict for all groups).
    Under ``hq.GradScaler`` the loss scale backs off on every rank at that step."""
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    expected = oracle_groups("onebit_adam", job["size"], lr=_constant_group_lr, steps=steps,
                             poison=(where, 1), freeze_step=3)
    flags = [s == where for s in range(steps)]
    for rank in job["ranks"]:
        got = _ok(rank[key])
        opts, _, skipped = expected[rank["rank"]]
        assert skipped == flags and got["skipped"] == flags and got["skipped_steps"] == 1
        assert got["counters"] == [g.state.scalars for g in opts]
        assert got["counters"][0] == got["counters"][1] == {"step": steps - 1, "initialized": 1, "frozen": 1}
        assert got["kinds"] == opts[0].state.kinds
        for part, opt in zip(group_parts(np.float32(got["x"])), opts):
            np.testing.assert_allclose(part, opt.x, rtol=1e-5, atol=1e-6)
        if key == "groups/grad_scaler":
            assert got["scales"] == [2.0 ** 10] * where + [2.0 ** 9] * (steps - where)
    xs = [r[key]["x"] for r in job["ranks"]]
    assert all(x == xs[0] for x in xs[1:])


def test_non_freeze_group_is_fp32_adam_throughout(job):
    """1-bit Adam with group 1 ``non_freeze`` (DeepSpeed's flag): equal to the oracle (which
    equals DeepSpeed's transcription: tests/test_onebit_optimizers.py); group 0's steps
    are 1-bit after the freeze, group 1's an fp32 round each. ZeroOneAdam and BinSGDM
    refuse the flag at construction."""
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    n = job["size"]
    expected = oracle_groups("onebit_adam", n, lr=_constant_group_lr, non_freeze=True)
    for rank in job["ranks"]:
        got = _ok(rank["groups/non_freeze"])
        opts, _, skipped = expected[rank["rank"]]
        assert not any(skipped)
        for part, opt in zip(group_parts(np.float32(got["x"])), opts):
            np.testing.assert_allclose(part, opt.x, rtol=1e-5, atol=1e-6)
        assert got["kinds"] == opts[0].state.kinds  # the step's kind follows the frozen group
        assert opts[1].state.kinds == ["full"] * cases.STEPS
        assert got["bytes"] == pytest.approx(sum(o.state.bytes_sent for o in opts))
        assert got["rounds"] == cases.STEPS  # the non_freeze group's fp32 round, every step
        if n > 1:
            assert all(c > 0 for c in got["calls"])
        assert "zoadam.py" in got["refused"]["ZeroOneAdam"] and "non_freeze" in got["refused"]["BinSGDM"]
    xs = [r["groups/non_freeze"]["x"] for r in job["ranks"]]
    assert all(x == xs[0] for x in xs[1:])


def test_load_state_dict_keeps_the_scripts_mask(job):
    """DeepSpeed's load_state_dict: the optimizer's own exp_avg_mask stays, a checkpoint's
    is dropped when the optimizer has none; the caller's state dict is not modified. (That
    step() uses param_groups' mask: test_final_sync_ends_with_one_model.)"""
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    for rank in job["ranks"]:
        got = _ok(rank["mask_checkpoint"])
        assert got["kept"] and got["dropped"] and got["checkpoint_unchanged"]


def test_final_sync_ends_with_one_model(job):
    """0/1 Adam with exact_sync and param_groups[0]["exp_avg_mask"], stopped between
    syncs: ranks differ; final_sync runs the sync once (collectives, bytes, a round),
    equals the oracle's with the same mask, and leaves every rank with the same
    parameters bit for bit; a second call does nothing."""
    if job["k"]:
        pytest.skip("checked in the flat jobs")
    n = job["size"]
    expected = oracle("zero_one_adam", n, None, exact_sync=True, final_sync=True, mask=cases.mask())
    unmasked = oracle("zero_one_adam", n, None, exact_sync=True, final_sync=True)
    assert expected[0].state.kinds[-1] == "local" and expected[0].synced
    got = [_ok(r["final_sync"]) for r in job["ranks"]]
    rule = ZeroOneAdamRule(**cases.CONFIGS["zero_one_adam"])
    for rank, g in zip(job["ranks"], got):
        np.testing.assert_allclose(np.float32(g["x"]), expected[rank["rank"]].x, rtol=1e-5, atol=1e-6)
        if n > 1:  # the mask multiplies 1-bit results (none with one rank): it made a difference
            assert not np.allclose(np.float32(g["x"]), unmasked[rank["rank"]].x, rtol=1e-3)
        assert g["synced"] is True and g["again"] is False and g["kinds_unchanged"] and g["gamma"] == 0.0
        assert g["calls"][1] == 0
        assert (g["calls"][0] > 0) == (n > 1) and g["rounds"] == int(n > 1)
        assert g["bytes"] == (pytest.approx(rule.wire_bytes("onebit", cases.COUNTS, n)) if n > 1 else 0.0)
    for g in got[1:]:
        np.testing.assert_array_equal(g["x"], got[0]["x"])
        if n > 1:
            assert g["before"] != got[0]["before"]  # local steps: the ranks differed


TF_WORKER = HERE / "mp" / "optim_worker_tf.py"


@pytest.fixture(scope="module", params=[pytest.param((2, "gloo")),  # full tier only (above)
                                        pytest.param((3, "gloo"), marks=pytest.mark.quick),
                                        pytest.param((2, "mpi"), marks=MPI),
                                        pytest.param((3, "mpi"), marks=MPI)],
                ids=["tf-np2", "tf-np3", "tf-np2-mpi", "tf-np3-mpi"])
def tf_job(request, tmp_path_factory):
    n, launcher = request.param
    if launcher == "mpi":
        out = mpi_job("tf", n, tmp_path_factory) / "optim"
    else:
        skip_gloo_twin("tf", n)
        out = tmp_path_factory.mktemp(f"optimtf{n}")
        run_horovod(TF_WORKER, n, [out], timeout=600)
    return {"size": n, "ranks": load_rank_results(out, n)}


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_keras_optimizers_equal_the_oracle_eagerly_and_in_tf_function(tf_job, name):
    expected = oracle(name, tf_job["size"], None)
    counts = {k: expected[0].state.kinds.count(k) for k in ("init", "full", "onebit", "local")}
    for rank in tf_job["ranks"]:
        for mode in ("eager", "fn"):
            got = _ok(rank[f"train/{name}/{mode}"])
            np.testing.assert_allclose(np.float32(got["x"]), expected[rank["rank"]].x, rtol=1e-5, atol=1e-6)
            assert got["kinds"] == counts
            assert got["bytes"] == pytest.approx(expected[0].state.bytes_sent, rel=1e-6)
    for mode in ("eager", "fn"):  # ranks agree wherever the method synchronises them
        xs = [np.float32(r[f"train/{name}/{mode}"]["x"]) for r in tf_job["ranks"]]
        if name != "zero_one_adam" or expected[0].state.kinds[-1] != "local":
            for x in xs[1:]:
                np.testing.assert_array_equal(x, xs[0])
        else:  # local steps since the last sync: the ranks differ
            assert any(not np.array_equal(x, xs[0]) for x in xs[1:])


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_keras_local_steps_issue_no_collective(tf_job, name):
    """Eagerly, every collective is a call on the optimizer's communicator: counted per step."""
    expected = oracle(name, tf_job["size"], None)
    for rank in tf_job["ranks"]:
        got = _ok(rank[f"train/{name}/eager"])
        assert got["step_kinds"] == expected[0].state.kinds
        for kind, count in zip(got["step_kinds"], got["calls"]):
            assert (count == 0) == (kind == "local"), (got["step_kinds"], got["calls"])
        assert got["rounds"] == sum(k != "local" for k in got["step_kinds"])
    if name == "zero_one_adam":
        assert "local" in expected[0].state.kinds


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_keras_fit_trains_with_identical_weights(tf_job, name):
    """Every rank ends fit with the same weights, 0/1 Adam too: its last step is a local
    one and FinalSyncCallback (with exact_sync) makes one model."""
    fits = [_ok(r[f"fit/{name}"]) for r in tf_job["ranks"]]
    assert fits[0]["loss"][-1] < 0.5 * fits[0]["loss"][0]
    for f in fits[1:]:
        np.testing.assert_array_equal(f["weights"], fits[0]["weights"])
    assert len(fits[0]["kinds"]) == 5 * 192 // 32
    if name == "zero_one_adam":
        assert fits[0]["kinds"][-1] == "local" and all(f["final_synced"] for f in fits)
    else:
        assert not any(f["final_synced"] for f in fits)  # nothing to do for the others


@pytest.mark.parametrize("name", list(cases.CONFIGS))
def test_keras_rounds_are_measured_and_guarded_without_changing_a_bit(tf_job, name):
    """Issue 54 on the Keras 1-bit optimizers: with ``metrics=True`` in a tf.function the
    same parameters as unmeasured, the figures equal on every rank, a guard that falls
    back alike on every rank (BinSGDM's sign sums are never probed: it never does), its
    state through guard_state_dict; fit with MetricsCallback logs the figures and ends
    with fit's weights."""
    runs = [_ok(rank[f"measured/{name}"]) for rank in tf_job["ranks"]]
    for rank, run in zip(tf_job["ranks"], runs):
        assert run["x"] == rank[f"train/{name}/fn"]["x"]
        m = run["metrics"]
        assert m["steps"] == cases.STEPS and m["sync_s.mean"] > 0 and m["bytes_sent.mean"] > 0
        assert run["config"] == {"metrics": True, "probe_every": 4, "guard": False, "report_after": 8}
        assert run["finite"] and run["loaded"]["buckets"] == run["guard"]["buckets"]
    for key in ("probes", "probe_rel_error", "probe_cosine", "scale_max", "skipped_steps"):
        assert len({repr(run["metrics"][key]) for run in runs}) == 1, key
    assert len({repr(run["flags"]) for run in runs}) == 1
    if name == "binsgdm":
        assert runs[0]["metrics"]["probes"] == 0 and 1.0 not in runs[0]["flags"]
    else:
        assert runs[0]["metrics"]["probes"] >= 2 and runs[0]["metrics"]["scale_max.mean"] > 0
        assert 1.0 in runs[0]["flags"]
    # The "does it pay" line, 8 steps after the warm-up, with the same fp32 time everywhere.
    start = {"onebit_adam": cases.CONFIGS["onebit_adam"]["freeze_step"],
             "zero_one_adam": cases.CONFIGS["zero_one_adam"]["var_freeze_step"], "binsgdm": 0}[name]
    for run in runs:
        v = run["verdict"]
        assert v["step"] == start + 8 and v["fp32_s"] == runs[0]["verdict"]["fp32_s"] > 0, v
        assert v["text"].startswith(f"hvd_quant: `{name}`"), v
    fits = [_ok(rank[f"fit_metrics/{name}"]) for rank in tf_job["ranks"]]
    for rank, f in zip(tf_job["ranks"], fits):
        assert f["weights"] == rank[f"fit/{name}"]["weights"]
        assert len(f["logged"]["hvd_quant/bytes_sent"]) == 5 and f["logged"]["hvd_quant/steps"][-1] == 30


@pytest.mark.parametrize("key", ["checkpoint/phase_a", "checkpoint/phase_b", "checkpoint/onebit_adam",
                                 "checkpoint/binsgdm"])
def test_keras_checkpoints_restore_bit_identically(tf_job, key):
    for rank in tf_job["ranks"]:
        got = _ok(rank[key])
        assert got["restored"] == got["uninterrupted"]


def test_keras_gamma_follows_a_learning_rate_schedule(tf_job):
    """0/1 Adam under a Keras LearningRateSchedule: Γ is a float64 variable holding exactly
    the oracle's float64 sum of the (float32) learning rates the steps used, and the
    parameters equal the oracle's fed with those rates."""
    for rank in tf_job["ranks"]:
        got = _ok(rank["lr_schedule"])
        lrs = got["lrs"]
        assert got["gamma_dtype"] == "float64"
        assert lrs[0] == float(np.float32(1e-2)) and all(a > b for a, b in zip(lrs, lrs[1:]))
        expected = oracle("zero_one_adam", tf_job["size"], None, lrs=lrs)[rank["rank"]]
        assert got["gammas"] == expected.gammas
        assert max(got["gammas"]) > 0 and got["gammas"][-1] > 0
        np.testing.assert_allclose(np.float32(got["x"]), expected.x, rtol=1e-5, atol=1e-6)
    # What a float32 Γ would have held: not the same numbers (so the check above can fail).
    gamma32, differs = np.float32(0), False
    for lr, gamma in zip(lrs, got["gammas"]):
        gamma32 = np.float32(0) if gamma == 0.0 else gamma32 + np.float32(lr)
        differs |= float(gamma32) != gamma
    assert differs


def test_keras_final_sync_and_exp_avg_mask(tf_job):
    """0/1 Adam with exact_sync and exp_avg_mask for p0 (by path) and p2 (by variable; p1
    not named: ones), stopped between syncs: equal to the oracle with that mask, the mask
    made a difference and is no optimizer variable (checkpoints never carry it, so the
    constructor's mask stays, as DeepSpeed keeps the script's); final_sync syncs once and
    leaves every rank with the same weights bit for bit; a second call does nothing."""
    n = tf_job["size"]
    mask = cases.mask()
    mask[cases.COUNTS[0]:cases.COUNTS[0] + cases.COUNTS[1]] = 1.0
    expected = oracle("zero_one_adam", n, None, exact_sync=True, final_sync=True, mask=mask)
    unmasked = oracle("zero_one_adam", n, None, exact_sync=True, final_sync=True)
    got = [_ok(r["final_sync"]) for r in tf_job["ranks"]]
    rule = ZeroOneAdamRule(**cases.CONFIGS["zero_one_adam"])
    for rank, g in zip(tf_job["ranks"], got):
        np.testing.assert_allclose(np.float32(g["x"]), expected[rank["rank"]].x, rtol=1e-5, atol=1e-6)
        assert not np.allclose(np.float32(g["x"]), unmasked[rank["rank"]].x, rtol=1e-3)
        assert not any("mask" in path for path in g["optimizer_variables"])
        assert g["synced"] is True and g["again"] is False and g["kinds_unchanged"] and g["gamma"] == 0.0
        assert g["calls"][0] > 0 and g["calls"][1] == 0 and g["rounds"] == 1
        assert g["bytes"] == pytest.approx(rule.wire_bytes("onebit", cases.COUNTS, n))
    for g in got[1:]:
        np.testing.assert_array_equal(g["x"], got[0]["x"])
        assert g["before"] != got[0]["before"]


def test_keras_bad_input_fails_clearly_on_every_rank(tf_job):
    for rank in tf_job["ranks"]:
        err = rank["lr_disagreement"]
        assert err["error"] == "RankDisagreement" and "learning rates" in err["message"], err
        err = rank["schedule_disagreement"]
        assert err["error"] == "RankDisagreement" and "options" in err["message"], err
        assert "var_freeze_step=8" in err["message"] or "var_freeze_step=9" in err["message"], err
        err = rank["sparse"]
        assert err["error"] == "ValueError" and "sparse_as_dense=False" in err["message"], err


@pytest.mark.parametrize("mode", ["eager", "fn"])
def test_keras_optimizers_make_sparse_gradients_dense_by_default(tf_job, mode):
    """An embedding-like IndexedSlices gradient gives the same bits as the same gradient
    given dense (every optimizer eagerly, 0/1 Adam in tf.function)."""
    for rank in tf_job["ranks"]:
        runs = _ok(rank[f"sparse_as_dense/{mode}"])
        assert runs and all(run["sparse"] == run["dense"] for run in runs.values()), runs.keys()
