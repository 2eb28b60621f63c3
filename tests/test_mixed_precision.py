"""Mixed precision: fp16/bf16 parameters and gradients with every compressor, and loss
scaling whose overflowing step every rank skips (``tests/mp/mixed_worker.py``).

The rule that keeps ranks in step: the reduction comes first and makes a non-finite
gradient on any rank non-finite on every rank; the loss scaler then decides from the
reduced gradients, which are the same everywhere. In torch that is Horovod's documented
order (``synchronize``, ``unscale_``, ``step`` under ``skip_synchronize``); in Keras 3 our
``DistributedOptimizer`` is the loss-scale optimizer and reduces before it checks; in
tf-keras, Keras' own ``LossScaleOptimizer`` asks Horovod's optimizer for reduced
gradients before it checks them.
"""

import pytest

from horovod_launch import HERE, load_rank_results, run_horovod

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,  # 48 torch + 21 TF cases, minutes
              # the job runs in a module fixture, whose setup pytest-timeout counts
              # against the first test: more than the job's own limit (900 s)
              pytest.mark.timeout(960)]
WORKER = HERE / "mp" / "mixed_worker.py"
ALL = ["none", "fp16", "ef_sign", "marsit", "cascading_sign", "global_qsgd", "global_qsgd:norm=l2",
       "global_qsgd_exp", "onebit"]
STOCK_TF = ["none", "fp16", "ef_sign", "global_qsgd", "global_qsgd:norm=l2", "onebit"]
STEPS, OVERFLOW_STEP = 5, 2
ONEBIT = ["onebit_adam", "zero_one_adam", "binsgdm"]


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


def _job(tmp_path_factory, mode, env=None):
    out = tmp_path_factory.mktemp(f"mixed-{mode}")
    run_horovod(WORKER, 2, [mode, out], timeout=900, env=env)
    return load_rank_results(out, 2)


@pytest.fixture(scope="module")
def torch_job(tmp_path_factory):
    return _job(tmp_path_factory, "torch")


@pytest.fixture(scope="module")
def keras_job(tmp_path_factory):
    return _job(tmp_path_factory, "keras3")


@pytest.fixture(scope="module")
def legacy_job(tmp_path_factory):
    return _job(tmp_path_factory, "legacy", {"TF_USE_LEGACY_KERAS": "1"})


def check_overflow_skipped(runs, label, initial_scale, scale_ranks=None):
    """Every rank: the overflowing step changed nothing and halved the scale; the other
    steps trained; every rank holds the same weights after every step. ``scale_ranks``:
    the ranks whose loss scale is checked (default all)."""
    first = runs[0]
    for rank, run in enumerate(runs):
        assert run["after_step"] == first["after_step"], f"{label}: ranks differ"
        after = run["after_step"]
        assert after[OVERFLOW_STEP] == after[OVERFLOW_STEP - 1], f"{label}: the overflow step was applied"
        assert len(set(after)) == STEPS - 1, f"{label}: the other steps must all change the weights"
        assert run["finite"], label
        if scale_ranks is not None and rank not in scale_ranks:
            continue
        scales = run["scales"]
        assert scales[OVERFLOW_STEP] == scales[OVERFLOW_STEP - 1] / 2, (label, scales)
        assert scales[0] == initial_scale and scales[-1] == initial_scale / 2, (label, scales)


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.bfloat16"])
@pytest.mark.parametrize("path", ["ours", "stock"])
@pytest.mark.parametrize("config", ALL)
def test_torch_low_precision_parameters(torch_job, dtype, path, config):
    runs = [_ok(rank["low_precision"])[f"{dtype}/{path}/{config}"] for rank in torch_job]
    assert runs[0]["digest"] == runs[1]["digest"], "ranks differ"
    assert runs[0]["finite"]
    assert runs[0]["param_dtypes"] == runs[0]["grad_dtypes"] == [dtype]


@pytest.mark.parametrize("path", ["ours", "stock"])
@pytest.mark.parametrize("config", ALL)
def test_torch_grad_scaler_skips_the_overflow_on_every_rank(torch_job, path, config):
    runs = [_ok(rank["grad_scaler"])[f"{path}/{config}"] for rank in torch_job]
    check_overflow_skipped(runs, f"{path}/{config}", 2.0 ** 10)


@pytest.mark.parametrize("config", ALL)
def test_keras_mixed_float16_skips_the_overflow_on_every_rank(keras_job, config):
    runs = [_ok(rank["mixed_float16"])[config] for rank in keras_job]
    assert runs[0]["optimizer"] == "DistributedOptimizer"
    assert runs[0]["variable_dtypes"] == ["float32"]
    check_overflow_skipped(runs, config, 2.0 ** 15)
    assert runs[0]["iterations"] == STEPS - 1  # the wrapped optimizer never saw the skipped step


@pytest.mark.parametrize("name", ONEBIT)
def test_torch_grad_scaler_with_onebit_optimizers(torch_job, name):
    runs = [_ok(rank["onebit_grad_scaler"])[name] for rank in torch_job]
    # hq.GradScaler takes the optimizer's global verdict: every rank's scale halves.
    check_overflow_skipped(runs, name, 2.0 ** 10)
    assert [run["skipped"] for run in runs] == [1, 1]


def test_torch_stock_grad_scaler_with_a_onebit_optimizer_drifts(torch_job):
    # The stock GradScaler sees only its own rank's overflow (rank 1's): the step is still
    # skipped everywhere, but only rank 1 halves its scale. hq.GradScaler exists for this.
    runs = [_ok(rank["onebit_grad_scaler"])["stock/binsgdm"] for rank in torch_job]
    check_overflow_skipped(runs, "stock/binsgdm", 2.0 ** 10, scale_ranks=[1])
    assert runs[0]["scales"] == [2.0 ** 10] * len(runs[0]["scales"])


@pytest.mark.parametrize("name", ONEBIT)
def test_keras_mixed_float16_with_onebit_optimizers(keras_job, name):
    runs = [_ok(rank["onebit_mixed_float16"])[name] for rank in keras_job]
    assert runs[0]["optimizer"] == "DistributedOptimizer"
    check_overflow_skipped(runs, name, 2.0 ** 15)
    assert [run["skipped"] for run in runs] == [1, 1]


def test_keras_refuses_plain_loss_scaling_around_onebit_optimizers(keras_job):
    for rank in keras_job:
        message = _ok(rank["onebit_mixed_float16"])["plain_compile"]
        assert "LossScaleOptimizer wraps ZeroOneAdam" in message, message


@pytest.mark.parametrize("config", ALL)
def test_keras_mixed_bfloat16_trains(keras_job, config):
    runs = [_ok(rank["mixed_bfloat16"])[config] for rank in keras_job]
    assert runs[0]["after_step"] == runs[1]["after_step"]
    assert runs[0]["finite"] and len(set(runs[0]["after_step"])) == STEPS
    assert runs[0]["iterations"] == STEPS


@pytest.mark.parametrize("config", STOCK_TF)
def test_tf_keras_stock_optimizer_mixed_float16_skips_the_overflow(legacy_job, config):
    runs = [_ok(rank["stock_mixed_float16"])[config] for rank in legacy_job]
    assert runs[0]["optimizer"].endswith("LossScaleOptimizer") or "LossScale" in runs[0]["optimizer"]
    check_overflow_skipped(runs, config, 2.0 ** 15)
