"""Overlap (issue 7): buckets reduced during backward, chunks pipelined inside a buffer.

One-process tests: the bucket worker's ordering and error handling, bucket formation, and
chunked ef_sign against the unchunked method on the thread-world oracle (numpy and numba
kernels). Multi-process tests (``horovodrun --gloo``, 2 and 3 ranks, tests/mp/bucket_worker.py):
for every registered compressor, training with ``bucket_size_mb`` (reduced during
backward) is bit-identical to the step-time path with the same groups, as are unused
parameters, ``backward_passes_per_step=2``, the GradScaler pattern and checkpoints.
"""

import gc
import threading
import time
import weakref

import numpy as np
import pytest

import hvd_quant
from hvd_quant.core.backend import NumpyBackend, NumpyKernelBackend
from hvd_quant.core.pipeline import BucketPipeline, chunk_bounds, chunked_reduce
from hvd_quant.core.runner import CompressorRunner, RankDisagreement
from hvd_quant.core.simulate import ThreadWorld

from horovod_launch import HERE, load_rank_results, run_horovod


# --- the bucket worker -------------------------------------------------------------------
def test_buckets_are_reduced_in_index_order_whatever_the_readiness_order():
    calls = []
    pipe = BucketPipeline(4, lambda b: calls.append(b) or b * 10)
    pipe.launch(2)
    pipe.launch(1)
    time.sleep(0.05)
    assert calls == []  # bucket 0 is not ready: nothing may run before it
    pipe.launch(0)
    deadline = time.monotonic() + 5
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == [0, 1, 2]  # ran during "backward", before wait_all
    assert pipe.active
    assert pipe.wait_all() == [0, 10, 20, 30]  # bucket 3 launched by wait_all
    assert calls == [0, 1, 2, 3] and not pipe.active
    assert pipe.wait_all() == [0, 10, 20, 30]  # a second round: all launched at the end
    pipe.close()


def test_an_error_skips_the_rest_of_the_round_and_reaches_wait_all():
    calls = []

    def reduce(b):
        calls.append(b)
        if b == 1:
            raise RankDisagreement("ranks disagree")
        return b

    pipe = BucketPipeline(3, reduce)
    with pytest.raises(RankDisagreement):
        pipe.wait_all()
    assert calls == [0, 1]  # bucket 2 issued no collectives
    calls.clear()
    pipe._reduce = lambda b: calls.append(b) or b
    assert pipe.wait_all() == [0, 1, 2]  # the next round starts clean


def test_abandon_issues_nothing_more():
    started, release, calls = threading.Event(), threading.Event(), []

    def reduce(b):
        calls.append(b)
        started.set()
        release.wait(5)
        return b

    pipe = BucketPipeline(3, reduce)
    pipe.launch(0)
    assert started.wait(5)
    threading.Timer(0.05, release.set).start()
    pipe.abandon()  # waits for bucket 0, skips 1 and 2
    assert calls == [0] and not pipe.active


def test_no_worker_thread_outlives_a_round():
    """Between rounds nothing holds ``reduce_bucket``: a thread waiting for the next round
    would keep the optimizer that owns it (model, buffers, state) alive for good."""

    class Owner:
        def reduce(self, b):
            return b

    owner = Owner()
    pipe = BucketPipeline(3, owner.reduce, name="hvd_quant-test-round")
    for _ in range(3):
        pipe.launch(0)
        pipe.launch(1)
        assert pipe.wait_all() == [0, 1, 2]
    pipe.launch(2)  # a round that is abandoned
    pipe.abandon()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
            t.name == "hvd_quant-test-round" for t in threading.enumerate()):
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "hvd_quant-test-round"]
    gone = weakref.ref(owner)
    del owner, pipe
    gc.collect()
    assert gone() is None


@pytest.fixture
def horovod_size_1():
    """Horovod initialised in this process (size 1), shut down again if it was not before:
    later tests read the rank from the environment."""
    hvd = pytest.importorskip("horovod.torch")
    started_here = not hvd.is_initialized()
    hvd.init()
    yield hvd
    if started_here:
        hvd.shutdown()


def test_the_default_is_buckets_reduced_during_backward(horovod_size_1):
    torch = pytest.importorskip("torch")
    import hvd_quant.torch as hq

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

    def make(**kw):
        return hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hq.Compression.ef_sign, **kw)

    names = ["1.bias", "1.weight", "0.bias", "0.weight"]  # reverse registration order
    layouts = {  # options -> (overlap, fused buffers)
        (): (True, [names]),
        (("bucket_size_mb", 0),): (False, [names[::-1]]),
        (("overlap", False),): (False, [names[::-1]]),
        (("num_groups", 2),): (False, [names[:1:-1], names[1::-1]]),
        (("bucket_size_mb", 0), ("overlap", True)): (True, [names[::-1]]),
        (("bucket_size_mb", 200 / 2 ** 20), ("overlap", False)): (False, [names[:3], names[3:]]),
    }
    for options, (overlap, groups) in layouts.items():
        opt = make(**dict(options))
        assert (opt._overlap, opt.bucket_groups) == (overlap, groups), options
    for bad in (-1, True, "25", float("nan")):
        with pytest.raises(ValueError, match="bucket_size_mb must be"):
            make(bucket_size_mb=bad)
    with pytest.raises(ValueError, match="do not also pass num_groups"):
        make(bucket_size_mb=25, num_groups=2)


def test_a_dropped_distributed_optimizer_is_freed(horovod_size_1):
    """The default (buckets reduced during backward) through one training step: dropping the
    optimizer frees it, its gradient hooks' closures included (one process, size 1)."""
    torch = pytest.importorskip("torch")
    import hvd_quant.torch as hq

    _train_drop_and_rewrap(torch, hq)


def _train_drop_and_rewrap(torch, hq):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.ef_sign)
    assert opt._overlap  # the default
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    # A new optimizer over the same model: the dropped one's hooks neither count nor reduce
    # (they would raise at the second backward, "computed more than once").
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.ef_sign)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        opt.step()


def test_bucket_formation_reverse_order_with_cap():
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.distributed_optimizer import _buckets

    params = [torch.zeros(n) for n in (100, 300, 50, 1000, 10)]
    cap_mb = 1600 / 2 ** 20  # 400 float32 values
    got = [[int(p.numel()) for p in b] for b in _buckets(params, cap_mb)]
    assert got == [[10], [1000], [50, 300], [100]]


def test_the_default_bucket_is_an_eighth_of_the_model_between_1_and_25_mb():
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.distributed_optimizer import _buckets, default_bucket_mb

    def meta(*numels):  # shapes without memory
        return [torch.empty(n, device="meta") for n in numels]

    mb = 2 ** 20 // 4  # float32 values in 1 MB
    assert default_bucket_mb(meta(10, 100)) == 1  # small models: one 1 MB bucket or a few
    assert default_bucket_mb(meta(4 * mb, 12 * mb)) == 2
    assert default_bucket_mb(meta(100 * mb, 100 * mb)) == 25  # DDP's 25 MB from 200 MB up
    assert default_bucket_mb(meta(1000 * mb)) == 25
    # The time-to-quality LM's layout: a 16 MB tied embedding (registered first) and four
    # blocks of 3 MB. 25 MB buckets make two, the blocks' complete only with block 0; the
    # default makes one per block, the last layers' first.
    lm = meta(16 * mb, *[3 * mb] * 4)
    assert [len(b) for b in _buckets(lm, 25)] == [4, 1]
    assert [[int(p.numel()) // mb for p in b] for b in _buckets(lm, default_bucket_mb(lm))] \
        == [[3], [3], [3], [3], [16]]


# --- chunk pipelining inside a buffer ----------------------------------------------------
def test_chunk_bounds_fall_on_bytes():
    assert chunk_bounds(20, 5) == [(0, 8), (8, 16), (16, 20)]
    assert chunk_bounds(16, 8) == [(0, 8), (8, 16)]
    for a, b in chunk_bounds(1001, 100)[:-1]:
        assert a % 8 == 0 and b % 8 == 0


SEGMENTS = [("a", 13), ("b", 0), ("c", 250), ("d", 1), ("e", 737)]  # 1001 elements


CHUNKED = [("ef_sign", {}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
           ("global_qsgd", {"block": 100}), ("global_qsgd", {"norm": "l2", "block": 60})]


@pytest.mark.parametrize("backend", [NumpyBackend(), NumpyKernelBackend()], ids=["numpy", "kernels"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("chunk", [8, 100, 333, 4096])
@pytest.mark.parametrize("name,opts", CHUNKED,
                         ids=["ef_sign", "gqsgd_max", "gqsgd_l2", "gqsgd_max_blocks", "gqsgd_l2_blocks"])
@pytest.mark.parametrize("into", [False, True], ids=["fresh", "into_input"])
def test_chunked_reduce_is_bit_identical_to_unchunked(backend, size, chunk, name, opts, into):
    """Chunk pipelining changes no bit of the result, the state, the random stream or
    the bytes sent; nor does decoding into the input's own memory (``out=x``, what the
    torch optimizer does with a gradient)."""
    d = sum(n for _, n in SEGMENTS)

    def train(chunk_numel, into):
        world = ThreadWorld(size)
        runners = [CompressorRunner(hvd_quant.get(name, **opts), backend, seed=3) for _ in range(size)]

        def body(comm):
            outs = []
            for step in range(3):
                x = np.random.default_rng(100 * comm.rank + step).standard_normal(d).astype(np.float32)
                x[:13] *= 50  # segments of very different magnitudes
                out = chunked_reduce(runners[comm.rank], x, comm, "fused0", SEGMENTS, chunk_numel,
                                     out=x if into else None)
                outs.append(np.array(out))
            return outs, runners[comm.rank].state_dict(), runners[comm.rank].rng_state()
        results = world.run(body)
        return results, [m.bytes_sent for m in world.meters]

    (plain, plain_bytes), (chunked, chunked_bytes) = train(0, False), train(chunk, into)
    assert chunked_bytes == pytest.approx(plain_bytes, rel=1e-12)  # a sum of per-chunk counts
    for (outs_p, state_p, rng_p), (outs_c, state_c, rng_c) in zip(plain, chunked):
        for a, b in zip(outs_p, outs_c):
            assert a.tobytes() == b.tobytes()
        assert sorted(state_p) == sorted(state_c)
        for k in state_p:
            assert np.asarray(state_p[k]).tobytes() == np.asarray(state_c[k]).tobytes()
        assert rng_p == rng_c


@pytest.mark.parametrize("backend", [NumpyBackend(), NumpyKernelBackend()], ids=["numpy", "kernels"])
@pytest.mark.parametrize("name", ["ef_sign", "marsit", "cascading_sign", "global_qsgd", "global_qsgd_exp",
                                  "onebit", "none", "fp16"])
def test_decoding_into_the_input_changes_nothing(backend, name):
    """``ReduceContext.out`` may be the input's own memory: every compressor must have
    finished reading ``x`` before writing there (3 ranks, 3 steps, state included)."""
    d = 1001

    def train(into):
        world = ThreadWorld(3)
        runners = [CompressorRunner(hvd_quant.get(name), backend, seed=5) for _ in range(3)]

        def body(comm):
            outs = []
            for step in range(3):
                x = np.random.default_rng(10 * comm.rank + step).standard_normal(d).astype(np.float32)
                out = runners[comm.rank].reduce(x, comm, "g", [("w", 600), ("v", 401)],
                                                out=x if into else None)
                outs.append(np.array(out))
            return outs, runners[comm.rank].state_dict()
        return world.run(body)

    for (outs_a, state_a), (outs_b, state_b) in zip(train(False), train(True)):
        for a, b in zip(outs_a, outs_b):
            assert a.tobytes() == b.tobytes()
        for k in state_a:
            assert np.asarray(state_a[k]).tobytes() == np.asarray(state_b[k]).tobytes()


def test_chunked_ef_sign_non_finite_step_keeps_the_residual():
    world = ThreadWorld(2)
    runners = [CompressorRunner(hvd_quant.get("ef_sign"), NumpyBackend()) for _ in range(2)]

    def body(comm):
        x = np.ones(100, np.float32)
        chunked_reduce(runners[comm.rank], x, comm, "g", [("w", 100)], 16)
        before = runners[comm.rank].state_dict()["w/residual"].copy()
        if comm.rank == 1:
            x = x.copy()
            x[57] = np.nan
        out = chunked_reduce(runners[comm.rank], x, comm, "g", [("w", 100)], 16)
        return np.isnan(out).all(), (runners[comm.rank].state_dict()["w/residual"] == before).all()
    assert world.run(body) == [(True, True), (True, True)]


def test_chunked_global_qsgd_non_finite_step_sends_no_chunk():
    """A NaN on one rank: every rank returns NaN, sends no integer chunk, and its random
    stream moves on by the one call the unchunked method makes too."""
    world = ThreadWorld(2)
    runners = [CompressorRunner(hvd_quant.get("global_qsgd"), NumpyBackend()) for _ in range(2)]

    def body(comm):
        x = np.ones(100, np.float32)
        if comm.rank == 1:
            x[57] = np.nan
        calls = runners[comm.rank].rng_state()
        out = chunked_reduce(runners[comm.rank], x, comm, "g", [("w", 100)], 16)
        return bool(np.isnan(out).all()), runners[comm.rank].rng_state() != calls
    assert world.run(body) == [(True, True), (True, True)]
    assert all(m.by_kind.get("allreduce", 0) == 2 * 4 / 2 for m in world.meters)  # the scale only


# --- real ranks ------------------------------------------------------------------------------
WORKER = HERE / "mp" / "bucket_worker.py"


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"bucket{request.param}")
    run_horovod(WORKER, request.param, [out], timeout=240,
                env={"HVD_QUANT_COLLECTIVE_TIMEOUT": "120"})
    return load_rank_results(out, request.param)


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


@pytest.mark.multiprocess
def test_every_compressor_bucketed_equals_step_time_groups(ranks):
    names = set(hvd_quant.available()) - {"auto"}  # it measures the link per owner
    for r, result in enumerate(ranks):
        cases = _ok(result["compressors"])
        assert names <= set(cases), f"rank {r}: missing {names - set(cases)}"
        for label, case in cases.items():
            case = _ok(case)
            assert case["buckets"] >= 3, label
            assert case["launched_in_backward"], f"{label}: no bucket was reduced during backward"
            assert case["params_equal"], f"{label} (rank {r}): bucketed parameters differ from step-time groups"
            assert case["state_equal"], f"{label} (rank {r}): compressor state differs"
            assert case["bytes_equal"], f"{label} (rank {r}): bytes sent differ"


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["unused_param", "two_passes", "grad_scaler", "chunked_ef_sign",
                                      "checkpoint", "ring_thread_order"])
def test_bucketed_scenarios_match_step_time(ranks, scenario):
    for r, result in enumerate(ranks):
        case = _ok(result[scenario])
        assert case["equal"], f"{scenario} (rank {r}): {case}"


@pytest.mark.multiprocess
def test_zero_grad_between_backward_and_step_is_refused(ranks):
    for result in ranks:
        assert _ok(result["zero_grad_refused"]) is True


@pytest.mark.multiprocess
def test_metrics_global_figures_are_the_same_on_every_rank(ranks):
    """opt.metrics() under overlap, probes and a skipped step (issue 54; tests/test_metrics.py
    has the rest)."""
    first = _ok(ranks[0]["metrics"])
    assert first["buckets"] >= 3 and first["global"]["skipped_steps"] == 1
    assert first["global"]["probes"] == 2 and 0 < first["global"]["probe_rel_error"] < 2
    for result in ranks[1:]:
        assert _ok(result["metrics"])["global"] == first["global"]
    for result in ranks:
        assert result["metrics"]["local"]["bytes_sent"] > 0


@pytest.mark.multiprocess
def test_guard_falls_back_on_every_rank_at_the_same_step(ranks):
    """The guard under overlap (issue 54; tests/test_guard.py has the rest): every bucket
    in fp32 at steps 3 and 4 on every rank, training on, the guard's state alike."""
    first = _ok(ranks[0]["guard"])
    assert [set(row) for row in first["flags"]] == [{0.0}, {0.0}, {1.0}, {1.0}, {0.0}, {0.0}]
    assert first["finite"] and first["saves_s"] is not None
    for result in ranks[1:]:
        case = _ok(result["guard"])
        assert case["flags"] == first["flags"] and case["guard"] == first["guard"]
        assert case["fp32_s"] == first["fp32_s"] > 0  # fp32 timed as the slowest rank saw it


@pytest.mark.multiprocess
def test_ranks_agree(ranks):
    first = ranks[0]["agree"]
    for other in ranks[1:]:
        assert other["agree"] == first
