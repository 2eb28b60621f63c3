"""The warning when a compressor with error feedback feeds an adaptive optimizer (issue 51:
ef_sign and marsit ended 42% and 40% above fp32 Adam on the time-to-quality LM;
hvd_quant/core/adaptive_check.py says why)."""

import logging

import pytest

import hvd_quant
from hvd_quant.core import adaptive_check


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(adaptive_check, "_warned", set())


def test_error_feedback_is_declared_by_each_method():
    assert [name for name in hvd_quant.available() if hvd_quant.get(name).error_feedback] == \
        ["ef_sign", "marsit", "onebit"]
    assert hvd_quant.get("cascading_sign", compensation=True).error_feedback
    assert not hvd_quant.get("marsit", compensation=False).error_feedback


def test_warns_once_on_rank_zero_for_an_adaptive_optimizer(caplog):
    ef_sign = hvd_quant.get("ef_sign")
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        assert adaptive_check.warn_once(ef_sign, "Adam", adaptive=True, rank=1) is None
        text = adaptive_check.warn_once(ef_sign, "Adam", adaptive=True, rank=0)
        assert adaptive_check.warn_once(ef_sign, "Adam", adaptive=True, rank=0) is None  # once
        assert adaptive_check.warn_once(ef_sign, "SGD", adaptive=False, rank=0) is None
        assert adaptive_check.warn_once(hvd_quant.get("global_qsgd"), "Adam", adaptive=True, rank=0) is None
    assert [r.getMessage() for r in caplog.records] == [text]
    assert "ef_sign keeps error feedback and feeds Adam" in text and "OnebitAdam" in text
    assert "docs/methods/ef_sign.md" in text


def test_the_adapters_know_their_adaptive_optimizers():
    torch = pytest.importorskip("torch")
    from hvd_quant.torch.distributed_optimizer import _ADAPTIVE

    w = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(torch.optim.AdamW(w), _ADAPTIVE) and isinstance(torch.optim.RMSprop(w), _ADAPTIVE)
    assert not isinstance(torch.optim.SGD(w, lr=0.1, momentum=0.9), _ADAPTIVE)
    keras = pytest.importorskip("keras")
    from hvd_quant.tensorflow.keras import _adaptive_optimizers

    assert isinstance(keras.optimizers.Adam(), _adaptive_optimizers())
    assert not isinstance(keras.optimizers.SGD(), _adaptive_optimizers())
