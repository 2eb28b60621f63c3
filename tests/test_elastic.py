"""Horovod Elastic: hvd_quant's state is committed, restored and adapted when ranks go.

The multi-process test starts an elastic job of 3 ranks on two "hosts" that are both this
machine (``localhost:2`` and ``127.0.0.1:1``; Horovod blacklists a host whose worker
fails, so the failing worker needs a host of its own). The worker on ``127.0.0.1`` dies
mid-training; the discovery script then lists 2 slots and the survivors finish
(tests/mp/elastic_worker.py). The single-process tests check the reset logic itself.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from horovod_launch import BIN, HERE, JobTimeout, _tail, horovod_env, load_rank_results

WORKER = HERE / "mp" / "elastic_worker.py"
STEPS, KILL_STEP = 10, 4

DISCOVERY = """#!/bin/sh
# First localhost:2 and 127.0.0.1:1 (3 slots); once the worker on 127.0.0.1 died, 2 slots.
if [ -e "{marker}" ]; then
  echo localhost:2
else
  echo localhost:2
  echo 127.0.0.1:1
fi
"""


def run_elastic(tmp_path, timeout=240):
    marker = tmp_path / "killed"
    script = tmp_path / "discover.sh"
    script.write_text(DISCOVERY.format(marker=marker))
    script.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [str(BIN / "horovodrun"), "-np", "3", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(script), "--gloo", "--network-interface", "lo",
           str(BIN / "python"), str(WORKER), str(out), str(STEPS), str(KILL_STEP), str(marker)]
    env = horovod_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "10", "HOROVOD_ELASTIC_TIMEOUT": "120",
                       "OMP_NUM_THREADS": "1"})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise JobTimeout(f"elastic job exceeded {timeout}s and was killed\n" + _tail(log))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (tmp_path / "job.log").write_text(log or "")
    assert proc.returncode == 0, f"elastic job failed (exit {proc.returncode})\n" + _tail(log, 120)
    assert marker.exists(), "the worker on 127.0.0.1 never died\n" + _tail(log)
    return load_rank_results(out, 2), time.monotonic() - start, log


@pytest.mark.multiprocess
def test_elastic_torch_survivors_continue(tmp_path):
    import hvd_quant
    from hvd_quant.compressors.global_qsgd import resolve_width_levels

    ranks, elapsed, log = run_elastic(tmp_path)
    print(f"elastic job took {elapsed:.1f}s")
    assert not (tmp_path / "out" / "rank2.json").exists()
    for r in ranks:
        assert r["size"] == 2 and r["steps"] == STEPS and r["host"] == "localhost"
        # One reset, after the failure, at the commit of the step before the kill.
        assert len(r["resets"]) == 1, r["resets"]
        reset = r["resets"][0]
        assert reset["size"] == 2 and reset["step"] == KILL_STEP
        # Survivors keep their error feedback (as of the last commit)...
        assert reset["ef_residual_abs"] > 0 and reset["stock_residual_abs"] > 0
        # ...the world-dependent padded buffers of 0/1 Adam restart from zero at the new size...
        assert reset["zeroone_worker_error_abs"] == 0.0
        from hvd_quant.core.onebit import padded_size
        assert reset["zeroone_worker_error_numel"] == padded_size(8 * 2 + 2, 2)
        # ...and the agreement checks run again.
        assert reset["zeroone_checked"] is False and reset["ef_checked"] == []
        # Global-QSGD re-resolved its levels for 2 ranks.
        norm = hvd_quant.get("global_qsgd", bits=8).norm
        assert reset["qsgd_levels"] == list(resolve_width_levels(norm, 2, bits=8))
        assert reset["qsgd_levels"] != list(resolve_width_levels(norm, 3, bits=8))
        assert r["qsgd_levels"] == reset["qsgd_levels"]
        assert "onebit" in r["kinds"]["onebit"][KILL_STEP:]
        assert "onebit" in r["kinds"]["zeroone"][KILL_STEP:]
        for k in r["final"]:
            assert r["final"][k] < 0.7 * r["initial"][k], (k, r["initial"][k], r["final"][k])
    # The survivors end with identical weights (every optimizer here keeps ranks in step).
    a, b = ranks
    for k in a["weights"]:
        for pa, pb in zip(a["weights"][k], b["weights"][k]):
            np.testing.assert_array_equal(pa, pb, err_msg=k)
    assert a["final"] == b["final"]


# --- single process: the reset logic --------------------------------------------------------
class _FakeSet:
    process_set_id = 0

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_comm_refresh_rereads_world_and_forgets_torus():
    from hvd_quant.core.comm import Communicator
    from hvd_quant.process_sets import ProcessSetTorus

    class Comm(ProcessSetTorus, Communicator):
        def __init__(self, ps):
            super().__init__()
            self.process_set = ps
            self.rank, self.size = ps.rank(), ps.size()

    ps = _FakeSet(2, 4)
    comm = Comm(ps)
    comm.__dict__["_torus"] = {2: "old pair"}
    ps._rank, ps._size = 1, 2
    comm.refresh()
    assert (comm.rank, comm.size) == (1, 2) and "_torus" not in comm.__dict__
    ps.process_set_id = None
    with pytest.raises(RuntimeError, match="no longer registered"):
        comm.refresh()


def test_runner_reset_checks_revalidates():
    import hvd_quant
    from hvd_quant.core.runner import CompressorRunner
    from hvd_quant.core.simulate import ThreadWorld

    world = ThreadWorld(1)
    marsit = CompressorRunner(hvd_quant.get("marsit", topology="torus", torus_rows=2),
                              world.backend)
    marsit._checked.add("fused0")
    marsit.reset_checks(4)
    assert not marsit._checked
    with pytest.raises(ValueError, match="torus_rows=2 does not divide 3"):
        marsit.reset_checks(3)
    # Global-QSGD: explicit levels that are safe for 2 ranks may not be for many more.
    from hvd_quant.compressors.global_qsgd import max_levels
    norm = hvd_quant.get("global_qsgd", bits=8).norm
    levels = max_levels(norm, 2, 8)
    qsgd = CompressorRunner(hvd_quant.get("global_qsgd", bits=8, levels=levels), world.backend)
    qsgd.reset_checks(2)
    with pytest.raises(ValueError):
        qsgd.reset_checks(3)


def test_forget_stale_sets(monkeypatch):
    from horovod.common.process_sets import ProcessSet
    from hvd_quant import process_sets

    stale, live = ProcessSet([0, 1]), ProcessSet([2, 3])
    stale.process_set_id, live.process_set_id = 1, 2
    monkeypatch.setattr(process_sets, "_CREATED", [stale, live])

    class Basics:
        @staticmethod
        def _get_process_set_ids_and_ranks():
            return {0: [0, 1, 2, 3], 2: [2, 3]}

    import horovod.common.process_sets as hps
    monkeypatch.setattr(hps, "_basics", Basics())
    process_sets.forget_stale_sets()
    assert stale.process_set_id is None and live.process_set_id == 2


def test_tensorflow_elastic_says_why_not():
    pytest.importorskip("tensorflow")
    from hvd_quant.tensorflow import elastic

    with pytest.raises(NotImplementedError, match="Keras 3"):
        elastic.KerasState(None)


def test_torch_reset_in_one_process(monkeypatch):
    """One rank: the reset adapts the world-dependent state and re-arms the checks; the
    state handles sync/save/restore for every kind of hvd_quant optimizer."""
    if "horovod.tensorflow" in sys.modules and not os.environ.get("HVDQ_ISOLATED"):
        # Horovod's torch and TF libraries share one process-set table in Python: once the
        # TF one is loaded (by earlier tests), torch's global process set reads as empty and
        # Horovod's optimizer registers no hooks. Run this test in a fresh interpreter.
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 f"{__file__}::test_torch_reset_in_one_process"],
                                env=dict(os.environ, HVDQ_ISOLATED="1"), capture_output=True,
                                text=True, timeout=240, cwd=os.path.dirname(__file__))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        return
    torch = pytest.importorskip("torch")
    import horovod.torch as hvd
    import hvd_quant.torch as hq
    from hvd_quant.core.onebit import padded_size
    from hvd_quant.torch.elastic import TorchState

    hvd.init()
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")  # Horovod's optimizer reduces even on one rank
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    z = hq.ZeroOneAdam(models[0].parameters(), lr=0.01, var_freeze_step=1000, var_update_scaler=1)
    ours = hq.DistributedOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1),
                                   named_parameters=models[1].named_parameters(),
                                   compression=hq.Compression.ef_sign)
    stock = hvd.DistributedOptimizer(torch.optim.SGD(models[2].parameters(), lr=0.1),
                                     named_parameters=models[2].named_parameters(),
                                     compression=hq.Compression.ef_sign)
    state = TorchState(m0=models[0], m1=models[1], m2=models[2], z=z, ours=ours, stock=stock, step=0)
    state.sync()
    x = torch.randn(5, 4)
    for _ in range(3):
        for m, o in zip(models, (z, ours, stock)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    state.commit()
    residual = stock._compression.state_dict(stock)["weight/residual"].clone()
    assert residual.abs().sum() > 0
    # Pretend this process was rank 2 of 3 before Horovod was initialised again.
    z._comm.rank, z._comm.size = 2, 3
    slots = z.state["hvd_quant.group0"]["slots"]
    slots["worker_error"] = torch.ones(padded_size(15, 3))
    state.restore()
    state.reset()
    slots = z.state["hvd_quant.group0"]["slots"]
    assert slots["worker_error"].numel() == padded_size(15, 1) and slots["worker_error"].abs().sum() == 0
    assert z._checked is False and not ours._runner._checked
    assert not stock._compression.owned(stock).runner._checked
    # Survivors keep their error feedback (restored from the commit).
    assert torch.equal(stock._compression.state_dict(stock)["weight/residual"], residual)
    state.sync()
    for m, o in zip(models, (z, ours, stock)):  # training goes on, checks run again
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    assert z._checked and ours._runner._checked
    # BinSGDM whose ranks_per_node no longer divides the world refuses on reset.
    b = hq.BinSGDM(torch.nn.Linear(2, 2).parameters(), lr=0.01, ranks_per_node=1)
    b._rule.ranks_per_node = 2  # as if built for 2 ranks per node
    with pytest.raises(ValueError):
        b.elastic_reset()
