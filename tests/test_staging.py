"""The staging communicator and the device placement of the torch adapters, on the CPU.

:class:`hvd_quant.torch.staging.StagingComm` copies a GPU tensor into a host buffer,
runs the collective there and copies the result back. With ``force=True`` it does the
same for CPU tensors, through separate host buffers, so its logic runs here without a
GPU: every compressor, the chunked pipeline's asynchronous collectives, torus hops, and
the optimizers reduced through it give the bits the plain communicator gives, on
simulated ranks (``ThreadWorld``) whose tensors are torch tensors; its meter counts
what crossed, and its buffers are reused from step to step. The same paths under
``horovodrun`` are checked by ``tests/mp`` (``HVD_QUANT_WIRE=staged``). What needs a GPU
(page-locked memory, events, streams, bytes measured by the profiler) is in
``tests/test_cuda.py``.
"""

import logging
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("horovod.torch")

import hvd_quant  # noqa: E402
from hvd_quant.core.backend import truth  # noqa: E402
from hvd_quant.core.comm import Communicator, RoutedGroup  # noqa: E402
from hvd_quant.core.pipeline import chunked_reduce  # noqa: E402
from hvd_quant.core.runner import CompressorRunner, RankDisagreement  # noqa: E402
from hvd_quant.core.simulate import ThreadWorld  # noqa: E402
from hvd_quant.torch import staging  # noqa: E402
from hvd_quant.torch.backend import TorchBackend, prepare_kernels  # noqa: E402
from hvd_quant.torch.devices import home_device  # noqa: E402
from hvd_quant.torch.staging import HostMeter, PinnedPool, StagingComm  # noqa: E402
from solo_comm import (FakeProcessSet, FrameworkComm, Transport, set_thread_comm,  # noqa: E402
                        use_thread_comms)

B = TorchBackend()
prepare_kernels()  # loaded once here: the simulated ranks make optimizers on threads
SEGMENTS = [("w1", 700), ("b1", 3), ("w2", 1300), ("empty", 0), ("b2", 65)]
D = sum(n for _, n in SEGMENTS)
STEPS = 3
COMPRESSORS = [("none", {}), ("ef_sign", {}), ("marsit", {}), ("marsit", {"compensation": "global"}),
               ("cascading_sign", {}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
               ("global_qsgd_exp", {}), ("onebit", {})]


def inputs(rank, step, d=D):
    rng = np.random.default_rng(100 * rank + step)
    return torch.from_numpy((rng.standard_normal(d) * (1 + rank)).astype(np.float32))


def staged(comm):
    return StagingComm(Transport(comm, B), "cpu", force=True)


def reduce_all(name, opts, n, wrap, chunk_numel=0):
    """Outputs and state of every rank over STEPS reductions, and each rank's comm."""
    runners = [CompressorRunner(hvd_quant.get(name, **opts), B, seed=5) for _ in range(n)]

    def body(c):
        comm = wrap(c)
        outs = [chunked_reduce(runners[c.rank], inputs(c.rank, s), comm, "g", SEGMENTS, chunk_numel).clone()
                for s in range(STEPS)]
        return outs, comm

    results = ThreadWorld(n).run(body)
    return [r[0] for r in results], [r[1] for r in results], [r.state_dict() for r in runners]


def assert_same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=what)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=[f"{n}-{o}" for n, o in COMPRESSORS])
def test_staged_reductions_are_the_plain_ones_bit_for_bit(name, opts, n):
    want, plain, want_state = reduce_all(name, opts, n, lambda c: Transport(c, B))
    got, comms, got_state = reduce_all(name, opts, n, staged)
    for r in range(n):
        for s in range(STEPS):
            assert_same(got[r][s].numpy(), want[r][s].numpy(), f"rank {r} step {s}")
        assert sorted(got_state[r]) == sorted(want_state[r])
        for key in want_state[r]:
            assert_same(got_state[r][key], want_state[r][key], f"rank {r} {key}")
        meter = comms[r].host_meter
        assert comms[r].meter.bytes_sent == plain[r].meter.bytes_sent  # the same wire
        # Every tensor was staged (force): what crossed is exactly the collectives' payload.
        assert meter.to_host + meter.to_device == meter.payload > 0
        assert meter.waits == 0  # CPU copies: nothing to wait for
        if name != "none":  # never the 8 bytes per element of copying a gradient and back
            assert meter.bytes / STEPS < 4 * D, (name, meter.snapshot())


@pytest.mark.parametrize("name", ["ef_sign", "global_qsgd"])
def test_the_chunked_pipelines_async_collectives_are_staged(name):
    want, _, _ = reduce_all(name, {}, 3, lambda c: Transport(c, B), chunk_numel=256)
    got, comms, _ = reduce_all(name, {}, 3, staged, chunk_numel=256)
    for r in range(3):
        for s in range(STEPS):
            assert_same(got[r][s].numpy(), want[r][s].numpy(), f"rank {r} step {s}")
    assert comms[0].host_meter.payload > 0


class RoutedOnly(Transport):
    """A communicator whose torus rows and columns route their hops through itself."""

    def subgroups(self, rows):
        return Communicator.subgroups(self, rows)


@pytest.mark.parametrize("inner", [Transport, RoutedOnly], ids=["process-sets", "routed"])
def test_torus_hops_go_through_the_staging_comm(inner):
    opts = {"topology": "torus", "torus_rows": 2}
    want, _, _ = reduce_all("marsit", opts, 4, lambda c: inner(c, B))
    got, comms, _ = reduce_all("marsit", opts, 4, lambda c: StagingComm(inner(c, B), "cpu", force=True))
    for r in range(4):
        for s in range(STEPS):
            assert_same(got[r][s].numpy(), want[r][s].numpy(), f"rank {r} step {s}")
    row, col = comms[0].subgroups(2)
    for sub in (row, col):
        if inner is RoutedOnly:  # routed through the staging comm, not around it
            assert isinstance(sub, RoutedGroup) and sub.parent is comms[0]
        else:
            assert isinstance(sub, StagingComm) and sub.host_meter is comms[0].host_meter
    assert comms[0].host_meter.payload > 0


def test_the_host_buffers_are_reused_from_step_to_step(monkeypatch):
    """After the first step nothing is allocated: every buffer a rank takes is one it
    took in the first step (kept per size)."""
    taken = []  # (pool, step, buffer address)
    step_of = threading.local()
    real_take = PinnedPool.take

    def take(self, numel, dtype):
        buf = real_take(self, numel, dtype)
        taken.append((id(self), step_of.step, buf.data_ptr()))
        return buf

    monkeypatch.setattr(PinnedPool, "take", take)
    runner = [CompressorRunner(hvd_quant.get("onebit"), B, seed=1) for _ in range(2)]

    def body(c):
        comm = staged(c)
        for s in range(4):
            step_of.step = s
            runner[c.rank].reduce(inputs(c.rank, s), comm, "g", SEGMENTS)
        return id(comm._pool)

    for pool in ThreadWorld(2).run(body):
        first = {ptr for p, step, ptr in taken if p == pool and step == 0}
        later = {ptr for p, step, ptr in taken if p == pool and step > 0}
        assert later and later <= first


def test_staging_copies_cpu_tensors_only_when_forced():
    seen = []

    class Recorder(Transport):
        def allgather(self, x, name):
            seen.append(x)
            return super().allgather(x, name)

    def body(c):
        x = torch.arange(4, dtype=torch.float32)
        for force in (False, True):
            comm = StagingComm(Recorder(c, B), "cpu", force=force)
            out = comm.allgather(x, f"x{force}")
            assert out.dtype == x.dtype and out.numel() == 4 * c.size
            assert comm.host_meter.to_host == (16 if force else 0)
        return True

    ThreadWorld(1).run(body)
    assert seen[0] is not None and seen[1].data_ptr() != seen[0].data_ptr()


# --- the optimizers through staging ------------------------------------------------------------
@pytest.fixture
def thread_comms(monkeypatch):
    use_thread_comms(monkeypatch)


def model_and_data(rank):
    model = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    init = torch.Generator().manual_seed(0)  # the same weights on every rank (threads share
    with torch.no_grad():                    # torch's global generator)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init) * 0.3)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    return model, data


def train_on_threads(n, make_opt, wrap):
    def body(c):
        set_thread_comm(wrap(c))
        model, data = model_and_data(c.rank)
        opt = make_opt(model)
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt

    return ThreadWorld(n).run(body)


OPTIMIZERS = {
    "ef_sign/buckets": lambda m: hvd_quant.torch.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        compression=hvd_quant.torch.Compression.ef_sign, bucket_size_mb=0.0001, process_set=FakeProcessSet()),
    "global_qsgd/step": lambda m: hvd_quant.torch.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        compression=hvd_quant.torch.Compression.global_qsgd, process_set=FakeProcessSet(), overlap=False),
    "onebit_adam": lambda m: hvd_quant.torch.OnebitAdam(m.parameters(), lr=1e-2, freeze_step=2,
                                                        process_set=FakeProcessSet()),
    "zero_one_adam": lambda m: hvd_quant.torch.ZeroOneAdam(
        m.parameters(), lr=1e-2, var_freeze_step=2, var_update_scaler=1, local_step_scaler=2,
        local_step_clipper=2, process_set=FakeProcessSet()),
    "binsgdm": lambda m: hvd_quant.torch.BinSGDM(m.parameters(), lr=1e-2, ranks_per_node=1,
                                                 process_set=FakeProcessSet()),
}


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_optimizers_through_the_staging_comm_train_the_same_bits(which, thread_comms):
    want = train_on_threads(3, OPTIMIZERS[which], lambda c: Transport(c, B))
    got = train_on_threads(3, OPTIMIZERS[which], staged)
    for r in range(3):
        for a, b in zip(got[r][0], want[r][0]):
            assert_same(a.numpy(), b.numpy(), f"{which} rank {r}")
        opt, plain = got[r][1], want[r][1]
        assert opt.bytes_sent == plain.bytes_sent
        assert opt.host_bytes > 0 and plain.host_bytes == 0
        meter = opt._comm.host_meter
        # Everything the collectives carried crossed, nothing else (the agreement check's
        # rows included: they are collectives too).
        assert meter.bytes == meter.payload


# --- the choice of wire, and its check ----------------------------------------------------------
class FakeHorovod:
    def __init__(self, cuda):
        self.cuda = cuda

    def cuda_built(self):
        return self.cuda

    def rocm_built(self):
        return False

    def nccl_built(self):
        return 21805 if self.cuda else 0


@pytest.mark.parametrize("env", [None, "auto", "staged"])
def test_the_wire_follows_the_device_and_the_horovod_build(env, monkeypatch):
    if env is None:
        monkeypatch.delenv(staging.WIRE_ENV, raising=False)
    else:
        monkeypatch.setenv(staging.WIRE_ENV, env)
    forced = env == "staged"
    for cuda_build in (False, True):
        hvd = FakeHorovod(cuda_build)
        assert staging.wire_for("cpu", hvd) == ("staged" if forced else "host")
        assert staging.wire_for("cuda:0", hvd) == ("staged" if forced or not cuda_build else "device")


def test_a_bad_wire_setting_is_refused(monkeypatch):
    monkeypatch.setenv(staging.WIRE_ENV, "nccl")
    with pytest.raises(ValueError, match="HVD_QUANT_WIRE must be 'auto' or 'staged'"):
        staging.wire_for("cpu", FakeHorovod(False))


def test_the_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(staging, "_noted", set())
    monkeypatch.setenv(staging.WIRE_ENV, "staged")
    with caplog.at_level(logging.INFO, logger="hvd_quant"):
        for _ in range(3):
            staging._note(torch.device("cpu"), "staged", FakeHorovod(False))
            staging._note(torch.device("cuda", 0), "staged", FakeHorovod(False))
            staging._note(torch.device("cuda", 0), "device", FakeHorovod(True))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "separate host buffers" in lines[0] and "page-locked" in lines[1]
    assert "handed to Horovod directly" in lines[2] and "21805" in lines[2]


class Set2(FakeProcessSet):
    def size(self):
        return 2


@pytest.mark.parametrize("codes", [[1, 1], [2, 2], [1, 2], "pieces"])
def test_every_rank_must_hand_horovod_the_same_kind_of_tensors(codes, monkeypatch):
    """The first collective's check: the wire (where the tensors live) and the bytes of a
    large alltoall's pieces (0: whole; a Horovod with Fix 10 against one without)."""
    import horovod.torch as hvd
    from hvd_quant.torch import comm as tcomm

    calls = []
    # Both ranks' (wire, piece bytes): the wires of ``codes`` with this rank's piece bytes,
    # or, for "pieces", the same wire with one rank whole and the other in pieces.
    rows = ([[1, 0], [1, 1 << 20]] if codes == "pieces" else None)

    def allgather(x, name, process_set):
        calls.append(name)
        if name.startswith("hvd_quant.wire."):
            got = rows or [[code, int(x[1])] for code in codes]
            return torch.tensor(got, dtype=torch.int64).view(-1)
        return torch.cat([x, x])

    # Horovod's asynchronous allgather, waited for as the communicator waits (comm.wait_for)
    monkeypatch.setattr(hvd, "allgather_async", allgather)
    monkeypatch.setattr(tcomm, "wait_for", lambda result: result)
    comm = tcomm.HorovodTorchComm(Set2(), wire="host")
    if codes == "pieces":
        with pytest.raises(RankDisagreement, match="the bytes of a large alltoall's pieces"):
            comm.allgather(torch.ones(1), "first")
        return
    if codes[0] != codes[1]:
        with pytest.raises(RankDisagreement, match="where the tensors handed to Horovod live"):
            comm.allgather(torch.ones(1), "first")
        return
    comm.allgather(torch.ones(1), "first")
    comm.allgather(torch.ones(1), "second")
    assert calls == ["hvd_quant.wire.first", "first", "second"]  # once, named after the first
    comm.refresh()  # an elastic reset: every rank checks again
    comm.allgather(torch.ones(1), "third")
    assert calls[-2:] == ["hvd_quant.wire.third", "third"]
    assert comm.meter.bytes_sent == 3 * 4  # the checks are not gradient traffic


# --- placement ----------------------------------------------------------------------------------
def test_the_home_device_is_the_parameters_one(caplog):
    cpu = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    assert home_device(cpu, "x") == (torch.device("cpu"), False)
    assert home_device([], "x") == (torch.device("cpu"), False)
    with pytest.raises(ValueError, match="the CPU and on CUDA GPUs; a parameter is on meta"):
        home_device([torch.nn.Parameter(torch.empty(2, device="meta"))], "x")


def test_optimizers_on_a_device_they_do_not_run_on_are_refused():
    meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    with pytest.raises(ValueError, match="meta"):
        hvd_quant.torch.ZeroOneAdam(meta, lr=1e-3, process_set=FakeProcessSet())


def test_a_verdict_is_read_from_a_tensor_once():
    reads = []

    class Counted(torch.Tensor):
        def __bool__(self):
            reads.append(1)
            return super().__bool__()

    ok = torch.tensor(True).as_subclass(Counted)
    assert truth(ok) and truth(ok) and truth(ok)
    assert len(reads) == 1
    ok.logical_not_()  # changed in place: read again
    assert not truth(ok) and len(reads) == 2
    assert truth(np.bool_(True)) is True and truth(False) is False


def test_the_meter_counts_both_ways():
    m = HostMeter()
    m.to_host, m.to_device, m.payload = 3, 5, 8
    assert m.bytes == 8 and m.snapshot()["payload"] == 8
    m.reset()
    assert m.bytes == 0


def test_fp32_rounds_cross_once_each_way(thread_comms):
    """A 1-bit optimizer's fp32 round (a ring of 2 (n - 1) hops) runs on one host copy of
    the gradient: one staged transfer and 4 bytes per element each way, not a transfer
    per hop; the same bits as the plain ring."""
    def warm_up(m):  # every step an fp32 round
        return hvd_quant.torch.OnebitAdam(m.parameters(), lr=1e-2, freeze_step=100, process_set=FakeProcessSet())

    def body(c):
        comm = set_thread_comm(staged(c))
        model, data = model_and_data(c.rank)
        opt = warm_up(model)
        numel = sum(p.numel() for p in model.parameters())
        per_step = []
        for x, y in data:
            before = comm.host_meter.snapshot()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            after = comm.host_meter.snapshot()
            per_step.append({k: after[k] - before[k] for k in after})
        return numel, per_step, opt.step_kinds, [p.detach().clone() for p in model.parameters()]

    got = ThreadWorld(3).run(body)
    want = train_on_threads(3, warm_up, lambda c: Transport(c, B))
    for r, (numel, per_step, kinds, params) in enumerate(got):
        assert kinds[1:] == ["full"] * (len(kinds) - 1)
        for step in per_step[1:]:  # past the first step's agreement check
            assert step["staged"] == 1 and step["to_host"] == step["to_device"] == 4 * numel, step
        for a, b in zip(params, want[r][0]):
            assert_same(a.numpy(), b.numpy(), f"rank {r}")
