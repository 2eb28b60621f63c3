"""Multi-process tests: real Horovod ranks under ``horovodrun --gloo``, 2 and 3 ranks, and
under MPI (full tier; ``mpirun`` for torch, ``horovodrun --mpi`` for TF).

One job per (framework, ranks) runs every check of tests/mp/worker.py; the tests below
read its per-rank results and compare them with each other and with the numpy oracle
(the same algorithms on :class:`~hvd_quant.core.simulate.ThreadWorld`). The MPI job of a
framework and rank count also runs the optimizer worker (tests/test_optimizers_mp.py reads
that part) and records what Horovod ran on (test_mpi_jobs_run_on_mpi).
"""

import subprocess
import time

import numpy as np
import pytest

import hvd_quant
import hvd_quant.compressors.auto
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld

from horovod_launch import (HERE, MPI_TEST_TIMEOUT, JobTimeout, load_rank_results, mpi_job, require_mpi,
                            run_horovod, skip_gloo_twin)

import sys
sys.path.insert(0, str(HERE / "mp"))
import cases  # noqa: E402

# Jobs run in module fixtures (600 s), whose setup pytest-timeout counts against the first
# test that uses them: the limit must exceed the job's own, not pyproject's 300 s.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(660)]
WORKER = HERE / "mp" / "worker.py"

# The quick tier (./scripts/test.sh) runs every compressor in torch at 2 and 3 ranks and in
# TensorFlow at 3 (TF at 2 ranks in the full tier: the adapters have no 2-rank branch of
# their own); the MPI jobs only in the full tier, where an MPI job replaces
# the Gloo job of its framework and rank count (horovod_launch.skip_gloo_twin).
QUICK, MPI = pytest.mark.quick, [pytest.mark.mpi, pytest.mark.timeout(MPI_TEST_TIMEOUT)]
JOBS = [pytest.param(("torch", 2, {}, "gloo"), marks=QUICK), pytest.param(("torch", 3, {}, "gloo"), marks=QUICK),
        pytest.param(("tf", 2, {}, "gloo")), pytest.param(("tf", 3, {}, "gloo"), marks=QUICK),
        pytest.param(("torch", 2, {}, "mpi"), marks=MPI), pytest.param(("torch", 3, {}, "mpi"), marks=MPI),
        pytest.param(("tf", 2, {}, "mpi"), marks=MPI), pytest.param(("tf", 3, {}, "mpi"), marks=MPI)]
JOB_IDS = ["torch-2", "torch-3", "tf-2", "tf-3", "torch-2-mpi", "torch-3-mpi", "tf-2-mpi", "tf-3-mpi"]


@pytest.fixture(scope="module", params=JOBS, ids=JOB_IDS)
def job(request, tmp_path_factory):
    framework, nranks, env, launcher = request.param
    if launcher == "mpi":
        out = mpi_job(framework, nranks, tmp_path_factory) / "worker"
    else:
        skip_gloo_twin(framework, nranks)
        out = tmp_path_factory.mktemp(f"{framework}{nranks}")
        run_horovod(WORKER, nranks, [framework, out], timeout=600, env=env)
    return {"framework": framework, "size": nranks, "launcher": launcher,
            "ranks": load_rank_results(out, nranks)}


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


INT_DTYPES = {"torch": ("int32", "int64"), "tf": ("int8", "int32", "int64")}


def _oracle(label, name, options, size, framework):
    """Run the same compressor on the same inputs in the numpy thread world, with the
    integer dtypes that framework's Horovod allreduce can sum."""
    world = ThreadWorld(size)
    runners = [CompressorRunner(hvd_quant.get(name, **options), world.backend, seed=7) for _ in range(size)]

    def body(comm):
        comm.allreduce_int_dtypes = INT_DTYPES[framework]
        per_size = {}
        for d in cases.SIZES:
            per_size[str(d)] = [runners[comm.rank].reduce(cases.rank_input(comm.rank, d, s), comm,
                                                          f"{label}.{d}", cases.segments(d))
                                for s in range(cases.STEPS)]
        return per_size
    values = world.run(body)
    return values, world.meters


def test_every_rank_gets_identical_results(job):
    ranks = job["ranks"]
    for key in ("ring_int_sum", "train"):
        first = _ok(ranks[0][key])
        for other in ranks[1:]:
            assert _ok(other[key]) == first, f"{key} differs between ranks"
    for label, _, _ in cases.COMPRESSORS:
        if label == "fp16":
            continue  # Horovod's own fp16 sum (Gloo) rounds differently per rank at 3 ranks
        first = _ok(ranks[0]["reduce"])[label]["values"]
        for other in ranks[1:]:  # (bytes may differ: ring chunks are not all equal)
            assert _ok(other["reduce"])[label]["values"] == first, f"{label} differs between ranks"


@pytest.mark.parametrize("label,name,options", cases.COMPRESSORS, ids=[c[0] for c in cases.COMPRESSORS])
def test_reduction_matches_numpy_oracle(job, label, name, options):
    got = _ok(job["ranks"][0]["reduce"])[label]
    oracle, meters = _oracle(label, name, options, job["size"], job["framework"])
    # Bytes on the wire: same algorithm, same cost model, counted independently.
    assert got["bytes"] == pytest.approx(meters[0].bytes_sent)
    for d in cases.SIZES:
        for step in range(cases.STEPS):
            value = np.array(got["values"][str(d)][step])
            truth = np.mean([cases.rank_input(r, d, step) for r in range(job["size"])], axis=0)
            assert value.shape == (d,)
            assert np.isfinite(value).all()
            if label == "fp16":  # fp16 partial sums: a few fp16 ulps of the largest input
                np.testing.assert_allclose(value, oracle[0][str(d)][step], rtol=0, atol=4e-3)
            elif label in cases.DETERMINISTIC:
                np.testing.assert_allclose(value, oracle[0][str(d)][step], rtol=2e-6, atol=2e-6)
            elif name.startswith("global_qsgd") and d and step == 0:
                # One draw of an unbiased quantizer: within its worst-case error of the mean.
                bound = 2 * np.max(np.abs([cases.rank_input(r, d, step) for r in range(job["size"])]))
                assert np.max(np.abs(value - truth)) <= bound


def test_tensorflow_graphs_reduce_as_eagerly_bit_for_bit(job):
    """The fused kernels inside tf.function (numpy_function ops, state adopting kept
    buffers): the eager run's values exactly, which test_reduction_matches_numpy_oracle
    compares with the oracle."""
    if job["framework"] != "tf":
        pytest.skip("TensorFlow only")
    for rank in job["ranks"]:
        graph, eager = _ok(rank["reduce_graph"]), _ok(rank["reduce"])
        assert graph
        for label, per_size in graph.items():
            for d, values in per_size.items():
                assert values == eager[label]["values"][d], (label, d)


def check_exact_cases(results, size):
    """Global-QSGD worst cases under real Horovod: no overflow, exact where on the grid."""
    for key, got in results.items():
        name, norm, case = key.split("/")
        got = np.array(got)
        mean = np.mean([cases.exact_input(case, r, size) for r in range(size)], axis=0)
        if case == "zeros":
            assert np.all(got == 0), key
        elif norm == "l2":  # the l2 scale is not a grid point: within one level
            inputs = [cases.exact_input(case, r, size) for r in range(size)]
            scale = np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in inputs)) * (1 + 2 ** -8)
            levels = hvd_quant.get(name, norm="l2").resolve(size)[1]
            assert np.max(np.abs(got - mean)) <= scale / levels * (1 + 1e-6), key
            assert np.all(np.sign(got) == np.sign(mean)) or case == "single", key
        elif name == "global_qsgd_exp" and case == "at_max" and size > 2:
            # Ring partial sums (2a, then 3a, ...) are rounded, unbiasedly, to powers of two:
            # exact only for 2 ranks. Here: no overflow, signs and zeros kept.
            nz = mean != 0
            assert np.all(got[~nz] == 0) and np.all(np.sign(got[nz]) == np.sign(mean[nz])), key
            assert np.all(np.abs(got) <= 2 * np.abs(mean).max()), key
        else:  # max, and exponential where the sum is a power of two: exact
            np.testing.assert_allclose(got, mean, rtol=1e-6, atol=0, err_msg=key)


def test_global_qsgd_worst_cases_under_horovod(job):
    for rank in job["ranks"]:
        check_exact_cases(_ok(rank["exact"]), job["size"])


def test_ring_equals_horovod_integer_sum_bit_for_bit(job):
    for d, res in _ok(job["ranks"][0]["ring_int_sum"]).items():
        assert res["ring"] == res["hvd"], f"ring sum differs at size {d}"
        np.testing.assert_allclose(res["ring_float"], res["hvd_float"], rtol=1e-5, atol=1e-5)
        if "torus" in res:
            assert res["torus"] == res["hvd"]


def test_probe_shards_are_the_exact_mean(job):
    """A probe step's reduce-scatter (hvd_quant.core.metrics.exact_mean_shard, an alltoall
    and a sum): each rank's shard of the mean is the float64 mean's to float32 rounding,
    the shards tile the buffer in rank order, and it counts (n - 1) / n of the padded
    buffer's bytes."""
    n = job["size"]
    for d in cases.SIZES[1:]:
        oracle = np.mean([cases.rank_input(r, d, 0).astype(np.float64) for r in range(n)], axis=0)
        block = -(-d // n)
        got = [_ok(rank["probe_shards"])[str(d)] for rank in job["ranks"]]
        assert [g["lo"] for g in got] == [min(r * block, d) for r in range(n)]
        assert [g["hi"] for g in got] == [min((r + 1) * block, d) for r in range(n)]
        for g in got:
            np.testing.assert_allclose(g["shard"], oracle[g["lo"]:g["hi"]], rtol=1e-6, atol=1e-6)
            assert g["bytes"] == pytest.approx((n - 1) * 4 * block), d


def test_torch_alltoall_in_pieces_is_the_whole_alltoall(job):
    """hvd_quant.torch.comm sends an alltoall's large shares in pieces (Gloo ran a whole
    one a direction at a time): with 8-byte pieces the float32 and uint8 shares go in
    pieces and the 4-element int64 share (4 pieces' worth) whole. Every result is the
    whole alltoall's bit for bit and holds the senders' shares in rank order, the bytes
    are counted once, and a probe's shard through pieces is the exact mean's."""
    if job["framework"] != "torch":
        pytest.skip("the pieces are the torch communicator's (TensorFlow: no gain measured)")
    n = job["size"]
    for rank in job["ranks"]:
        got = _ok(rank["alltoall_pieces"])
        assert [got[k]["pieces"] for k in ("float32", "uint8", "int64")] == [-(-103 // 2), -(-301 // 8), 0]
        for dtype, share in (("float32", 103), ("uint8", 301), ("int64", 4)):
            assert got[dtype]["same"] and got[dtype]["same_bytes"], dtype
            sent = [np.arange(n * share, dtype=np.float64) + 1000 * r + 0.25 for r in range(n)]
            sent = [(s % 251).astype(dtype) if dtype == "uint8" else s.astype(dtype) for s in sent]
            want = np.concatenate([s[rank["rank"] * share:(rank["rank"] + 1) * share] for s in sent])
            np.testing.assert_array_equal(np.array(got[dtype]["values"], dtype=dtype), want)
        d = cases.SIZES[-1]
        oracle = np.mean([cases.rank_input(r, d, 0).astype(np.float64) for r in range(n)], axis=0)
        probe = got["probe"]
        np.testing.assert_allclose(probe["shard"], oracle[probe["lo"]:probe["hi"]], rtol=1e-6, atol=1e-6)


def test_horovod_sums_fp16_as_numpy_adds_it(job):
    """Every element of Horovod's fp16 allreduce is a correctly rounded fp16 sum in some order
    of the ranks, bit for bit: ties to even, overflow to inf, subnormals. Holds for Gloo's
    software sum and for its F16C one (scripts/build_horovod.sh, Fix 9), and for MPI's."""
    inputs = cases.fp16_sum_inputs(job["size"])
    with np.errstate(over="ignore"):
        allowed = np.stack([s.view(np.uint16) for s in cases.fp16_sums(inputs)])
    for rank in job["ranks"]:
        got = np.array(_ok(rank["fp16_sum"]), dtype=np.uint16)
        bad = ~(allowed == got).any(axis=0)
        assert not bad.any(), (f"rank {rank['rank']}: {int(bad.sum())} sums not numpy's, first at "
                               f"{int(np.argmax(bad))}: {got[bad][:3].view(np.float16)}")


def test_disagreeing_ranks_raise_the_same_clear_error(job):
    for rank in job["ranks"]:
        for key in ("disagree_compressor", "disagree_options"):
            err = rank[key]
            assert err["error"] == "RankDisagreement", err
            assert "compressor or its options" in err["message"]

def test_ranks_whose_values_differ_train_on_unless_strict(job):
    """Never-broadcast parameters: ``strict`` raises on every rank at the first step; by
    default training goes on, as under Horovod, with one warning on rank 0 only."""
    for r, rank in enumerate(job["ranks"]):
        strict, default = rank["params_differ"]["strict=True"], rank["params_differ"]["strict=False"]
        assert strict["error"] == "RankDisagreement" and "parameter values" in strict["message"]
        assert "broadcast" in strict["message"]
        assert default["error"] is None
        assert len(default["warnings"]) == (1 if r == 0 else 0), default["warnings"]
        if r == 0:
            assert "broadcast" in default["warnings"][0]


def test_auto_chooses_alike_on_every_rank(job):
    """Compression.auto: one link measurement per owner, then per bucket the same method
    on every rank, whose values are those of that method run on its own (same seed)."""
    ranks = job["ranks"]
    first = _ok(ranks[0]["auto"])
    for other in ranks[1:]:
        assert _ok(other["auto"]) == first
    for family, sizes in first.items():
        for d, case in sizes.items():
            allowed = ("none",) + hvd_quant.compressors.auto.FAMILIES[family]
            assert case["chosen"] in allowed and case["same_as_alone"], (family, d)
            assert np.isfinite(case["values"]).all() and len(case["values"]) == int(d)


def test_unknown_name_lists_available(job):
    err = job["ranks"][0]["unknown_name"]
    assert err["error"] == "ValueError"
    assert "Did you mean 'ef_sign'" in err["message"] and "global_qsgd" in err["message"]


def test_non_float_tensors_pass_through(job):
    assert job["ranks"][0]["non_float"] == {"same": True, "ctx_is_none": True}


def test_stock_horovod_and_fused_paths_train(job):
    train = _ok(job["ranks"][0]["train"])
    if job["framework"] == "torch":
        # EF-sign is deterministic and per tensor in both paths: identical parameters.
        np.testing.assert_allclose(train["ef_sign/ours"], train["ef_sign/stock"], rtol=1e-6, atol=1e-7)
        assert {k.split("/")[1] for k in train} == {"ours", "stock"}
    else:
        for name in ("ef_sign", "global_qsgd", "onebit"):
            # Eager and tf.function consume the same random streams; graph optimisation
            # may reorder float ops, so equal to float tolerance. (Marsit is left out: one
            # ulp can flip a sign bit of a near-zero element.)
            np.testing.assert_allclose(train[f"{name}/ours/eager"], train[f"{name}/ours/fn"],
                                       rtol=1e-5, atol=1e-6)
        # Horovod's stock tape exists under tf-keras only: tests/test_keras.py's tf-keras job.


def test_staged_collectives_train_the_same_bits(job):
    """``HVD_QUANT_WIRE=staged`` (what GPU tensors get from a Horovod without GPU
    operations: each collective's tensors copied into host buffers and the results copied
    back, here from CPU tensors) trains the very parameters the plain path trains, in
    ``hq.DistributedOptimizer`` and through Horovod's stock optimizer, on every rank; what
    crossed is the compressed payload, far below the 8 bytes per element a copy of the
    gradient and its mean would be."""
    if job["framework"] != "torch":
        pytest.skip("the staging communicator is the torch adapter's")
    for rank in job["ranks"]:
        plain, staged = _ok(rank["train"]), _ok(rank["train_staged"])
        assert staged["params"] == plain
        numel = 10 * 6 + 6 + 6 * 3 + 3
        for key, nbytes in staged["host_bytes"].items():
            assert 0 < nbytes < 3 * 8 * numel, (key, nbytes)  # 3 steps


def test_checkpoint_restores_error_feedback_by_name(job):
    ckpt = _ok(job["ranks"][0]["checkpoint"])
    np.testing.assert_array_equal(ckpt["uninterrupted"], ckpt["restored"])
    assert all(k.endswith("/residual") for k in ckpt["state_keys"])
    assert len(ckpt["state_keys"]) == 4


def test_checkpoint_restores_onebit_errors(job):
    """Compression.onebit: worker and server errors (buffer slots; the server's as its
    compensated values and scale) saved per rank and world size; a restored run continues
    bit for bit."""
    for rank in job["ranks"]:
        ckpt = _ok(rank["checkpoint_onebit"])
        np.testing.assert_array_equal(ckpt["uninterrupted"], ckpt["restored"])
        tag = f"/rank{rank['rank']}of{job['size']}/"
        assert sorted(k.rsplit("/", 1)[1] for k in ckpt["state_keys"]) == ["server_error", "server_scale", "worker_error"]
        assert all(k.startswith("hvd_quant.buffer/") and tag in k for k in ckpt["state_keys"])


def test_ring_and_torus_with_four_ranks(tmp_path):
    """4 ranks: the only size here with a 2x2 torus (and 2 nodes x 2 for BinSGDM's
    hierarchical allreduce); also a power of two."""
    run_horovod(HERE / "mp" / "ring_worker.py", 4, [tmp_path], timeout=300)
    ranks = load_rank_results(tmp_path, 4)
    for r in ranks:  # full-world results agree on every rank
        assert all(r["sums"][d][k] == ranks[0]["sums"][d][k] for d in map(str, cases.SIZES)
                   for k in ("ring", "torus", "torus_routed", "hvd"))
    sums = dict(ranks[0]["sums"])
    for r in ranks:
        check_exact_cases(r["sums"]["exact"], 4)
    sums.pop("exact")
    marsit = sums.pop("marsit_torus")
    assert all(r["sums"]["marsit_torus"] == marsit for r in ranks) and len(marsit) == 1001
    assert sums.pop("row_is_process_set") and sums.pop("col_is_process_set")
    sums.pop("binsgdm_2x2_non_finite")  # checked below
    for d, res in sums.items():
        assert res["ring"] == res["hvd"] == res["torus"] == res["torus_routed"], d
    for r in ranks:  # a ring over a Horovod process set (this rank's torus row)
        for d in map(str, cases.SIZES):
            assert r["sums"][d]["row_ring"] == r["sums"][d]["row_hvd"], d
    # BinSGDM, 2 nodes x 2: rank 3's inf, -inf, NaN is skipped by every rank, state untouched.
    for r in ranks:
        assert [c["skipped"] for c in r["sums"]["binsgdm_2x2_non_finite"]] == [1, 1, 1]
        assert all(c["kind"] == "onebit" and c["x_unchanged"] and c["state_unchanged"]
                   for c in r["sums"]["binsgdm_2x2_non_finite"])


MPI_JOBS = [("torch", 2), ("torch", 3), ("tf", 2), ("tf", 3)]


@pytest.mark.mpi
@pytest.mark.timeout(MPI_TEST_TIMEOUT)
@pytest.mark.parametrize("framework,nranks", MPI_JOBS, ids=[f"{f}-{n}" for f, n in MPI_JOBS])
def test_mpi_jobs_run_on_mpi(framework, nranks, tmp_path_factory):
    """The MPI jobs ran on MPI, not Gloo: OpenMPI started every rank (its rank variable is
    Horovod's rank), Horovod's controller and CPU operations are MPI (no Gloo context at
    all), all ranks on one host. A process set registered at start reduces over its members
    only; one added later needs HOROVOD_DYNAMIC_PROCESS_SETS=1, under MPI as under Gloo."""
    ranks = load_rank_results(mpi_job(framework, nranks, tmp_path_factory) / "launch", nranks)
    for r in ranks:
        assert r["size"] == nranks and r["ompi_rank"] == str(r["rank"])
        assert r["mpi_enabled"] and not r["gloo_enabled"], r
        assert r["local"] == [r["rank"], nranks]
        sets = r["process_sets"]  # the set of every rank but the last
        if r["rank"] < nranks - 1:
            assert sets["registered"] == nranks - 1 and sets["registered_sum"] == nranks - 1, sets
        else:
            assert sets["registered"] is None and "registered_sum" not in sets, sets
        assert sets["dynamic"]["error"] == "ValueError", sets
        assert "Set HOROVOD_DYNAMIC_PROCESS_SETS=1" in sets["dynamic"]["message"], sets


def test_failing_rank_fails_the_job_fast():
    start = time.monotonic()
    result = run_horovod(HERE / "mp" / "fail_rank.py", 2, timeout=120, check=False)
    assert result.returncode != 0
    assert time.monotonic() - start < 90
    assert "rank 1 fails on purpose" in result.stdout


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_hanging_rank_is_killed_within_the_limit(launcher):
    """The launcher's hard limit kills every process of the job: under mpirun too, whose
    ranks are not in its process group."""
    if launcher != "gloo":
        require_mpi()
    start = time.monotonic()
    with pytest.raises(JobTimeout):
        run_horovod(HERE / "mp" / "hang_rank.py", 2, timeout=25, launcher=launcher)
    assert time.monotonic() - start < 60
    left = subprocess.run(["pgrep", "-f", "hang_rank.py"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "processes of the killed job are still alive"
