"""Convergence smoke tests: the example trains on 2 ranks with compressed gradients.

Each run is the real example (``examples/*_train.py``) under horovodrun, same seed and
epochs as the uncompressed baseline it is compared with.
"""

import json

import pytest

from horovod_launch import HERE, run_horovod

# A test may run two 600 s jobs (the module-fixture baseline, whose setup pytest-timeout
# counts against the first test, and its own): the limit must exceed both.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(1260)]
EXAMPLES = HERE.parent / "examples"
EPOCHS = 15


def train(tmp_path, script, compression, *options):
    out = tmp_path / f"{script}-{compression}.json"
    args = ["--compression", compression, "--epochs", EPOCHS, "--json", out]
    for opt in options:
        args += ["--option", opt]
    run_horovod(EXAMPLES / script, 2, args, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def torch_baseline(tmp_path_factory):
    return train(tmp_path_factory.mktemp("base"), "pytorch_train.py", "none")


def test_baseline_learns(torch_baseline):
    assert torch_baseline["final_test_accuracy"] > 0.9


@pytest.mark.parametrize("compression,max_bytes_fraction", [
    ("marsit", 1 / 16), ("ef_sign", 1 / 16), ("global_qsgd", 1 / 3)])
def test_torch_compressed_training_matches_uncompressed(tmp_path, torch_baseline, compression,
                                                        max_bytes_fraction):
    run = train(tmp_path, "pytorch_train.py", compression)
    # Within 2 accuracy points of uncompressed training, same seed and epochs.
    assert run["final_test_accuracy"] >= torch_baseline["final_test_accuracy"] - 0.02
    assert run["bytes_per_step"] <= max_bytes_fraction * torch_baseline["bytes_per_step"]


def test_tensorflow_marsit_trains_with_keras3(tmp_path):
    base = train(tmp_path, "tensorflow2_train.py", "none")
    run = train(tmp_path, "tensorflow2_train.py", "marsit")
    assert base["final_test_accuracy"] > 0.9
    assert run["final_test_accuracy"] >= base["final_test_accuracy"] - 0.02
    assert run["bytes_per_step"] <= base["bytes_per_step"] / 16
