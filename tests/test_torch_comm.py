"""The torch communicators in one process: how an alltoall is cut into pieces
(:func:`~hvd_quant.core.comm.alltoall_pieces`), against a fake 2-rank Horovod. The same
pieces over real ranks, 2 and 3 of them: tests/test_multiprocess.py
(``test_torch_alltoall_in_pieces_is_the_whole_alltoall``, Horovod) and
tests/test_ddp_hooks.py (``torch.distributed``)."""

import pytest
import torch

from hvd_quant.core import comm as core_comm
from hvd_quant.torch import comm as tcomm

from test_staging import Set2


@pytest.mark.parametrize("piece_bytes, share, element_size, want", [
    (16, 16, 4, None),                     # exactly 4 pieces' worth: whole
    (16, 17, 4, [(0, 4), (4, 8), (8, 12), (12, 16), (16, 17)]),
    (16, 70, 1, [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]),
    (0, 10 ** 6, 4, None),                 # 0: never in pieces
    (2, 100, 4, None),                     # a piece smaller than one element: whole
])
def test_pieces_cover_each_share_once(piece_bytes, share, element_size, want, monkeypatch):
    monkeypatch.setattr(core_comm, "PIECE_BYTES", piece_bytes)
    assert core_comm.alltoall_pieces(2 * share, 2, element_size) == want
    assert core_comm.alltoall_pieces(share, 1, element_size) is None  # one rank sends nothing


def test_the_default_piece_is_1_mib_above_4_mib_a_peer():
    assert core_comm.PIECE_BYTES == 1 << 20 and core_comm.SPLIT_ABOVE == 4
    assert core_comm.alltoall_pieces(2 * (1 << 20), 2, 4) is None             # 4 MiB to each peer
    assert len(core_comm.alltoall_pieces(2 * (1 << 20) + 2, 2, 4)) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("wait", ["sync", "async"])
def test_an_alltoall_in_pieces_gives_the_whole_ones_result(dtype, wait, monkeypatch):
    """Rank 0 of 2; the fake peer sends its input plus 100. Each piece takes the same
    columns of both shares; the result is rank 0's share of both inputs, in rank order,
    whatever the piece size, with the bytes counted once."""
    calls = []

    def alltoall(x, name, process_set):
        calls.append((name, x.numel()))
        mine = x.view(2, -1)[0]  # what this rank keeps, and what the peer sends it (+100)
        return torch.cat([mine, mine + 100]), torch.tensor([mine.numel()] * 2)

    import horovod.torch as hvd
    monkeypatch.setattr(hvd, "alltoall_async", alltoall)
    monkeypatch.setattr(tcomm, "wait_for", lambda result: result)
    monkeypatch.setattr(tcomm.HorovodTorchComm, "in_pieces", True)  # as with Horovod as released
    x = torch.arange(2 * 37, dtype=torch.int64).to(dtype)
    want = torch.cat([x[:37], x[:37] + 100])
    results, metered = {}, {}
    for piece in (0, 32):  # whole; 32-byte pieces (37 float32: 5 pieces, 37 uint8: whole)
        monkeypatch.setattr(core_comm, "PIECE_BYTES", piece)
        comm = tcomm.HorovodTorchComm(Set2(), wire="host")
        comm._wire_checked = True  # the wire check is another test's
        calls.clear()
        results[piece] = comm.alltoall(x, "t") if wait == "sync" else comm.alltoall_async(x, "t").wait()
        metered[piece] = comm.meter.bytes_sent
        names = [name for name, _ in calls]
        if dtype == torch.float32 and piece:
            assert names == [f"t.piece{i}" for i in range(5)]
            assert [n for _, n in calls] == [2 * 8] * 4 + [2 * 5]
        else:
            assert names == ["t"]
    for got in results.values():
        assert got.dtype == dtype and torch.equal(got, want)
    assert metered[0] == metered[32] == 37 * x.element_size()


def test_a_horovod_whose_gloo_receives_first_gets_the_alltoall_whole(monkeypatch):
    """scripts/build_horovod.sh's Fix 10 is recorded in horovod.hvd_quant_build; with it the
    communicator sends an alltoall whole at any size, and says so in its wire check (piece
    bytes 0), so that ranks on different Horovods refuse together instead of waiting."""
    import sys
    import types

    import horovod.torch as hvd
    marker = types.ModuleType("horovod.hvd_quant_build")
    marker.GLOO_RECEIVES_FIRST = True
    monkeypatch.setitem(sys.modules, "horovod.hvd_quant_build", marker)
    assert tcomm.gloo_receives_first()
    marker.GLOO_RECEIVES_FIRST = False
    assert not tcomm.gloo_receives_first()
    monkeypatch.setitem(sys.modules, "horovod.hvd_quant_build", None)  # a Horovod built elsewhere
    assert not tcomm.gloo_receives_first()

    calls = []

    def alltoall(x, name, process_set):
        calls.append(name)
        return x.clone(), torch.tensor([x.numel() // 2] * 2)

    monkeypatch.setattr(hvd, "alltoall_async", alltoall)
    monkeypatch.setattr(tcomm, "wait_for", lambda result: result)
    monkeypatch.setattr(core_comm, "PIECE_BYTES", 32)
    monkeypatch.setattr(tcomm.HorovodTorchComm, "in_pieces", False)
    comm = tcomm.HorovodTorchComm(Set2(), wire="host")
    comm._wire_checked = True
    x = torch.arange(2 * 37, dtype=torch.float32)
    assert torch.equal(comm.alltoall(x, "t"), x) and calls == ["t"]
    assert comm._piece_bytes() == 0
    monkeypatch.setattr(tcomm.HorovodTorchComm, "in_pieces", True)
    assert comm._piece_bytes() == 32
