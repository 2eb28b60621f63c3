"""Convergence smoke tests: the example trains on 2 ranks with compressed gradients.

Each run is the real example (``examples/*_train.py``), same seed and epochs as the
uncompressed baseline it is compared with. A framework's runs are cases of one horovodrun
job (tests/mp/examples_worker.py: each as ``python script args`` would run it, the
frameworks' start-up paid once instead of once per run).
"""

import json

import pytest

from horovod_launch import HERE, run_horovod

# The job (a module fixture, whose setup pytest-timeout counts against the first test that
# uses it) runs every case of its framework: the limit must exceed the job's.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(960)]
EXAMPLES = HERE.parent / "examples"
EPOCHS = 15
TORCH = ["none", "marsit", "ef_sign", "global_qsgd"]
TF = ["none", "marsit"]


def train_all(tmp_path_factory, script, compressions):
    """Every compression's run of ``script`` in one job: its summary, by compression."""
    out = tmp_path_factory.mktemp(script.split(".")[0])
    cases = [[c, str(EXAMPLES / script), ["--compression", c, "--epochs", EPOCHS, "--json", str(out / f"{c}.json")]]
             for c in compressions]
    run_horovod(HERE / "mp" / "examples_worker.py", 2, [out, json.dumps(cases)], timeout=900)
    runs = {}
    for c in compressions:
        status = json.loads((out / f"{c}.status").read_text())
        assert status["ok"], f"{script} --compression {c}: {status.get('error')}"
        runs[c] = json.loads((out / f"{c}.json").read_text())
    return runs


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    return train_all(tmp_path_factory, "pytorch_train.py", TORCH)


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory):
    return train_all(tmp_path_factory, "tensorflow2_train.py", TF)


def test_baseline_learns(torch_runs):
    assert torch_runs["none"]["final_test_accuracy"] > 0.9


@pytest.mark.parametrize("compression,max_bytes_fraction", [
    ("marsit", 1 / 16), ("ef_sign", 1 / 16), ("global_qsgd", 1 / 3)])
def test_torch_compressed_training_matches_uncompressed(torch_runs, compression, max_bytes_fraction):
    base, run = torch_runs["none"], torch_runs[compression]
    # Within 2 accuracy points of uncompressed training, same seed and epochs.
    assert run["final_test_accuracy"] >= base["final_test_accuracy"] - 0.02
    assert run["bytes_per_step"] <= max_bytes_fraction * base["bytes_per_step"]


def test_tensorflow_marsit_trains_with_keras3(tf_runs):
    base, run = tf_runs["none"], tf_runs["marsit"]
    assert base["final_test_accuracy"] > 0.9
    assert run["final_test_accuracy"] >= base["final_test_accuracy"] - 0.02
    assert run["bytes_per_step"] <= base["bytes_per_step"] / 16
