"""hvd_quant as a drop-in for Horovod: programs that work under ``hvd.DistributedOptimizer``
work with one line changed to ``hq.DistributedOptimizer``, and a process recovers after
errors that every rank raises together.

One job per rank count (2 and 3) runs ``tests/mp/dropin_worker.py``: every program with
Horovod's optimizer and with ours (``Compression.none`` and ``ef_sign``), and the failing
programs with a training program after each, all in one process, each between its own
``hvd.init()`` and ``hvd.shutdown()`` (see that file).
"""

import numpy as np
import pytest

from horovod_launch import HERE, load_rank_results, run_horovod

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

PROGRAMS = ("init_then_broadcast", "gan", "sparse_embedding", "unnamed", "process_set", "resume_on_rank_0")
NEVER_BROADCAST = ("gan", "sparse_embedding", "unnamed")
FAILURES = ("strict_values", "shapes_differ", "compressors_differ_stock", "onebit_hyper_differ",
            "torus_that_cannot_be", "zero_grad_mid_round", "strict_values_kept")


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"dropin{n}")
    # add_process_set at run time needs Horovod's dynamic process sets.
    run_horovod(HERE / "mp" / "dropin_worker.py", n, [out], timeout=360,
                env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    return load_rank_results(out, n)


def _result(rank, key):
    entry = rank[key]
    assert entry["error"] is None, f"{key}: {entry['error']}"
    return entry["result"]


def _value_warnings(rank, key):
    return [w for w in rank[key]["warnings"] if "different values" in w]


@pytest.mark.parametrize("program", PROGRAMS)
def test_compression_none_gives_horovods_results(ranks, program):
    """Where the compression is exact, each rank ends where it ends under Horovod:
    bit for bit at 2 ranks (a sum of two floats has one rounding), within float32
    rounding of a three-term sum at 3 ranks (Gloo's ring adds in another order), and of
    the sums of repeated rows for the sparse embedding (Horovod reduces its gradient as
    gathered rows, summed by ``coalesce``; hvd_quant as a dense buffer)."""
    for r, rank in enumerate(ranks):
        ours = np.array(_result(rank, f"{program}/none")["params"])
        theirs = np.array(_result(rank, f"{program}/horovod")["params"])
        if len(ranks) == 2 and program != "sparse_embedding":
            np.testing.assert_array_equal(ours, theirs, err_msg=f"rank {r}")
        else:
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6, err_msg=f"rank {r}")


@pytest.mark.parametrize("path", ["horovod", "none", "ef_sign"])
@pytest.mark.parametrize("program", [p for p in PROGRAMS if p != "process_set"])
def test_every_rank_applies_the_same_mean(ranks, program, path):
    """Per-rank parameter values are trained on, as Horovod does: the gradient each rank
    applies (the mean) is the same bits on every rank."""
    grads = [_result(rank, f"{program}/{path}")["grads"] for rank in ranks]
    assert np.all(np.isfinite(grads[0]))
    for r in range(1, len(ranks)):
        assert grads[r] == grads[0], f"rank {r}"


@pytest.mark.parametrize("path", ["none", "ef_sign"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_values_that_still_differ_give_one_warning_on_rank_0(ranks, program, path):
    """Values that differ at the first step only (broadcast after it) give no warning;
    values never broadcast give exactly one, on rank 0, naming the fix."""
    expected = 1 if program in NEVER_BROADCAST else 0
    found = _value_warnings(ranks[0], f"{program}/{path}")
    assert len(found) == expected, found
    if expected:
        assert "broadcast_parameters" in found[0] and "train different models" in found[0]
    for r, rank in enumerate(ranks[1:], start=1):
        assert _value_warnings(rank, f"{program}/{path}") == [], f"rank {r}"


@pytest.mark.parametrize("path", ["horovod", "none", "ef_sign"])
def test_broadcast_optimizer_state_creates_the_missing_state_without_a_reduction(ranks, path):
    """Rank 0 resumes from a checkpoint, the others start fresh, and
    ``hvd.broadcast_optimizer_state`` steps the optimizer on the fresh ranks only: with
    hvd_quant's optimizer, as with Horovod's, that step reduces nothing (it hung), and
    every rank ends the broadcast with rank 0's Adam state."""
    states = [_result(rank, f"resume_on_rank_0/{path}")["state"] for rank in ranks]
    assert len(states[0]) > 0
    for r in range(1, len(ranks)):
        assert states[r] == states[0], f"rank {r}"


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "binsgdm"])
def test_broadcast_optimizer_state_gives_the_1bit_optimizers_rank_0s_state(ranks, name):
    """The same pattern with the 1-bit optimizers (their state is one flat entry per
    group, which Horovod's function neither creates without a step nor broadcasts):
    after ``hvd.broadcast_optimizer_state`` every rank holds the state rank 0 resumed
    from, error buffers aside, and the ranks then train the same model."""
    runs = [_result(rank, f"onebit_resume/{name}") for rank in ranks]
    assert runs[0]["state"] == runs[0]["expected"]
    for r, run in enumerate(runs[1:], start=1):
        assert run["state"] == runs[0]["state"], f"rank {r}"
        assert run["params"] == runs[0]["params"], f"rank {r}"
        assert run["kinds"] == runs[0]["kinds"], f"rank {r}"


@pytest.mark.parametrize("path", ["horovod", "none", "ef_sign"])
def test_a_rank_outside_the_process_set_trains_on_its_own(ranks, path):
    """Every rank builds its optimizer over the even ranks' set: the even ranks average
    among themselves, the odd ones keep their own gradients (no collective, no hang)."""
    results = [_result(rank, f"process_set/{path}") for rank in ranks]
    even = [res for r, res in enumerate(results) if r % 2 == 0]
    odd = [res for r, res in enumerate(results) if r % 2 == 1]
    assert all(res["included"] for res in even) and not any(res["included"] for res in odd)
    for res in even[1:]:
        assert res["grads"] == even[0]["grads"]
    for res in odd:
        assert res["grads"] != even[0]["grads"]  # its own batches, not the even ranks' mean


@pytest.mark.parametrize("failure", FAILURES)
def test_errors_are_raised_on_every_rank_together(ranks, failure):
    errors = [rank[f"fail/{failure}"]["error"] for rank in ranks]
    expected = ranks[0][f"fail/{failure}"]["expected"]
    assert all(e is not None and e.startswith(expected + ":") for e in errors), errors
    assert len({e.split(" (groups")[0] for e in errors}) == 1, errors


@pytest.mark.parametrize("failure", FAILURES)
def test_the_process_initialises_again_and_trains_after_each_error(ranks, failure):
    """After each error, ``hvd.shutdown(); hvd.init()`` and a training program give
    exactly what that program gave before any error."""
    for r, rank in enumerate(ranks):
        assert (_result(rank, f"after/{failure}")["params"]
                == _result(rank, "init_then_broadcast/ef_sign")["params"]), f"rank {r}"


def test_nothing_is_left_behind_by_any_program(ranks):
    for r, rank in enumerate(ranks):
        for key, entry in rank.items():
            assert entry["bucket_threads"] == [] and entry["armed_deadlines"] == 0, (r, key, entry)


def test_a_failed_optimizer_kept_alive_does_not_act_on_its_model_again(ranks):
    """A model whose first optimizer failed (and is still referenced) trains with a new
    optimizer after re-initialisation exactly as a fresh model does: the old optimizer's
    hooks no longer launch reductions."""
    for r, rank in enumerate(ranks):
        assert _result(rank, "reused_model") == _result(rank, "fresh_model"), f"rank {r}"
