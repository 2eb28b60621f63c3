"""Metrics of compression while training (hvd_quant.core.metrics; issue 54).

Each figure against a numpy oracle on the thread world (one process): bytes against the
wire meter and an fp32 ring's formula, the probe's relative error and cosine against the
exact mean computed here, the residual against the compressor's own state, non-finite
steps; the same global figures on every rank at 2 and 3 ranks; results bit for bit those
of an unmeasured run; the profiler ranges' names; bad arguments. The torch adapter's
tests are at the end (``opt.metrics()``, the TensorBoard writer, the profiler's trace).
"""

import math

import numpy as np
import pytest

import hvd_quant
from hvd_quant.core import metrics as M
from hvd_quant.core.guard import Guard, GuardSettings
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.pipeline import chunked_reduce
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import CollectiveMismatch, ThreadWorld

B = NumpyBackend()
SEGMENTS = [("w", 40), ("b", 24)]
D = sum(n for _, n in SEGMENTS)
#: Figures that every rank must report alike.
GLOBAL = ("fp32_bytes", "sq_error", "sq_exact", "dot", "sq_estimate", "sq_grad", "sq_residual",
          "probe_rel_error", "probe_cosine", "residual_ratio", "nonfinite")


def inputs(n, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(D).astype(np.float32) * (1 + r) for r in range(n)] for _ in range(steps)]


class Ranges:
    """A profiler stand-in: records the names of the ranges opened, in order."""

    def __init__(self):
        self.names = []

    def __call__(self, name):
        names = self.names

        class Range:
            def __enter__(self):
                names.append(name)

            def __exit__(self, *exc):
                return False
        return Range()


class WithAsync:
    """A thread-world communicator that also offers asynchronous allgathers (as Horovod's)."""

    def __init__(self, comm):
        self.comm, self.waited = comm, 0

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def allgather_async(self, x, name):
        outer, result = self, self.comm.allgather(x, name)

        class Handle:
            def wait(self):
                outer.waited += 1
                return result
        return Handle()


def run(name, xs, probe_every=1, measure=True, ranges=None, chunk=0, wrap=None, **options):
    """``xs[step][rank]`` through one runner per rank; returns (outputs, runners, meters)."""
    n = len(xs[0])
    compressor = hvd_quant.get(name, **options)
    runners = [CompressorRunner(compressor, B, seed=5) for _ in range(n)]
    if measure:
        for r in runners:
            r.observe(probe_every, ranges[r_index(runners, r)] if ranges else None)
    outs, meters = [], []
    for step in xs:
        world = ThreadWorld(n)

        def rank(c):
            runner, x = runners[c.rank], step[c.rank]
            c = wrap(c) if wrap else c
            return runner.measured(x, c, "g", SEGMENTS,
                                   lambda comm: chunked_reduce(runner, x, comm, "g", SEGMENTS, chunk))
        outs.append(world.run(rank))
        meters.append([m.bytes_sent for m in world.meters])
    return outs, runners, meters


def r_index(runners, runner):
    return next(i for i, r in enumerate(runners) if r is runner)


def oracle_probe(estimate, xs_step):
    exact = np.mean(np.stack(xs_step).astype(np.float64), axis=0)
    est = estimate.astype(np.float64)
    return (np.linalg.norm(est - exact) / np.linalg.norm(exact),
            est @ exact / (np.linalg.norm(est) * np.linalg.norm(exact)))


# --- the core, one process --------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", ["ef_sign", "global_qsgd", "none"])
def test_probe_figures_equal_the_numpy_oracle_on_every_rank(name, n):
    xs = inputs(n, 3)
    outs, runners, _ = run(name, xs)
    plain, plain_runners, _ = run(name, xs, measure=False)
    for step in range(3):  # measuring changes nothing: results and state bit for bit
        for r in range(n):
            np.testing.assert_array_equal(outs[step][r], plain[step][r])
    for a, b in zip(runners, plain_runners):
        assert a.state_dict().keys() == b.state_dict().keys()
        for k in a.state_dict():
            np.testing.assert_array_equal(a.state_dict()[k], b.state_dict()[k])
    rel, cos = oracle_probe(outs[-1][0], xs[-1])
    snaps = [r.metrics.snapshot() for r in runners]
    for s in snaps:
        assert s["probes"] == 3 and s["steps"] == 3
        assert s["probe_rel_error"] == pytest.approx(rel, rel=1e-4, abs=1e-6)
        assert s["probe_cosine"] == pytest.approx(cos, rel=1e-5)
        assert s["bucket0/probe_rel_error"] == s["probe_rel_error"]
        grad_rms = math.sqrt(np.mean([float(x.astype(np.float64) @ x) for x in xs[-1]]))
        assert s["grad_norm"] == pytest.approx(grad_rms, rel=1e-5)
    for k in GLOBAL:
        assert len({repr(s[k]) for s in snaps}) == 1, k
        assert len({repr(s[k + ".mean"]) for s in snaps}) == 1, k
    if name == "none":
        # The step's bytes are a difference of the meter's running float total: exact
        # to its rounding.
        assert snaps[0]["probe_rel_error"] < 1e-6
        assert snaps[0]["compression_ratio"] == pytest.approx(1.0, rel=1e-12)


def oracle_scales(name, xs_step):
    """The scales ``name`` sends on its first step (no residual yet), as its docstring
    defines them, computed here in float64."""
    x = np.stack(xs_step).astype(np.float64)  # (ranks, D)
    bounds = np.cumsum([0] + [c for _, c in SEGMENTS])
    per_segment = np.stack([np.abs(x[:, a:b]).mean(axis=1) for a, b in zip(bounds, bounds[1:])], axis=1)
    if name == "ef_sign":  # each rank's mean|x| per tensor
        return per_segment.reshape(-1)
    if name == "marsit":  # alpha: the mean over ranks of mean|x| per tensor
        return per_segment.mean(axis=0)
    if name == "global_qsgd":  # norm="max": the largest |x| of any rank
        return np.array([np.abs(x).max()])
    if name == "qsgd":  # each rank's norm with global_qsgd's l2 margin
        return np.linalg.norm(x, axis=1) * (1 + 2.0 ** -8)
    raise KeyError(name)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", ["ef_sign", "marsit", "global_qsgd", "qsgd"])
@pytest.mark.parametrize("chunk", [0, 1])
def test_scale_figures_are_the_scales_the_method_sends(name, n, chunk):
    if chunk and name in ("marsit", "qsgd"):
        pytest.skip("no chunked path")
    xs = inputs(n, 1, seed=11)
    _, runners, _ = run(name, xs, probe_every=0, chunk=chunk * 16)  # 16 elements: 4 chunks
    want = oracle_scales(name, xs[0])
    snaps = [r.metrics.snapshot() for r in runners]
    for s in snaps:
        assert s["scale_count"] == len(want) and s["bucket0/scale_count"] == len(want)
        assert s["scale_max"] == pytest.approx(want.max(), rel=1e-6)
        assert s["scale_avg"] == pytest.approx(want.mean(), rel=1e-6)
        assert s["scale_max.mean"] == s["scale_max"]  # one step
    for k in ("scale_max", "scale_sum", "scale_count", "scale_avg"):
        assert len({repr(s[k]) for s in snaps}) == 1, k


def test_scale_figures_of_onebit_are_its_worker_and_server_scales():
    n = 2
    xs = inputs(n, 1, seed=2)
    _, runners, _ = run("onebit", xs, probe_every=0)
    s = runners[0].metrics.snapshot()
    # The worker's and the server's RMS scales, one per rank each (one scale per buffer).
    assert s["scale_count"] == 2 * n
    worker = [np.linalg.norm(x.astype(np.float64)) / math.sqrt(D) for x in xs[0]]
    server = s["scale_sum"] - sum(worker)
    assert s["scale_max"] >= max(worker) * (1 - 1e-6) and server > 0
    assert runners[1].metrics.snapshot()["scale_sum"] == s["scale_sum"]


def test_no_scale_figures_where_the_method_sends_none():
    _, runners, _ = run("none", inputs(2, 2), probe_every=0)
    s = runners[0].metrics.snapshot()
    assert s["scale_max"] is None and s["scale_avg"] is None and s["scale_count.mean"] is None


@pytest.mark.parametrize("n", [2, 3])
def test_residual_norm_is_the_compressors_own_state(n):
    xs = inputs(n, 2, seed=3)
    _, runners, _ = run("ef_sign", xs)
    squares = [sum(float(v.astype(np.float64) @ v) for k, v in r.state_dict().items()
                   if k.endswith("/residual")) for r in runners]
    grad = np.mean([float(x.astype(np.float64) @ x) for x in xs[-1]])
    s = runners[0].metrics.snapshot()
    assert s["residual_norm"] == pytest.approx(math.sqrt(np.mean(squares)), rel=1e-5)
    assert s["residual_ratio"] == pytest.approx(math.sqrt(np.mean(squares) / grad), rel=1e-5)
    assert s["residual_norm"] > 0
    _, stateless, _ = run("global_qsgd", xs)
    assert stateless[0].metrics.snapshot()["residual_norm"] is None


@pytest.mark.parametrize("n", [2, 3])
def test_onebits_residual_is_its_worker_error_without_the_padding(n):
    """``onebit`` keeps its error feedback per buffer (``worker_error``, padded to a
    multiple of 8 elements per rank): its residual is that error's first ``D`` elements.
    At 3 ranks the 64 elements are padded to 72, and the padding holds an error too."""
    xs = inputs(n, 2, seed=3)
    _, runners, _ = run("onebit", xs)
    errors = [next(v.astype(np.float64) for k, v in r.state_dict().items() if k.endswith("/worker_error"))
              for r in runners]
    if n == 3:
        assert len(errors[0]) == 72 and np.any(errors[0][D:] != 0)
    squares = [float(e[:D] @ e[:D]) for e in errors]
    grad = np.mean([float(x.astype(np.float64) @ x) for x in xs[-1]])
    for r in runners:
        s = r.metrics.snapshot()
        assert s["residual_norm"] == pytest.approx(math.sqrt(np.mean(squares)), rel=1e-5)
        assert s["residual_ratio"] == pytest.approx(math.sqrt(np.mean(squares) / grad), rel=1e-5)


@pytest.mark.parametrize("n", [2, 3])
def test_bytes_are_the_meters_and_fp32_is_a_rings(n):
    xs = inputs(n, 4)
    _, runners, meters = run("ef_sign", xs, probe_every=2)
    _, _, plain_meters = run("ef_sign", xs, measure=False)
    fp32 = 2 * (n - 1) / n * 4 * D
    s = runners[1].metrics.snapshot()
    assert s["bytes_sent"] == pytest.approx(plain_meters[-1][1])
    assert s["bytes_sent.mean"] == pytest.approx(np.mean([m[1] for m in plain_meters]))
    assert s["fp32_bytes"] == pytest.approx(fp32)
    assert s["compression_ratio"] == pytest.approx(fp32 / plain_meters[-1][1])
    # probe steps (2 and 4) send more: an fp32 reduce-scatter (an alltoall of the bucket
    # padded to n equal blocks), half of fp32's ring, and a 6-number allgather per rank
    block = -(-D // n)
    probe_bytes = (n - 1) / n * 4 * block * n + (n - 1) * 6 * 8
    assert meters[1][1] - plain_meters[1][1] == pytest.approx(probe_bytes)
    assert meters[0][1] == pytest.approx(plain_meters[0][1])
    assert s["probes"] == 2


def test_probe_every_zero_issues_nothing_more():
    xs = inputs(2, 3)
    _, runners, meters = run("ef_sign", xs, probe_every=0)
    _, _, plain = run("ef_sign", xs, measure=False)
    assert meters == plain
    s = runners[0].metrics.snapshot()
    assert s["probes"] == 0 and s["probe_rel_error"] is None and s["bytes_sent"] > 0


@pytest.mark.parametrize("n", [2, 3])
def test_nonfinite_steps_are_counted_alike_on_every_rank(n):
    xs = inputs(n, 3)
    xs[1][n - 1][7] = np.nan
    _, runners, _ = run("ef_sign", xs)
    for r in runners:
        s = r.metrics.snapshot()
        assert s["skipped_steps"] == 1 and s["nonfinite"] == 0.0
        assert s["nonfinite.mean"] == pytest.approx(1 / 3)
        assert s["probes"] == 2  # the non-finite probe is not recorded


def test_phase_times_and_range_names():
    xs = inputs(2, 2)
    ranges = [Ranges(), Ranges()]
    _, runners, _ = run("global_qsgd", xs, ranges=ranges, probe_every=2)
    s = runners[0].metrics.snapshot()
    for k in ("encode_s", "wait_s", "decode_s", "probe_s"):
        assert s[k] >= 0.0 and s[k + ".mean"] >= 0.0
    assert s["probe_s"] > 0
    names = ranges[0].names
    first = names[:names.index("hvd_quant/probe")]
    assert first[0] == "hvd_quant/encode" and first[-1] == "hvd_quant/decode"
    assert set(first) == {"hvd_quant/encode", "hvd_quant/wait", "hvd_quant/decode"}
    # from the second step, only the stretch after the last collective is "decode"
    second = names[names.index("hvd_quant/probe") + 1:]
    second = [n for n in second if n != "hvd_quant/probe"]
    waits = second.count("hvd_quant/wait")
    assert waits >= 2, second
    assert second == ["hvd_quant/encode", "hvd_quant/wait"] * waits + ["hvd_quant/decode"]


def test_torus_subgroups_and_async_chunks_are_timed_without_changing_results():
    xs = inputs(4, 2)
    kw = dict(topology="torus", torus_rows=2)
    a, _, _ = run("marsit", xs, **kw)
    b, _, _ = run("marsit", xs, measure=False, **kw)
    np.testing.assert_array_equal(np.stack(a[-1]), np.stack(b[-1]))
    xs2 = inputs(2, 2)
    a, runners, _ = run("ef_sign", xs2, chunk=16, wrap=WithAsync)
    b, _, _ = run("ef_sign", xs2, chunk=16, measure=False, wrap=WithAsync)
    np.testing.assert_array_equal(np.stack(a[-1]), np.stack(b[-1]))
    # 4 chunks: each start and each wait is an interval of its own
    assert runners[0].metrics.buckets["g"].collectives >= 8


def test_probes_restart_in_step_after_an_elastic_reset():
    xs = inputs(2, 3)
    compressor = hvd_quant.get("ef_sign")
    old = CompressorRunner(compressor, B)
    old.observe(2)
    ThreadWorld(1).run(lambda c: old.measured(xs[0][0], c, "g", SEGMENTS,
                                              lambda cc: old.reduce(xs[0][0], cc, "g", SEGMENTS)))
    old.reset_checks(2)  # a survivor; the joiner is new: both probe at their 2nd step
    new = CompressorRunner(compressor, B)
    new.observe(2)
    for step in xs[1:]:
        ThreadWorld(2).run(lambda c: [old, new][c.rank].measured(
            step[c.rank], c, "g", SEGMENTS, lambda cc: [old, new][c.rank].reduce(step[c.rank], cc, "g", SEGMENTS)))
    assert old.metrics.snapshot()["probes"] == new.metrics.snapshot()["probes"] == 1


def test_mismatched_probe_settings_are_caught_not_hung():
    """Ranks with different probe_every issue different collectives: the thread world
    (and Horovod, by name) refuses them rather than pairing wrong tensors."""
    compressor = hvd_quant.get("none")
    runners = [CompressorRunner(compressor, B), CompressorRunner(compressor, B)]
    runners[0].observe(1)
    runners[1].observe(0)
    x = inputs(2, 1)[0]
    with pytest.raises(CollectiveMismatch):
        ThreadWorld(2, timeout=5).run(lambda c: runners[c.rank].measured(
            x[c.rank], c, "g", SEGMENTS, lambda cc: runners[c.rank].reduce(x[c.rank], cc, "g", SEGMENTS)))


def test_auto_measures_the_link_once_under_metrics():
    """Each measured reduction runs on a fresh timing wrapper of the owner's communicator:
    auto keys its link and choices by the communicator behind it (metrics.untimed), so it
    measures once and keeps its choice (before, every step measured and chose again)."""
    compressor = hvd_quant.get("auto")
    runners = [CompressorRunner(compressor, B) for _ in range(2)]
    for r in runners:
        r.observe(0)
    x = np.ones(D, np.float32)

    def body(c):
        runner = runners[c.rank]
        sent = []
        for _ in range(3):
            before = c.meter.bytes_sent
            runner.measured(x, c, "g", SEGMENTS, lambda cc: chunked_reduce(runner, x, cc, "g", SEGMENTS, 0))
            sent.append(c.meter.bytes_sent - before)
        return sent, compressor.choices(c)
    for sent, choices in ThreadWorld(2).run(body):
        assert sent[0] > 2 ** 20 > sent[1] == sent[2]  # the 1 MB rate probe, at the first step only
        assert list(choices) == ["g"]


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True, None])
def test_bad_probe_every_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="probe_every"):
        M.OwnerMetrics(bad)


def test_owner_step_figures():
    owner = M.OwnerMetrics(0)
    owner.record_step(0.1, 0.2, now=10.0)
    assert M.snapshot_of(owner)["step_s"] is None
    owner.record_step(0.1, 0.2, now=11.0)
    owner.record_step(0.3, 0.1, now=11.5)
    s = owner.snapshot()
    assert s["steps"] == 3
    assert s["step_s"] == pytest.approx(0.5) and s["rest_s"] == pytest.approx(0.1)
    assert s["step_s.mean"] == pytest.approx(0.75) and s["rest_s.mean"] == pytest.approx(0.4)


def test_phases_from_instants_of_overlapping_collectives():
    """A compiled reduction's phases (TensorFlow's graph): waits are the time at least one
    collective ran, decode the time after the last returned, encode the rest."""
    assert M.phases_from_instants(0.0, 10.0, [(1, 3), (2, 5), (7, 8)]) == (3.0, 5.0, 2.0)
    assert M.phases_from_instants(0.0, 10.0, [(7, 8), (1, 3), (2, 2.5)]) == (5.0, 3.0, 2.0)  # any order
    assert M.phases_from_instants(2.0, 4.0, []) == (2.0, 0.0, 0.0)
    assert M.phases_from_instants(0.0, 1.0, [(-1, 3)]) == (0.0, 1.0, 0.0)  # clamped to the reduction
    assert M.phases_from_instants(5.0, 4.0, [(4.5, 4.6)]) == (0.0, 0.0, 0.0)


def test_a_recorded_reduction_counts_as_a_measured_one():
    """``record_reduction`` (a compiled reduction the adapter timed) gives the figures
    ``measure`` would, and moves probe steps on: ``eager_due`` says when the next
    reduction must be measured eagerly (a probe step, or the guard's fp32)."""
    xs = inputs(2, 1)
    _, measured, meters = run("ef_sign", xs, probe_every=0)
    want = measured[0].metrics.snapshot()
    owner = M.OwnerMetrics(3)
    assert not owner.eager_due() and M.OwnerMetrics(1).eager_due()  # before any reduction
    scale = (np.float32(0.5), np.float32(1.5), 3)
    for step in range(2):
        owner.record_reduction("g", SEGMENTS, D, 0, 2, meters[0][0], (0.25, 0.5, 0.125), np.bool_(step != 0),
                               B, [scale])
        owner.record_step(0.875, 0.1, now=float(step))
    assert owner.eager_due()  # the third reduction probes
    s = owner.snapshot()
    for k in ("bytes_sent", "fp32_bytes", "compression_ratio"):
        assert s[k] == pytest.approx(want[k]), k
    assert (s["encode_s"], s["wait_s"], s["decode_s"], s["probes"]) == (0.25, 0.5, 0.125, 0)
    assert (s["scale_max"], s["scale_sum"], s["scale_count"]) == (0.5, 1.5, 3.0)
    assert s["skipped_steps"] == 1 and s["nonfinite"] == 0.0  # the first step's flag was False
    guarded = M.OwnerMetrics(2, guard=Guard(GuardSettings(error_bound=1e-9, patience=1, fallback_steps=1),
                                            hvd_quant.get("ef_sign")))
    guarded.record_reduction("g", SEGMENTS, D, 0, 2, 1.0, (0, 0, 0), True, B)
    guarded.guard.reduced("g", False, 1.0, 0)  # a probe far from the exact mean starts a fallback
    assert guarded.guard.falling_back("g") and guarded.eager_due()


# --- the torch adapter: hq.DistributedOptimizer, the TensorBoard writer, the profiler ------------
@pytest.fixture
def hq(monkeypatch):
    """hvd_quant.torch with its optimizers on the calling thread's communicator (solo_comm)."""
    pytest.importorskip("torch")
    pytest.importorskip("horovod.torch")
    import hvd_quant.torch as hq
    from solo_comm import use_thread_comms
    use_thread_comms(monkeypatch)
    return hq


def torch_model(rank):
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    init = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    return model, data


def torch_optimizer(hq, model, name="ef_sign", **kw):
    import torch
    from solo_comm import FakeProcessSet
    return hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hq.Compression.get(name), process_set=FakeProcessSet(), **kw)


def train_on_threads(hq, n, steps, each_step=None, **kw):
    """``steps`` steps on ``n`` simulated ranks; returns per rank (optimizer, [grads
    before the reduction, per step], [reduced grads, per step])."""
    import torch
    from solo_comm import FrameworkComm, set_thread_comm
    from hvd_quant.torch.backend import TorchBackend

    def body(c):
        set_thread_comm(FrameworkComm(c, TorchBackend()))
        model, data = torch_model(c.rank)
        opt = torch_optimizer(hq, model, **kw)
        local, reduced = [], []
        for step in range(steps):
            x, y = data[step % len(data)]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            local.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            opt.step()
            reduced.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            if each_step is not None:
                each_step(opt, step)
        return opt, local, reduced

    return ThreadWorld(n).run(body)


@pytest.mark.parametrize("n", [2, 3])
def test_torch_metrics_agree_on_every_rank_and_with_numpy(hq, n):
    out = train_on_threads(hq, n, 3, overlap=False, probe_every=1)
    snaps = [opt.metrics() for opt, _, _ in out]
    local = [np.stack([g.numpy() for g in rank[1]]) for rank in out]
    exact = np.mean(np.stack(local).astype(np.float64), axis=0)[-1]
    estimate = out[0][2][-1].numpy().astype(np.float64)  # one buffer: parameters in order
    rel = np.linalg.norm(estimate - exact) / np.linalg.norm(exact)
    for s in snaps:
        assert s["steps"] == 3 and s["probes"] == 3 and s["skipped_steps"] == 0
        assert s["probe_rel_error"] == pytest.approx(rel, rel=1e-4)
        assert s["fp32_bytes"] == pytest.approx(2 * (n - 1) / n * 4 * exact.size)
        assert 0 < s["bytes_sent"] < s["fp32_bytes"] and s["compression_ratio"] > 1
        assert s["residual_norm"] > 0 and 0 < s["probe_cosine"] <= 1
        for k in ("step_s", "sync_s", "update_s", "rest_s", "encode_s", "wait_s", "decode_s"):
            assert s[k] >= 0, k
    for k in GLOBAL:
        assert len({repr(s[k]) for s in snaps}) == 1, k


def test_torch_metrics_per_bucket_under_overlap(hq):
    out = train_on_threads(hq, 2, 2, bucket_size_mb=0.0001, probe_every=2)
    opt = out[0][0]
    s = opt.metrics()
    buckets = len(opt.bucket_groups)
    assert buckets > 1
    assert s["bytes_sent"] == pytest.approx(sum(s[f"bucket{i}/bytes_sent"] for i in range(buckets)))
    assert s["probes"] == 1 and s[f"bucket{buckets - 1}/probe_rel_error"] is not None
    assert opt.metrics_steps == 2


def test_bad_monitoring_arguments_are_clear_errors_at_construction(hq):
    import torch
    from hvd_quant.torch.monitoring import TensorBoardWriter
    from solo_comm import SoloComm, set_thread_comm
    set_thread_comm(SoloComm())
    model, _ = torch_model(0)
    for bad in (-1, 2.5, "7"):
        with pytest.raises(ValueError, match="probe_every"):
            torch_optimizer(hq, model, probe_every=bad)
    opt = torch_optimizer(hq, model)
    with pytest.raises(TypeError, match="SummaryWriter"):
        TensorBoardWriter(opt, "runs/x")
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        TensorBoardWriter(torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(ValueError, match="every"):
        TensorBoardWriter(opt, None, every=0)
    with pytest.raises(ValueError, match="metrics must be"):
        torch_optimizer(hq, model, metrics="no")
    with pytest.raises(ValueError, match="metrics=True"):
        torch_optimizer(hq, model, metrics=False, guard=True)


def test_torch_metrics_off_keeps_the_bits_and_the_steps_times_only(hq):
    """``metrics=False`` (the overhead benchmark's baseline): the same reduced gradients,
    no figure per bucket, no probe; the step's own times still recorded."""
    on = train_on_threads(hq, 2, 3, overlap=False, probe_every=1)
    off = train_on_threads(hq, 2, 3, overlap=False, metrics=False)
    for (_, _, a), (opt, _, b) in zip(on, off):
        assert all(torch_equal(x, y) for x, y in zip(a, b))
        snap = opt.metrics()
        assert snap["steps"] == 3 and snap["probes"] == 0 and snap["step_s"] is not None
        assert snap["bytes_sent"] is None and not any(k.startswith("bucket") for k in snap)


def torch_equal(x, y):
    import torch
    return torch.equal(x, y)


def test_tensorboard_event_files_read_back(hq, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    from hvd_quant.torch.monitoring import TensorBoardWriter
    seen, writers = {}, {}

    def each_step(opt, step):
        rank = opt._comm.rank
        if step == 0:  # a writer on rank 0, None on the others
            writers[rank] = TensorBoardWriter(opt, SummaryWriter(str(tmp_path)) if rank == 0 else None,
                                              every=2)
        if rank == 0:
            seen[opt.metrics_steps] = opt.metrics()

    # the writers are made after the first step: rank 0's writes at steps 2 and 4
    train_on_threads(hq, 2, 4, each_step=each_step, probe_every=2, overlap=False)
    writers[0].writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for tag in ("bytes_sent", "probe_rel_error", "bucket0/wait_s", "compression_ratio"):
        got = [(e.step, e.value) for e in events.Scalars(f"hvd_quant/{tag}")]
        assert got == [(k, pytest.approx(seen[k][tag], rel=1e-6)) for k in (2, 4)], tag
    assert "hvd_quant/bytes_sent.mean" not in events.Tags()["scalars"]


@pytest.mark.parametrize("overlap", [False, True])
def test_profiler_trace_of_two_steps_has_the_named_ranges(hq, overlap):
    import torch
    from solo_comm import SoloComm, set_thread_comm
    set_thread_comm(SoloComm())
    model, data = torch_model(0)
    opt = torch_optimizer(hq, model, overlap=overlap, probe_every=2)
    # Under overlap the buckets are reduced on the bucket worker's thread, which torch's
    # profiler records only when asked to record every thread.
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=every_thread if overlap else None) as prof:
        for x, y in data[:2]:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    names = {e.name for e in prof.events()}
    for phase in ("encode", "wait", "decode", "probe", "synchronize", "update"):
        assert f"hvd_quant/{phase}" in names, (phase, sorted(n for n in names if "hvd" in n))

