"""The first-step agreement check on simulated ranks (``CompressorRunner.check_once``,
``ValueAgreement``): what must be identical raises on every rank together; parameter
values that differ are trained on, with one warning on rank 0 if they still differ at the
next check, or refused when strict."""

import logging

import numpy as np
import pytest

import hvd_quant
from hvd_quant.core import runner as runner_module
from hvd_quant.core.runner import (CompressorRunner, RankDisagreement, ValueAgreement,
                                   strict_default)
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.simulate import ThreadWorld

NP = NumpyBackend()


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.setattr(runner_module, "_warned_values", [False])
    monkeypatch.delenv("HVD_QUANT_STRICT", raising=False)


def checks(n, values_per_check, strict=None, structure=lambda r: 7):
    """Run ``check_once`` once per entry of ``values_per_check`` (a function of the rank
    giving the value digest) on ``n`` ranks; per rank the error raised (or None) and the
    collectives' names."""

    def body(comm):
        run = CompressorRunner(hvd_quant.get("ef_sign"), NP, strict=strict)
        try:
            for values in values_per_check:
                run.check_once(comm, "fused0", lambda: (structure(comm.rank), values(comm.rank)))
        except RankDisagreement as exc:
            return str(exc)
        return None
    return ThreadWorld(n).run(body)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if "different values" in r.getMessage()]


@pytest.mark.parametrize("n", [2, 3])
def test_values_that_differ_at_the_first_check_only_give_no_warning(n, caplog):
    caplog.set_level(logging.WARNING, "hvd_quant")
    errors = checks(n, [lambda r: r, lambda r: 5, lambda r: 6])  # broadcast after step 1
    assert errors == [None] * n and warnings_of(caplog) == []


@pytest.mark.parametrize("n", [2, 3])
def test_values_that_still_differ_give_one_warning_on_rank_0(n, caplog):
    caplog.set_level(logging.WARNING, "hvd_quant")
    errors = checks(n, [lambda r: r, lambda r: r, lambda r: r])
    assert errors == [None] * n
    found = warnings_of(caplog)
    assert len(found) == 1, found  # rank 0 only, once (a third check does not re-check)
    assert "broadcast_parameters" in found[0] and "train different models" in found[0]
    assert "HVD_QUANT_STRICT" in found[0]


@pytest.mark.parametrize("strict,env", [(True, None), (None, "1"), (None, "true")])
def test_strict_refuses_differing_values_on_every_rank(strict, env, monkeypatch):
    if env is not None:
        monkeypatch.setenv("HVD_QUANT_STRICT", env)
    errors = checks(3, [lambda r: r % 2], strict=strict)
    assert all(e is not None and "parameter values" in e and "ranks [0, 2]; ranks [1]" in e
               for e in errors), errors


def test_what_would_hang_or_corrupt_stays_an_error():
    errors = checks(2, [lambda r: 0], structure=lambda r: r)
    assert all(e is not None and "names/shapes/dtypes" in e for e in errors), errors


def test_agreeing_ranks_issue_one_collective_and_no_recheck():
    names = []

    def body(comm):
        run = CompressorRunner(hvd_quant.get("ef_sign"), NP)
        gather = comm.allgather

        def counted(x, name):
            if comm.rank == 0:
                names.append(name)
            return gather(x, name)
        comm.allgather = counted
        for _ in range(3):
            run.check_once(comm, "fused0", lambda: (1, 2))
    ThreadWorld(2).run(body)
    assert names == ["hvd_quant.check.fused0"]


def test_reset_forgets_a_pending_recheck():
    agreement = ValueAgreement(strict=False)
    agreement.first("k", "ranks [0]; ranks [1]", "the values")
    assert agreement.pending("k")
    agreement.clear()
    assert not agreement.pending("k")


def test_strict_from_the_environment(monkeypatch):
    assert strict_default() is False and strict_default(True) is True
    for value, want in (("0", False), ("no", False), ("1", True), ("YES", True)):
        monkeypatch.setenv("HVD_QUANT_STRICT", value)
        assert strict_default() is want
    monkeypatch.setenv("HVD_QUANT_STRICT", "maybe")
    with pytest.raises(ValueError, match="HVD_QUANT_STRICT"):
        strict_default()
    assert strict_default(False) is False  # an argument wins over the environment


def test_disagreeing_groups_name_the_ranks():
    assert runner_module.disagreeing_groups(np.array([3, 3, 3])) is None
    assert runner_module.disagreeing_groups(np.array([3, 4, 3])) == "ranks [0, 2]; ranks [1]"
