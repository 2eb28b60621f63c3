"""Ring and torus allreduce over the thread-simulated world (numpy oracle)."""

import numpy as np
import pytest

from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.comm import Communicator
from hvd_quant.core.hops import HopOperator
from hvd_quant.core.ring import (FloatSum, IntSum, butterfly_allreduce, chunk_bounds, direct_allreduce,
                                 direct_padded_numel, ring_allreduce, torus_allreduce)
from hvd_quant.core.simulate import CollectiveMismatch, ThreadWorld

B = NumpyBackend()
SIZES = [0, 1, 2, 3, 7, 8, 9, 100, 1001]
TORI = [(2, 2), (2, 3), (3, 2)]


def int_data(n, d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, d).astype(np.int32) for _ in range(n)]


def float_data(n, d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(d).astype(np.float32) for _ in range(n)]


def run_ring(data, op, own_count=1):
    return ThreadWorld(len(data)).run(
        lambda c: ring_allreduce(B, c, data[c.rank], op, "t", None, own_count=own_count))


def run_torus(data, rows, op):
    def body(c):
        row, col = c.subgroups(rows)
        return torus_allreduce(B, row, col, data[c.rank], op, "t", None)
    return ThreadWorld(len(data)).run(body)


@pytest.mark.parametrize("numel", [0, 1, 5, 8, 13, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_chunk_bounds_cover_and_cut_at_units(numel, parts, unit):
    bounds = chunk_bounds(numel, parts, unit)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(start % unit == 0 for start, stop in bounds if stop > start)
    units = [-(-(stop - start) // unit) for start, stop in bounds]
    assert max(units) - min(units) <= 1


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("d", SIZES)
def test_ring_int_sum_is_exact(n, d):
    data = int_data(n, d, seed=n * 100 + d)
    expected = np.sum(data, axis=0, dtype=np.int32) if d else np.zeros(0, np.int32)
    for out in run_ring(data, IntSum()):
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("d", SIZES)
def test_ring_float_sum_matches_and_ranks_agree(n, d):
    data = float_data(n, d, seed=d)
    outs = run_ring(data, FloatSum())
    np.testing.assert_allclose(outs[0], np.sum(np.float64(data), axis=0), rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("rows,cols", TORI)
@pytest.mark.parametrize("d", SIZES)
def test_torus_int_sum_is_exact(rows, cols, d):
    data = int_data(rows * cols, d, seed=d)
    expected = np.sum(data, axis=0, dtype=np.int32) if d else np.zeros(0, np.int32)
    for out in run_torus(data, rows, IntSum()):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("rows,cols", TORI + [(1, 4), (4, 1)])
@pytest.mark.parametrize("d", [0, 3, 100, 1001])
def test_torus_float_sum_matches_and_ranks_agree(rows, cols, d):
    data = float_data(rows * cols, d, seed=d)
    outs = run_torus(data, rows, FloatSum())
    np.testing.assert_allclose(outs[0], np.sum(np.float64(data), axis=0), rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


class CountingSum(HopOperator):
    """Sums and records the counts it was given (to check the counting rule)."""

    unit = 4

    def __init__(self):
        self.calls = []

    def combine(self, B, own, own_count, received, received_count, rng):
        self.calls.append((B.numel(own), own_count, received_count))
        return own + received


@pytest.mark.parametrize("n,own_count", [(3, 1), (4, 2)])
def test_counts_and_units_in_reduce_scatter(n, own_count):
    d = 4 * 10 + 3  # not a multiple of the unit: the last chunk is shorter
    ops = [CountingSum() for _ in range(n)]
    data = int_data(n, d)
    outs = ThreadWorld(n).run(
        lambda c: ring_allreduce(B, c, data[c.rank], ops[c.rank], "t", None, own_count=own_count))
    np.testing.assert_array_equal(outs[0], np.sum(data, axis=0))
    starts = [a for a, _ in chunk_bounds(d, n, 4)]
    assert all(s % 4 == 0 for s in starts)
    for op in ops:
        assert [(o, k) for _, o, k in op.calls] == [(own_count, (s + 1) * own_count)
                                                    for s in range(n - 1)]


@pytest.mark.parametrize("rows,cols", TORI)
def test_torus_counts_rows_then_columns(rows, cols):
    n, d = rows * cols, 4 * 50
    ops = [CountingSum() for _ in range(n)]
    data = int_data(n, d)

    def body(c):
        row, col = c.subgroups(rows)
        return torus_allreduce(B, row, col, data[c.rank], ops[c.rank], "t", None)

    outs = ThreadWorld(n).run(body)
    np.testing.assert_array_equal(outs[-1], np.sum(data, axis=0))
    expected = [(1, s + 1) for s in range(cols - 1)] + [(cols, (s + 1) * cols) for s in range(rows - 1)]
    for op in ops:
        assert [(o, k) for _, o, k in op.calls] == expected


class RecordingComm(Communicator):
    """Wraps a communicator and records every hop: (name, dest, source, bytes sent)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.rank, self.size, self.meter = inner, inner.rank, inner.size, inner.meter
        self.hops = []

    def sendrecv(self, x, dest, source, name, recv_numel=None):
        self.hops.append((name, dest, source, np.asarray(x).nbytes))
        return self.inner.sendrecv(x, dest, source, name, recv_numel)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("d", [0, 2, 9, 1001])
def test_hops_are_named_ring_steps_with_chunk_sizes(n, d):
    data = [np.zeros(d, np.uint8) for _ in range(n)]
    recorders = [None] * n

    def body(c):
        rec = recorders[c.rank] = RecordingComm(c)
        return ring_allreduce(B, rec, data[c.rank], IntSum(), "x", None)

    ThreadWorld(n).run(body)
    sizes = [b - a for a, b in chunk_bounds(d, n)]
    for r, rec in enumerate(recorders):
        names = [h[0] for h in rec.hops]
        assert names == [f"x.rs{s}" for s in range(n - 1)] + [f"x.ag{s}" for s in range(n - 1)]
        assert all(h[1] == (r + 1) % n and h[2] == (r - 1) % n for h in rec.hops)
        sent = [h[3] for h in rec.hops]
        assert sent == [sizes[(r - s) % n] for s in range(n - 1)] + \
                       [sizes[(r + 1 - s) % n] for s in range(n - 1)]
        assert rec.meter.bytes_sent == sum(sent)
    total = sum(rec.meter.bytes_sent for rec in recorders)
    assert total == 2 * (n - 1) * d  # i.e. 2 (n-1)/n * d per rank on average


def test_split_groups_check_collectives_within_each_group():
    def body(c):
        sub = c.split(color=c.rank % 2, key=-c.rank)  # reversed order inside each group
        total = sub.allreduce(np.array([c.rank]), "sum", "s")
        return sub.rank, sub.size, int(total[0])

    out = ThreadWorld(5).run(body)
    assert out == [(2, 3, 6), (1, 2, 4), (1, 3, 6), (0, 2, 4), (0, 3, 6)]

    def mismatch(c):
        row, _ = c.subgroups(2)
        # Row 1 disagrees on a name; row 0 is fine, so the error must not hang it.
        row.sendrecv(np.zeros(1), (row.rank + 1) % row.size, (row.rank - 1) % row.size,
                     "bad" if c.rank == 3 else "ok")
        c.allreduce(np.zeros(1), "sum", "after")

    with pytest.raises(CollectiveMismatch):
        ThreadWorld(4, timeout=10).run(mismatch)


def test_subgroups_layout_and_shared_meter():
    def body(c):
        row, col = c.subgroups(2)
        assert c.subgroups(2) == (row, col)  # cached, no new groups
        row.sendrecv(np.zeros(3, np.uint8), (row.rank + 1) % row.size,
                     (row.rank - 1) % row.size, "h")
        return row.rank, row.size, col.rank, col.size, c.meter.bytes_sent

    out = ThreadWorld(6).run(body)
    assert out == [(r % 3, 3, r // 3, 2, 3.0) for r in range(6)]
    with pytest.raises(ValueError):
        ThreadWorld(6).run(lambda c: c.subgroups(4))


# --- butterfly and direct allreduce ---------------------------------------------------------
def run_topology(data, op, topology):
    fn = {"butterfly": butterfly_allreduce, "direct": direct_allreduce}[topology]
    return ThreadWorld(len(data)).run(lambda c: fn(B, c, data[c.rank], op, "t", None))


@pytest.mark.parametrize("topology,n", [("butterfly", 1), ("butterfly", 2), ("butterfly", 4),
                                        ("butterfly", 8), ("direct", 1), ("direct", 2),
                                        ("direct", 3), ("direct", 5), ("direct", 8)])
@pytest.mark.parametrize("d", SIZES)
def test_butterfly_and_direct_int_sum_is_exact(topology, n, d):
    data = int_data(n, d, seed=n * 100 + d)
    expected = np.sum(data, axis=0, dtype=np.int32) if d else np.zeros(0, np.int32)
    for out in run_topology(data, IntSum(), topology):
        assert out.dtype == np.int32 and out.shape == (d,)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("topology,n", [("butterfly", 4), ("butterfly", 8), ("direct", 3), ("direct", 6)])
def test_butterfly_and_direct_float_sum_match_and_ranks_agree(topology, n):
    data = float_data(n, 1001, seed=n)
    outs = run_topology(data, FloatSum(), topology)
    np.testing.assert_allclose(outs[0], np.sum(data, axis=0), rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_butterfly_refuses_other_world_sizes():
    with pytest.raises(ValueError, match="power-of-two"):
        run_topology(int_data(3, 10), IntSum(), "butterfly")


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("d", [0, 3, 9, 1001])
def test_butterfly_hops_pair_ranks_and_send_the_rings_bytes(n, d):
    """2 log2 n hops named by step, each with the partner ``r ^ 2**k``; the same bytes in
    total as a ring; every fold meets two chunks of equal counts."""
    ops = [CountingSum() for _ in range(n)]
    ops_unit1 = [IntSum() for _ in range(n)]
    data = [np.zeros(d, np.uint8) for _ in range(n)]
    recorders = [None] * n

    def body(c):
        rec = recorders[c.rank] = RecordingComm(c)
        return butterfly_allreduce(B, rec, data[c.rank], ops_unit1[c.rank], "x", None)

    ThreadWorld(n).run(body)
    steps = n.bit_length() - 1
    for r, rec in enumerate(recorders):
        assert [h[0] for h in rec.hops] == ([f"x.bf.rs{k}" for k in range(steps)]
                                            + [f"x.bf.ag{k}" for k in reversed(range(steps))])
        partners = [r ^ (1 << k) for k in range(steps)]
        assert [h[1] for h in rec.hops] == partners + partners[::-1]
        assert all(h[1] == h[2] for h in rec.hops)
    assert sum(rec.meter.bytes_sent for rec in recorders) == 2 * (n - 1) * d
    idata = int_data(n, 4 * 37 + 3)
    ThreadWorld(n).run(lambda c: butterfly_allreduce(B, c, idata[c.rank], ops[c.rank], "y", None))
    for op in ops:
        assert [(o, k) for _, o, k in op.calls] == [(2 ** k, 2 ** k) for k in range(steps)]


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("d", [0, 7, 1001])
def test_direct_is_one_alltoall_and_one_allgather_of_the_padded_wire(n, d):
    padded = direct_padded_numel(d, n)
    assert padded % n == 0 and d <= padded < d + n
    data = [np.zeros(d, np.uint8) for _ in range(n)]
    meters = ThreadWorld(n).run(lambda c: (direct_allreduce(B, c, data[c.rank], IntSum(), "x", None),
                                           dict(c.meter.by_kind))[1])
    for by_kind in meters:
        assert set(by_kind) <= {"alltoall", "allgather"}
        if n > 1 and d:
            assert by_kind["alltoall"] == pytest.approx((n - 1) / n * padded)
            assert by_kind["allgather"] == pytest.approx((n - 1) * padded / n)


@pytest.mark.parametrize("n", [2, 3])
def test_the_fp32_round_is_the_rings_mean_bit_for_bit_and_at_2_ranks_one_allreduce(n):
    """``full_precision_mean`` (the 1-bit optimizers' fp32 rounds) gives every rank the ring's
    bits, signed zeros, subnormals and overflow included. At 2 ranks it is one allreduce
    (no hop: Horovod's 2-rank hops through Gloo's alltoallv sometimes ran one way at a time),
    from 3 ranks on the ring's hops, with the same bytes either way."""
    from hvd_quant.optimizers.base import full_precision_bytes, full_precision_mean

    rng = np.random.default_rng(n)
    edges = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 1.0, -1.0], np.float32)
    data = [np.concatenate([(rng.standard_normal(1001) * 10.0 ** rng.integers(-40, 38, 1001)).astype(np.float32),
                            rng.permutation(edges)]) for _ in range(n)]
    ring = [out * np.float32(1.0 / n) for out in run_ring(data, FloatSum())]

    def body(c):
        return full_precision_mean(B, c, data[c.rank], "g"), dict(c.meter.by_kind)

    for (mean, sent), want in zip(ThreadWorld(n).run(body), ring):
        assert mean.dtype == np.float32
        np.testing.assert_array_equal(mean.view(np.uint32), want.view(np.uint32))
        assert set(sent) == ({"allreduce"} if n == 2 else {"sendrecv"})
        # the ring's chunks differ by up to one element: up to 4 bytes more on each of 2 (n - 1) hops
        assert sum(sent.values()) == pytest.approx(full_precision_bytes(data[0].size, n), abs=8 * (n - 1))
