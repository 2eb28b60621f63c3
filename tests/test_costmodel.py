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
    sizes = costmodel.even_sizes(d, S)
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
    ("global_qsgd", {"norm": "l2"}), ("global_qsgd", {"block": 512}),
    ("global_qsgd", {"norm": "l2", "block": 1000}), ("global_qsgd_exp", {}), ("onebit", {})])
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


@pytest.mark.parametrize("d,n,k,options", [
    (20_000, 3, None, {}),                                 # ring
    (300_000, 6, None, {}),                                # direct (beyond the gather rule)
    (20_000, 6, None, {}),                                 # gather
    (20_000, 6, None, {"topology": "torus", "torus_rows": 2}),
    (20_000, 4, None, {"topology": "butterfly"}),
    (300_000, 8, 2, {})])
def test_cascade_fold_bytes_count_the_combines_the_code_makes(monkeypatch, d, n, k, options):
    """The model's cascade folds against the combines each rank really makes: the float32
    rule over (n - 1) / n of the elements, or the gather layout's n - 1 bitwise selections
    of whole rows."""
    import threading
    from hvd_quant.compressors import marsit
    from hvd_quant.core.packing import packed_sign_bytes

    counts, lock = {}, threading.Lock()

    def counting(cls, slot):  # per rank (its thread): [elements combined, bitwise selections]
        inner = cls.combine

        def combine(self, B_, own, *rest):
            with lock:
                row = counts.setdefault(threading.get_ident(), [0, 0])
                row[slot] += 8 * B_.numel(own) if slot == 0 else 1
            return inner(self, B_, own, *rest)
        monkeypatch.setattr(cls, "combine", combine)
    counting(marsit.CascadingSign, 0)
    counting(marsit._ShippedTies, 1)
    recorded_compressor("cascading_sign", d, n, k, 2, options)  # two reductions per rank
    elements = [row[0] / 2 for row in counts.values()]
    selections = [row[1] / 2 for row in counts.values()]
    model = marsit.cascade_fold_bytes(d, n, k, 2, options)
    if any(selections):
        assert not any(elements) and selections == [n - 1] * n
        assert model == 4.0 * (n - 1) * packed_sign_bytes(d)
    else:
        # Chunks are whole bytes (and padded to n of them in the direct layout).
        assert np.mean(elements) == pytest.approx(d * (n - 1) / n, rel=2 * n * 8 * n / d)
        assert model == pytest.approx(marsit.CASCADE_COMBINE_BYTES * np.mean(elements), rel=2 * n * 8 * n / d)


def test_predict_charges_the_cascade_folds_of_the_topology_asked_for():
    """``predict``'s memory term takes the method's options: ``cascading_sign`` on an
    explicit torus folds float32 chunks, where ``auto`` would gather a buffer this small
    and fold bits (about 12x fewer bytes of a copy)."""
    link = LinkModel(1e9, latency0=dict.fromkeys(costmodel.KINDS, 1e-3),
                     latency1=dict.fromkeys(costmodel.KINDS, 1e-4),
                     efficiency=dict(costmodel.EMULATED_EFFICIENCY), memory_bps=10e9)
    torus = {"topology": "torus", "torus_rows": 2}
    p = predict("cascading_sign", 20_000, 6, link, buckets=[20_000], options=torus)
    on_torus = costmodel.memory_bytes("cascading_sign", 20_000, 6, options=torus)
    assert p["memory_s"] == pytest.approx(on_torus / 10e9)
    assert on_torus > 10 * costmodel.memory_bytes("cascading_sign", 20_000, 6)


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
        layout = comp.buffer_layout(costmodel._Layout(n, None), 10_000)
        assert wire_bytes(collectives("marsit", 10_000, n)) == pytest.approx(
            comp.wire_bytes(10_000, n, layout=layout))


def test_time_adds_latency_bytes_and_memory():
    link = LinkModel(1e9, latency0=dict.fromkeys(costmodel.KINDS, 1e-3),
                     latency1=dict.fromkeys(costmodel.KINDS, 1e-4),
                     efficiency=dict(costmodel.EMULATED_EFFICIENCY), memory_bps=10e9)
    c = Collective("allgather", 1000.0, 8)
    share = costmodel.EMULATED_EFFICIENCY["allgather"]
    assert link.collective_s(c) == pytest.approx(1e-3 + 7e-4 + 8 * 7000 / (share * 1e9))
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


# --- the warning at start -----------------------------------------------------------------------
class _FakeComm:
    def __init__(self, rank, size, k=None):
        self.rank, self.size, self._k = rank, size, k

    def ranks_per_node(self):
        return self._k


def test_scale_warning_names_the_flat_methods_once_on_rank_zero(caplog):
    from hvd_quant.core import scale_check

    class Owner:
        pass

    d = 1_000_000
    assert scale_check.excess("ef_sign", d, 30) is None       # (n-1)/8 vs 2 (n-1)/n * 4: n/64
    assert scale_check.excess("ef_sign", d, 40) is not None
    assert scale_check.excess("onebit", d, 1024) is None      # flat in bytes
    # A small model: the bytes do not matter beside a collective's latency (and onebit
    # and Marsit gather such a buffer on purpose from 5 ranks on).
    assert all(scale_check.excess(m, 30_000, 64) is None for m in ("ef_sign", "marsit", "onebit"))
    for baseline in ("none", "fp16"):                          # fp32 (fp16) itself: nothing to lose
        assert all(scale_check.excess(baseline, d, n) is None for n in (2, 16, 1024))
    owner = Owner()
    with caplog.at_level("WARNING", logger="hvd_quant"):
        text = scale_check.warn_once(owner, "ef_sign", _FakeComm(0, 64), d)
        assert scale_check.warn_once(owner, "ef_sign", _FakeComm(0, 64), d) is None  # once per owner
        assert scale_check.warn_once(Owner(), "ef_sign", _FakeComm(3, 64), d) is None  # rank 0 only
        assert scale_check.warn_once(Owner(), "marsit", _FakeComm(0, 64), d) is None  # flat
        assert scale_check.warn_once(Owner(), "none", _FakeComm(0, 16), d) is None  # the baseline
    assert len(caplog.records) == 1 and caplog.records[0].getMessage() == text
    assert "ef_sign sends" in text and "at 64 ranks" in text
    flat = text.split("stay flat here: ")[1]
    for m in ("marsit", "onebit", "global_qsgd", "onebit_adam"):
        assert m in flat
    assert "ef_sign" not in flat and "binsgdm" not in flat


def test_scale_warning_from_a_runner_and_a_rule(caplog):
    """The hooks: a compressor's runner warns at its first reduction (every adapter's
    compressors go through CompressorRunner.context), a 1-bit optimizer's rule when the
    adapter sets it up (Rule.check_scale); the hierarchy BinSGDM follows counts."""
    n, d = 40, 400_000  # large enough that the bytes matter (scale_check.excess)
    xs = [np.ones(d, np.float32) for _ in range(n)]
    runners = [CompressorRunner(hvd_quant.get("ef_sign"), B) for _ in range(n)]

    def body(c):
        for _ in range(2):
            runners[c.rank].reduce(xs[c.rank], c, "g", [("w", d)])
    with caplog.at_level("WARNING", logger="hvd_quant"):
        ThreadWorld(n).run(body)
    assert [r.getMessage().split(" sends")[0] for r in caplog.records] == ["hvd_quant: ef_sign"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hvd_quant"):
        assert BinSGDMRule().check_scale(_FakeComm(0, 64), 10**6) is not None       # flat allgather
        assert BinSGDMRule(ranks_per_node=8).check_scale(_FakeComm(0, 64), 10**6) is None  # hierarchy
        assert OnebitAdamRule().check_scale(_FakeComm(0, 1024), 10**6) is None
    assert len(caplog.records) == 1 and "binsgdm sends" in caplog.records[0].getMessage()


# --- Compression.auto ---------------------------------------------------------------------------
from hvd_quant.compressors.auto import AutoCompressor, choose, link_from_timings, local_timings  # noqa: E402


def _link(rate_bps, latency_s, memory_bps=20e9):
    return LinkModel(rate_bps, dict.fromkeys(costmodel.KINDS, latency_s), dict.fromkeys(costmodel.KINDS, 0.0),
                     dict(costmodel.EMULATED_EFFICIENCY), memory_bps)


def test_auto_choice_follows_the_model_on_made_up_links():
    d, T = 3_685_632, 101
    # A slow link: 1-bit methods; flat in bytes beats the allgather at 16 ranks.
    best, predicted = choose(("ef_sign", "marsit", "onebit"), d, 16, _link(1e8, 20e-3), segments=T)
    assert best in ("marsit", "onebit") and predicted["none"] > 5 * predicted[best]
    assert predicted["ef_sign"] > predicted[best]
    # At 2 ranks the allgather sends as little as any: with every kind at the same share of
    # the rate, ef_sign's single collective wins; where the allgather reaches half the
    # rate and hops 0.9 of it, Marsit's two hops do.
    even = _link(1e8, 20e-3)
    even.efficiency = dict.fromkeys(costmodel.KINDS, 0.9)
    assert choose(("ef_sign", "marsit", "onebit"), d, 2, even, segments=T)[0] == "ef_sign"
    even.efficiency["allgather"] = 0.5
    assert choose(("ef_sign", "marsit", "onebit"), d, 2, even, segments=T)[0] == "marsit"
    # A small bucket stays fp32 where the methods need two collectives or more (at 4
    # ranks: onebit's two stages, Marsit's ring): their latency outweighs the bytes saved
    # (ef_sign's one allgather still pays for itself). From 5 ranks on such a bucket goes
    # by one allgather in both (core.ring.gathers), and is theirs again.
    assert choose(("marsit", "onebit"), 2000, 4, _link(1e8, 20e-3))[0] == "none"
    assert choose(("marsit", "onebit"), 2000, 16, _link(1e8, 20e-3))[0] == "marsit"
    assert choose(("global_qsgd", "global_qsgd_exp"), 2000, 16, _link(1e8, 20e-3))[0] == "none"
    assert choose(("ef_sign", "marsit", "onebit"), 2000, 16, _link(1e8, 20e-3))[0] == "ef_sign"
    # A fast link and slow memory: the compressors' passes cost more than the wire saves.
    assert choose(("ef_sign", "marsit", "onebit"), d, 16, _link(100e9, 1e-4, memory_bps=2e9))[0] == "none"
    # The unbiased family, at 1 Gbit/s: Global-QSGD's integers.
    assert choose(("global_qsgd", "global_qsgd_exp"), d, 8, _link(1e9, 1e-3))[0].startswith("global_qsgd")
    # Exponential dithering stops at 104 ranks: not a candidate beyond.
    assert "global_qsgd_exp" not in choose(("global_qsgd", "global_qsgd_exp"), d, 128, _link(1e9, 1e-3))[1]


def test_link_from_timings():
    share = costmodel.EMULATED_EFFICIENCY["allreduce"]
    link = link_from_timings(0.01, 0.01 + 2 * 3 / 4 * 2 ** 20 * 8 / (share * 1e8), 0.004, 4)
    assert link.rate_bps == pytest.approx(1e8)
    assert link.latency("alltoall", 16) == pytest.approx(0.01)
    assert link.memory_bps == pytest.approx(2 * 16 * 2 ** 20 / 0.004)


def test_a_slow_fp16_sum_is_measured_and_priced():
    """Gloo without GLOO_USE_AVX sums fp16 in software: the fp16 probe's excess over the fp32
    probe of the same bytes becomes a cost per byte summed, which only fp16's allreduces pay,
    and which can take ``fp16`` out of the running on a fast link."""
    n, probe = 2, 0.0005
    summed = (n - 1) / n * 2 ** 20
    link = link_from_timings(0.0002, probe, 0.002, n, probe16_s=3 * probe)
    assert link.sum_s_per_byte == {"float16": pytest.approx(2 * probe / summed)}
    assert link_from_timings(0.0002, probe, 0.002, n, probe16_s=0.5 * probe).sum_s_per_byte == {"float16": 0.0}
    assert link_from_timings(0.0002, probe, 0.002, n).sum_s_per_byte == {}
    plain = link_from_timings(0.0002, probe, 0.002, n)
    half = costmodel.Collective("allreduce", 1e6, n, dtype="float16")
    assert link.collective_s(half) - plain.collective_s(half) == pytest.approx(2 * probe / summed * 0.5e6)
    for c in (costmodel.Collective("allreduce", 1e6, n), costmodel.Collective("allgather", 1e6, n, dtype="float16")):
        assert link.collective_s(c) == plain.collective_s(c)
    family = ("fp16", "global_qsgd", "global_qsgd_exp")
    assert choose(family, 400_000, n, plain)[0] == "fp16"  # about 29 Gbit/s: fp16's fewer passes win
    assert choose(family, 400_000, n, link)[0] != "fp16"
    assert LinkModel.from_dict(link.to_dict()) == link
    assert link.with_rate(1e9).sum_s_per_byte == link.sum_s_per_byte


class _Timed16(AutoCompressor):
    """Made-up timings with an fp16 probe three times the fp32 one on the slowest rank."""

    def _local_timings(self, B, comm):
        return [0.0002, 0.0005, 0.002, 0.0005 * (1 + 2 * (comm.rank == 1))]


def test_auto_prices_the_fp16_sum_every_rank_measured():
    """The fp16 probe travels with the other timings; the slowest rank's makes every rank's
    link, so every rank leaves fp16 out alike; without it fp16 would be chosen."""
    n, x = 2, np.ones(400_000, np.float32)

    def run(cls):
        comps = [cls("no_feedback") for _ in range(n)]
        return ThreadWorld(n).run(lambda c: (CompressorRunner(comps[c.rank], B, seed=3).reduce(
            x, c, "b", [("b", x.size)]), comps[c.rank].choices(c))[1])

    slow = run(_Timed16)
    assert slow[0] == slow[1] and slow[0]["b"] != "fp16"
    assert run(_Timed3)[0] == {"b": "fp16"}


class _Timed3(AutoCompressor):
    def _local_timings(self, B, comm):
        return [0.0002, 0.0005, 0.002]


def test_the_fp16_probe_runs_only_for_families_with_fp16():
    """``local_timings`` times fp16 allreduces only when asked; auto asks only where fp16
    is a candidate. Its collectives are named, as every rank issues them."""
    names = {}

    def body(c):
        comm = _Recording(c)
        with_fp16 = local_timings(B, comm, fp16=True)
        names[c.rank] = comm.names
        return len(with_fp16), len(local_timings(B, _Recording(c)))

    assert ThreadWorld(2).run(body) == [(4, 3), (4, 3)]
    assert names[0] == names[1]
    assert [k for k in names[0] if ".fp16" in k] == [f"hvd_quant.auto.fp16{i}" for i in range(3)]
    assert AutoCompressor("onebit_ef").candidates.count("fp16") == 0
    assert "fp16" in AutoCompressor("no_feedback").candidates


class _Recording:
    """A communicator that records the names of its allreduces."""

    def __init__(self, comm):
        self.comm, self.names = comm, []

    def allreduce(self, x, op, name):
        self.names.append(name)
        return self.comm.allreduce(x, op, name)


class _Timed(AutoCompressor):
    """Rank-dependent made-up timings instead of measured ones."""

    def _local_timings(self, B, comm):
        return [0.001 * (1 + comm.rank), 0.05 * (1 + comm.rank), 0.002]


@pytest.mark.parametrize("family", ["onebit_ef", "unbiased", "any"])
def test_auto_agrees_on_every_rank_and_runs_the_chosen_method(family):
    """Ranks time differently; the gathered slowest timings make one link for all, so every
    rank chooses alike, and each bucket's result is the chosen method's, state and all."""
    n = 4
    comps = [_Timed(family) for _ in range(n)]
    sizes = {"small": 64, "large": 400_000}
    rng = np.random.default_rng(2)
    xs = {k: [rng.standard_normal(d).astype(np.float32) for _ in range(n)] for k, d in sizes.items()}

    def body(c):
        runner = CompressorRunner(comps[c.rank], B, seed=3)
        outs = {k: runner.reduce(xs[k][c.rank], c, k, [(k, d)]) for k, d in sizes.items()}
        return comps[c.rank].choices(c), outs, runner.state_dict()

    results = ThreadWorld(n).run(body)
    choices = results[0][0]
    assert all(r[0] == choices for r in results)
    assert set(choices) == set(sizes)
    # The link of the slowest rank's timings (rank 3), and the model's choice on it.
    link = link_from_timings(0.004, 0.2, 0.002, n)
    for k, d in sizes.items():
        assert choices[k] == choose(comps[0].candidates, d, n, link, segments=1)[0]
    alone = ThreadWorld(n).run(lambda c: {k: CompressorRunner(hvd_quant.get(choices[k]), B, seed=3).reduce(
        xs[k][c.rank], c, k, [(k, d)]) for k, d in sizes.items()})
    for r in range(n):
        for k in sizes:
            np.testing.assert_array_equal(results[r][1][k], alone[r][k])
    with pytest.raises(ValueError, match="family"):
        AutoCompressor("biased")


class _Unmeasured(AutoCompressor):
    def _measure(self, B, comm):
        raise AssertionError("measured the link although it was given")


def test_auto_with_a_given_link_chooses_on_it_without_measuring():
    """``link=``: no timing collectives; the choice is the model's on those figures, in
    every run; the link is part of the options the ranks compare."""
    n, link = 3, _link(1e8, 1e-3)
    comps = [_Unmeasured("onebit_ef", link=link) for _ in range(n)]
    x = np.ones(400_000, np.float32)

    def body(c):
        CompressorRunner(comps[c.rank], B, seed=3).reduce(x, c, "big", [("big", x.size)])
        return comps[c.rank].choices(c)

    results = ThreadWorld(n).run(body)
    want = choose(comps[0].candidates, x.size, n, link, segments=1)[0]
    assert all(r == {"big": want} for r in results) and want != "none"
    assert comps[0].options() != AutoCompressor("onebit_ef").options()
    assert comps[0].options() == AutoCompressor("onebit_ef", link=_link(1e8, 1e-3)).options()
    with pytest.raises(ValueError, match="LinkModel"):
        AutoCompressor(link=1e9)
    # A handle's config (Keras get_config) is JSON and rebuilds the same compressor.
    import json
    from hvd_quant.torch import Compression
    handle = Compression.get("auto", family="onebit_ef", link=link)
    config = json.loads(json.dumps(handle.config()))
    again = Compression.get(config["name"], seed=config["seed"], **config["options"])
    assert again.algorithm.options() == handle.algorithm.options() == comps[0].options()
