"""The cost model's collectives against what the code issues, counted on a ThreadWorld."""

import numpy as np
import pytest

import hvd_quant
from hvd_quant.core import costmodel
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.comm import Communicator
from hvd_quant.core.costmodel import Collective, LinkModel, collectives, predict, wire_bytes
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.optimizers.binsgdm import BinSGDMRule
from hvd_quant.optimizers.onebit_adam import OnebitAdamRule
from hvd_quant.optimizers.oracle import OracleOptimizer
from hvd_quant.optimizers.zero_one_adam import ZeroOneAdamRule

B = NumpyBackend()


class RecordingComm(Communicator):
    """A rank's communicator that records every collective (kind, bytes passed in, ranks)
    and forwards it; torus and node groups are routed through its own hops, as under
    Horovod without registered process sets. Sums integers as torch's Horovod does."""

    allreduce_int_dtypes = ("int32", "int64")

    def __init__(self, inner, ranks_per_node=None):
        super().__init__()
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.meter = inner.meter
        self._k = ranks_per_node
        self.log = []

    def ranks_per_node(self):
        return self._k

    def _rec(self, kind, x):
        self.log.append((kind, float(np.asarray(x).nbytes), self.size))

    def allreduce(self, x, op, name):
        self._rec("allreduce", x)
        return self.inner.allreduce(x, op, name)

    def allgather(self, x, name):
        self._rec("allgather", x)
        return self.inner.allgather(x, name)

    def alltoall(self, x, name):
        self._rec("alltoall", x)
        return self.inner.alltoall(x, name)

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        self._rec("sendrecv", x)
        return self.inner.sendrecv(x, dest, source, name, recv_numel)


def segments_of(d, S):
    sizes = costmodel._even_sizes(d, S)
    return [(f"t{i}", c) for i, c in enumerate(sizes)]


def recorded_compressor(method, d, n, k, S, options):
    """The collectives of the second reduction (the first creates state) of a ``d``-element
    buffer of ``S`` tensors, on every rank."""
    comp = hvd_quant.get(method, **options)
    segments = segments_of(d, S)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]

    def body(c):
        rec = RecordingComm(c, k)
        runner = CompressorRunner(comp, B)
        runner.reduce(xs[c.rank], rec, "g", segments)
        rec.log.clear()
        runner.reduce(xs[c.rank], rec, "g", segments)
        return rec.log
    return ThreadWorld(n).run(body)


def model_list(method, d, n, k, S, options, rank=0):
    return [(c.kind, float(c.nbytes), c.ranks) for c in collectives(method, d, n, k, S, options, rank)]


CASES = [(2, None), (3, None), (4, 2), (5, None), (6, 3), (8, None), (8, 2)]


@pytest.mark.parametrize("method,options", [
    ("none", {}), ("fp16", {}), ("ef_sign", {}), ("marsit", {}), ("marsit", {"topology": "ring"}),
    ("marsit", {"topology": "direct"}), ("cascading_sign", {}), ("global_qsgd", {}),
    ("global_qsgd", {"norm": "l2"}), ("global_qsgd_exp", {}), ("onebit", {})])
@pytest.mark.parametrize("n,k", CASES)
@pytest.mark.parametrize("d,S", [(4097, 3)])
def test_compressor_collectives_match_the_code(method, options, n, k, d, S):
    for r, log in enumerate(recorded_compressor(method, d, n, k, S, options)):
        assert log == model_list(method, d, n, k, S, options, r)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_marsit_butterfly_collectives_match_the_code(n):
    options = {"topology": "butterfly"}
    for r, log in enumerate(recorded_compressor("marsit", 999, n, None, 2, options)):
        assert log == model_list("marsit", 999, n, None, 2, options, r)


@pytest.mark.parametrize("rows,n", [(2, 4), (2, 6), (3, 6), (2, 8)])
def test_marsit_torus_collectives_match_the_code(rows, n):
    options = {"topology": "torus", "torus_rows": rows}
    for r, log in enumerate(recorded_compressor("marsit", 1003, n, None, 2, options)):
        assert log == model_list("marsit", 1003, n, None, 2, options, r)


HP = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
RULES = {
    "onebit_adam": lambda k: OnebitAdamRule(freeze_step=1),
    "zero_one_adam": lambda k: ZeroOneAdamRule(var_freeze_step=1),
    "binsgdm": lambda k: BinSGDMRule(ranks_per_node=k),
}


@pytest.mark.parametrize("method", sorted(RULES))
@pytest.mark.parametrize("n,k", [(2, None), (3, None), (4, 2), (6, 2), (6, 3), (8, None)])
def test_optimizer_collectives_match_the_code(method, n, k):
    """A 1-bit step (after the warm-up: 1-bit Adam's freeze step, 0/1 Adam's variance
    freeze; every BinSGDM step) issues what the model lists for one parameter group."""
    sizes = [300, 77, 1000]
    d = sum(sizes)
    hp = dict(HP, betas=(0.9,)) if method == "binsgdm" else HP
    rng = np.random.default_rng(1)
    gs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]

    def body(c):
        rec = RecordingComm(c, k)
        opt = OracleOptimizer(RULES[method](k), np.zeros(d, np.float32), rec, hp, counts=sizes)
        for _ in range(3):
            rec.log.clear()
            opt.step(gs[c.rank], 1e-3)
        return rec.log, opt.state.kinds[-1]

    model = model_list(method, d, n, k, len(sizes), {"tensor_sizes": sizes})
    for log, kind in ThreadWorld(n).run(body):
        assert kind == "onebit"
        assert log == model


def test_wire_bytes_equal_the_compressors_own_model():
    for n in (2, 5, 16, 64):
        for method in ("none", "fp16", "ef_sign", "onebit", "global_qsgd", "global_qsgd_exp"):
            comp = hvd_quant.get(method)  # its model is the mean over ranks (ring chunks differ)
            mean = np.mean([wire_bytes(collectives(method, 10_000, n, rank=r)) for r in range(n)])
            assert mean == pytest.approx(comp.wire_bytes(10_000, n))
        comp = hvd_quant.get("marsit")
        layout = comp.layout(costmodel._Layout(n, None))
        assert wire_bytes(collectives("marsit", 10_000, n)) == pytest.approx(
            comp.wire_bytes(10_000, n, layout=layout))


def test_time_adds_latency_bytes_and_memory():
    link = LinkModel(1e9, latency0=dict.fromkeys(costmodel.KINDS, 1e-3),
                     latency1=dict.fromkeys(costmodel.KINDS, 1e-4),
                     efficiency=dict(costmodel.EMULATED_EFFICIENCY), memory_bps=10e9)
    c = Collective("allgather", 1000.0, 8)
    assert link.collective_s(c) == pytest.approx(1e-3 + 7e-4 + 8 * 7000 / (0.5 * 1e9))
    p = predict("ef_sign", 80_000, 8, link)
    want = link.collective_s(Collective("allgather", 10_004.0, 8))
    assert p["comm_s"] == pytest.approx(want)
    assert p["memory_s"] == pytest.approx(costmodel.memory_bytes("ef_sign", 80_000, 8) / 10e9)
    assert p["collectives"] == 1
    # Overlapped collectives add bytes, not time: Marsit's scale gather beside its ring.
    ring = collectives("marsit", 80_000, 3, options={"topology": "ring"})
    assert ring[0].overlapped and costmodel.comm_seconds(ring, link) == pytest.approx(
        sum(link.collective_s(x) for x in ring[1:]))


def test_flat_methods_and_crossover():
    d = 10_000_000
    flat = costmodel.flat_methods(64, d)
    assert "onebit" in flat and "marsit" in flat and "global_qsgd" in flat
    assert "ef_sign" not in flat and "binsgdm" not in flat  # (n-1) d / 8 > 4 d at 64
    assert "ef_sign" in costmodel.flat_methods(8, d)
    link = LinkModel.datacenter(1e9)
    n, faster = costmodel.crossover_ranks("ef_sign", 124_000_000, link)
    assert faster and n is not None and 16 <= n <= 128
    n, faster = costmodel.crossover_ranks("onebit", 124_000_000, link, ranks=[2, 4, 8, 16, 32, 64])
    assert faster and n is None  # flat in bytes: still ahead at 64 ranks


def test_link_model_round_trips_and_refuses_unknown_methods():
    link = LinkModel.datacenter(10e9)
    assert LinkModel.from_dict(link.to_dict()) == link
    with pytest.raises(ValueError, match="does not know"):
        collectives("topk", 10, 4)
