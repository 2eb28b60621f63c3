"""The kernels' thread policy (hvd_quant.kernels.threads): cores, ranks per host, overrides."""

import logging
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from hvd_quant import kernels
from hvd_quant.kernels import threads


# --- cgroup CPU quotas, on made-up trees ---------------------------------------------------------
def cgroup_limit(tmp_path, mount, proc_self_cgroup):
    """``threads.cgroup_cpu_limit`` over a made-up cgroup mount (``mount``: path under it
    to the file's text) and the given text of ``/proc/self/cgroup``."""
    root = tmp_path / "cg"
    for path, text in mount.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    (tmp_path / "cgroup").write_text(proc_self_cgroup)
    return threads.cgroup_cpu_limit(str(root), str(tmp_path / "cgroup"))


def test_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path):
    mount = {"cgroup.controllers": "cpu memory", "kubepods/cpu.max": "max 100000",
             "kubepods/pod1/cpu.max": "350000 100000", "kubepods/pod1/c1/cpu.max": "max 100000"}
    assert cgroup_limit(tmp_path, mount, "0::/kubepods/pod1/c1\n") == 3.5


def test_cgroup_v2_inside_a_container_reads_the_mount_itself(tmp_path):
    # The path in /proc/self/cgroup names the host's hierarchy, not the container's mount.
    mount = {"cgroup.controllers": "cpu", "cpu.max": "150000 100000"}
    assert cgroup_limit(tmp_path, mount, "0::/docker/0123abcd\n") == 1.5


def test_cgroup_v2_without_a_quota(tmp_path):
    mount = {"cgroup.controllers": "cpu", "cpu.max": "max 100000"}
    assert cgroup_limit(tmp_path, mount, "0::/\n") is None


@pytest.mark.parametrize("controllers", ["cpu,cpuacct", "cpu"])
def test_cgroup_v1_quota(tmp_path, controllers):
    mount = {f"{controllers}/job/cpu.cfs_quota_us": "200000", f"{controllers}/job/cpu.cfs_period_us": "100000",
             f"{controllers}/cpu.cfs_quota_us": "-1", f"{controllers}/cpu.cfs_period_us": "100000"}
    assert cgroup_limit(tmp_path, mount, f"4:memory:/job\n3:{controllers}:/job\n0::/job\n") == 2.0


def test_cgroup_v1_without_a_quota_and_no_cgroups_at_all(tmp_path):
    mount = {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}
    assert cgroup_limit(tmp_path, mount, "1:cpu:/\n0::/\n") is None
    assert threads.cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "missing")) is None


def test_usable_cores_take_the_smaller_of_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cores", lambda: 16)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 3.5)
    assert threads.usable_cores() == (3, "affinity 16, cgroup CPU quota 3.5")
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 0.5)
    assert threads.usable_cores()[0] == 1  # at least one
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    assert threads.usable_cores() == (16, "affinity 16, no cgroup CPU quota")


# --- the choice -------------------------------------------------------------------------------------
@pytest.fixture
def clean(monkeypatch):
    """No explicit setting, 32 usable cores, no launcher; the real choice restored after."""
    for var in ("HVD_QUANT_THREADS",) + threads.LOCAL_SIZE_VARS + threads.RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "_USER_NUMBA_THREADS", None)
    monkeypatch.setattr(threads, "usable_cores", lambda: (32, "affinity 32, no cgroup CPU quota"))
    monkeypatch.setattr(threads, "_horovod_modules", lambda: [])
    yield monkeypatch
    threads._explicit["threads"] = None
    monkeypatch.undo()
    threads.configure(log_choice=False)


@pytest.mark.parametrize("local, expected", [(1, 32), (8, 4), (3, 10), (32, 1), (64, 1)])
def test_policy_divides_the_cores_among_the_ranks_on_this_host(clean, local, expected):
    clean.setenv("HOROVOD_LOCAL_SIZE", str(local))
    c = threads.decide()
    assert (c.threads, c.source, c.local_size, c.local_size_why) == (expected, "policy", local, "HOROVOD_LOCAL_SIZE")
    assert c.serial == (expected == 1)


def test_local_size_comes_from_horovod_first_then_launchers(clean):
    clean.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert threads.local_ranks() == (4, "OMPI_COMM_WORLD_LOCAL_SIZE")
    clean.setenv("HOROVOD_LOCAL_SIZE", "2")
    assert threads.local_ranks() == (2, "HOROVOD_LOCAL_SIZE")

    class FakeHorovod:
        is_initialized = staticmethod(lambda: True)
        local_size = staticmethod(lambda: 8)
        rank = staticmethod(lambda: 5)
    clean.setattr(threads, "_horovod_modules", lambda: [FakeHorovod])
    assert threads.local_ranks() == (8, "hvd.local_size()")
    assert threads.this_rank() == 5


def test_explicit_settings_win_in_order(clean):
    clean.setenv("HOROVOD_LOCAL_SIZE", "8")
    clean.setattr(threads, "_USER_NUMBA_THREADS", "3")
    assert (threads.decide().threads, threads.decide().source) == (3, "NUMBA_NUM_THREADS")
    clean.setenv("HVD_QUANT_THREADS", "2")
    assert (threads.decide().threads, threads.decide().source) == (2, "HVD_QUANT_THREADS")
    threads._explicit["threads"] = 6
    assert (threads.decide().threads, threads.decide().source) == (6, "set_threads()")


@pytest.mark.parametrize("environ, user", [
    ({}, None),
    ({"NUMBA_NUM_THREADS": "3"}, "3"),
    ({"NUMBA_NUM_THREADS": "2", threads._OWN_MARK: "2"}, None),  # an hvd_quant parent set it
    ({"NUMBA_NUM_THREADS": "4", threads._OWN_MARK: "2"}, "4"),   # changed since: the user's
])
def test_a_parents_policy_choice_is_not_a_users_setting(environ, user):
    assert threads._user_numba_threads(environ) == user


def test_ranks_launched_by_an_hvd_quant_process_choose_their_own_share(tmp_path):
    """A launcher that imported hvd_quant (one process on the host: all cores) starts ranks
    that inherit its environment: each rank still takes only its own share."""
    child = ("from hvd_quant.kernels import threads; c = threads.choice(); "
             "print(c.source, c.threads, c.cores)")
    parent = ("import os, subprocess, sys; from hvd_quant.kernels import threads; threads.configure(); "
              "assert os.environ['NUMBA_NUM_THREADS'] == str(threads.choice().threads); "
              "env = dict(os.environ, HOROVOD_LOCAL_SIZE='64'); "
              f"print(subprocess.run([sys.executable, '-c', {child!r}], env=env, check=True, "
              "capture_output=True, text=True).stdout)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_NUM_THREADS", "HVD_QUANT_THREADS", threads._OWN_MARK, "HOROVOD_LOCAL_SIZE")}
    out = subprocess.run([sys.executable, "-c", parent], env=env, check=True, capture_output=True,
                         text=True, timeout=120).stdout.split()
    assert out[:2] == ["policy", "1"], out  # 64 ranks on this host: one thread each


@pytest.mark.parametrize("bad", ["0", "-2", "four", "1.5"])
def test_bad_settings_are_refused_with_their_name(clean, bad):
    clean.setenv("HVD_QUANT_THREADS", bad)
    with pytest.raises(ValueError, match="HVD_QUANT_THREADS must be a positive integer"):
        threads.decide()
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        kernels.set_threads(0)


def test_one_thread_runs_the_serial_twins_with_the_same_results(clean):
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    e = np.random.default_rng(1).standard_normal(300_001).astype(np.float32)
    cpu = kernels.cpu_module()
    results = {}
    for n in (1, 2):
        kernels.set_threads(n)
        assert cpu._SERIAL[0] == (n == 1)
        bounds = np.array([0, 1000, 300_001], np.int64)
        results[n] = (cpu.compensate_sums(x, e, bounds), cpu.sign_pack_residual(x, e, np.ones(2, np.float32), bounds),
                      cpu.quantize_ints(x, 1.0, 4.0, 63, 7, np.int8))
    np.testing.assert_array_equal(results[1][0], results[2][0])
    for a, b in zip(results[1][1], results[2][1]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[1][2], results[2][2])


def test_a_choice_made_while_the_kernels_import_is_applied_once_they_are_in(clean):
    """Ranks on threads (a ThreadWorld) prepare at once: one imports the kernels while
    another remakes the choice, and sees the module half imported, without use_serial.
    That raised AttributeError; the choice is now applied when the import is done."""
    half = types.ModuleType("hvd_quant.kernels.cpu")  # what sys.modules holds mid-import
    clean.setitem(sys.modules, "hvd_quant.kernels.cpu", half)
    threads.set_threads(1)  # remakes the choice: serial
    half._SERIAL = [False]
    half.use_serial = lambda flag: half._SERIAL.__setitem__(0, bool(flag))  # the import ends
    threads.apply_to(half)
    assert half._SERIAL == [True]


def test_the_choice_is_logged_once_at_info_on_rank_0_and_debug_elsewhere(clean, caplog):
    clean.setenv("HOROVOD_LOCAL_SIZE", "16")
    with caplog.at_level(logging.DEBUG, logger="hvd_quant"):
        threads._state["logged"] = False
        threads.configure()
        threads.configure()  # the same choice: not logged again
    records = [r for r in caplog.records if "kernels:" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert records[0].getMessage() == ("hvd_quant kernels: 2 threads per rank (parallel kernels): 32 usable "
                                       "cores (affinity 32, no cgroup CPU quota) / 16 ranks on this host "
                                       "(HOROVOD_LOCAL_SIZE)")
    caplog.clear()
    clean.setenv("HOROVOD_RANK", "3")
    clean.setenv("HOROVOD_LOCAL_SIZE", "32")
    with caplog.at_level(logging.DEBUG, logger="hvd_quant"):
        threads.configure()  # changed: logged again, at DEBUG on a rank other than 0
    records = [r for r in caplog.records if "kernels:" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    assert "1 thread per rank (serial kernels)" in records[0].getMessage()


def test_oversubscribed_framework_threads_are_warned_about_once(clean, caplog):
    clean.setenv("HOROVOD_LOCAL_SIZE", "8")
    threads.configure(log_choice=False)
    clean.setattr(threads, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        assert not threads.warn_oversubscribed("torch", 4, "torch.set_num_threads({share})")  # 8 x 4 = 32
        assert threads.warn_oversubscribed("torch", 32, "torch.set_num_threads({share})")
        assert not threads.warn_oversubscribed("torch", 32, "torch.set_num_threads({share})")  # once
    assert len(caplog.records) == 1
    assert "32 intra-op threads per rank with 8 ranks" in caplog.records[0].getMessage()
    clean.setenv("HOROVOD_LOCAL_SIZE", "64")  # more ranks than cores: one thread is the least
    threads.configure(log_choice=False)
    assert not threads.warn_oversubscribed("tensorflow", 1, "...")
    assert "torch.set_num_threads(4)" in caplog.records[0].getMessage()


def test_prepare_loads_every_kernel_so_no_later_call_compiles():
    kernels.prepare()
    before = kernels.loaded_signatures()
    assert before > 0
    kernels.warm_up()  # every signature the methods use is already there
    assert kernels.loaded_signatures() == before


def test_importing_the_torch_adapter_builds_no_compressor_so_the_threads_check_waits_for_the_call():
    """``import hvd_quant.torch`` comes before a user's ``torch.set_num_threads``: a
    compressor built at import (a default argument) would load the kernels then and warn
    about threads the user is about to set. The check belongs to the first compressor."""
    pytest.importorskip("torch")
    script = ("import logging, sys; logging.basicConfig(stream=sys.stdout, format='%(message)s'); "
              "import torch; torch.set_num_threads(64); "
              "import hvd_quant.torch as hq; from hvd_quant import kernels; "
              "print('loaded at import:', kernels.loaded_signatures()); "
              "hq.Compression.ef_sign; print('built')")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "HVD_QUANT_THREADS",
                                                            threads._OWN_MARK)}
    env.update(HOROVOD_LOCAL_SIZE="2", HOROVOD_RANK="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                         text=True, timeout=300).stdout
    at_import, at_build = out.split("loaded at import:")
    assert "intra-op threads" not in at_import, out
    assert at_build.startswith(" 0\n"), out  # no kernel loaded either
    assert "torch uses 64 intra-op threads per rank with 2 ranks" in at_build, out
