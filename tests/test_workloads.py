"""The convergence workloads: the stdlib text pipeline, the LM scripts under horovodrun,
and the benchmark runner's bookkeeping.

Data tests run in one process on a small corpus (a fraction of a second each); the
``multiprocess`` ones train the LM for a few steps on 2 ranks with a tiny model, and run
the other examples briefly on 2 ranks (the digits scripts' ``--optimizer``, the GAN with
both optimizer paths, ``keras_fit.py`` with a 1-bit optimizer and with ``mixed_float16``):
every example case of a framework in one horovodrun job (tests/mp/examples_worker.py),
3.3 min of 18 jobs before, 0.8 min of 2 jobs now.
"""

import importlib.util
import json
import re
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from horovod_launch import HERE, run_horovod

EXAMPLES = HERE.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import stdlib_text as st  # noqa: E402

SMALL = 300_000  # bytes: enough for a split, fast to read


def _load_convergence():
    spec = importlib.util.spec_from_file_location("convergence", HERE.parent / "benchmarks" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus():
    return st.load_corpus(SMALL)


# --- corpus -------------------------------------------------------------------------------
def test_corpus_is_deterministic(corpus):
    again = st.load_corpus(SMALL)
    assert again.digest == corpus.digest
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    assert again.train_files == corpus.train_files and again.val_files == corpus.val_files


def test_split_is_by_file_and_disjoint(corpus):
    assert corpus.train_files and corpus.val_files
    assert not set(corpus.train_files) & set(corpus.val_files)
    # Validation holds about val_fraction of the bytes (one file of slack).
    share = corpus.val.size / (corpus.val.size + corpus.train.size)
    assert 0.05 < share < 0.2
    # No validation file's text appears in training (checked on a distinctive chunk).
    val_text = corpus.val.tobytes().split(bytes([st.SEPARATOR]))
    train_text = corpus.train.tobytes()
    for doc in val_text[:5]:
        if len(doc) > 400:
            assert doc[100:400] not in train_text


def test_corpus_respects_size_cap_and_skips(corpus):
    assert SMALL <= corpus.train.size + corpus.val.size < SMALL + st.MAX_FILE_BYTES + 10_000
    for rel in corpus.train_files + corpus.val_files:
        parts = rel.split("/")
        assert not st.SKIP_DIRS.intersection(parts[:-1]) and rel.endswith(".py")
    assert st.source_files() == sorted(st.source_files())


def test_vocab_is_bytes_and_files_are_separated(corpus):
    assert st.VOCAB_SIZE == 256
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert int(np.sum(corpus.train == st.SEPARATOR)) == len(corpus.train_files) - 1
    assert int(np.sum(corpus.val == st.SEPARATOR)) == len(corpus.val_files) - 1
    assert "def " in st.decode(corpus.train[:50_000])


def test_corpus_from_a_directory_skips_tests_packages_and_bad_files(tmp_path):
    def write(rel, data):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    for i in range(40):
        write(f"mod{i:02d}.py", f"def f{i}(x):\n    return x + {i}\n".encode() * 200)
    write("test/test_mod.py", b"import unittest\n" * 100)
    write("pkg/tests/t.py", b"assert True\n" * 100)
    write("site-packages/numpy/core.py", b"x = 1\n" * 100)
    write("latin1.py", "caf\xe9 = 1\n".encode("latin-1") * 100)
    write("big.py", b"#" * (st.MAX_FILE_BYTES + 1))
    write("notes.txt", b"not python\n" * 100)
    files = st.source_files(tmp_path)
    assert "test/test_mod.py" not in files and "pkg/tests/t.py" not in files
    assert not any(f.startswith("site-packages") for f in files)
    assert "big.py" not in files and "notes.txt" not in files
    c = st.load_corpus(10**6, root=tmp_path)
    assert c.skipped_undecodable == ["latin1.py"]
    assert len(c.train_files) + len(c.val_files) == 40


def test_bad_corpus_options_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        st.load_corpus(SMALL, val_fraction=0.9)
    with pytest.raises(ValueError, match="too small"):
        st.load_corpus(100)
    with pytest.raises(FileNotFoundError):
        st.source_files(tmp_path / "missing")


# --- batches ------------------------------------------------------------------------------
def test_training_batches_depend_on_rank_and_are_reproducible(corpus):
    a0 = st.TrainBatches(corpus.train, 32, 8, seed=0, rank=0).take(3)
    a0_again = st.TrainBatches(corpus.train, 32, 8, seed=0, rank=0).take(3)
    a1 = st.TrainBatches(corpus.train, 32, 8, seed=0, rank=1).take(3)
    b0 = st.TrainBatches(corpus.train, 32, 8, seed=1, rank=0).take(3)
    assert np.array_equal(a0[0], a0_again[0])
    assert not np.array_equal(a0[0], a1[0]) and not np.array_equal(a0[0], b0[0])
    x, y = a0
    assert x.shape == y.shape == (24, 32) and x.dtype == np.int64
    assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert x.max() < st.VOCAB_SIZE and x.min() >= 0


def test_validation_windows_are_fixed(corpus):
    x, y = st.validation_windows(corpus.val, 64, 100)
    x2, y2 = st.validation_windows(corpus.val, 64, 100)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert x.shape == (100, 64) and np.array_equal(x[:, 1:], y[:, :-1])
    assert np.array_equal(x[0], corpus.val[:64])  # first window at the start
    assert np.array_equal(y[-1], corpus.val[-64:])  # last one ends at the end
    with pytest.raises(ValueError):
        st.validation_windows(corpus.val[:10], 64, 4)


# --- shared settings ----------------------------------------------------------------------
def test_learning_rate_schedule():
    args = st.lm_arguments("t", ["--steps", "100", "--lr", "1e-3", "--warmup", "10"])
    lrs = [st.lr_at(s, args) for s in range(100)]
    assert lrs[9] == pytest.approx(1e-3) and lrs[0] == pytest.approx(1e-4)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    const = st.lm_arguments("t", ["--steps", "100", "--decay", "constant"])
    assert st.lr_at(99, const) == const.lr


def test_schedule_defaults_follow_the_run_length():
    args = st.lm_arguments("t", ["--optimizer", "zero_one_adam", "--steps", "1000"])
    assert args.warmup == 250 and args.var_freeze_step == 250 and args.freeze_step == 250
    # The sync interval doubles every local_step_scaler steps: 4 doublings (1 -> 16) by
    # the middle of the 750 local-phase steps.
    assert args.local_step_scaler * 4 <= 375
    with pytest.raises(SystemExit):
        st.lm_arguments("t", ["--d-model", "100", "--heads", "3"])


# --- the runner's bookkeeping -------------------------------------------------------------
def test_runner_gaps_table_and_extra_args():
    conv = _load_convergence()
    rows = [{"workload": "lm_torch", "optimizer": o, "np": 2, "metric": m, "final_val_loss": m,
             "final_test_accuracy": None, "bytes_per_step": b, "fp32_allreduce_bytes_per_step": 1000.0,
             "comm_rounds": r, "steps": 10, "ranks_agree": True, "wall_s": 1.0}
            for o, m, b, r in [("adam", 2.0, 1000.0, 10), ("zero_one_adam", 2.02, 50.0, 4)]]
    rows.append({"workload": "digits", "optimizer": "adam", "np": 2, "metric": 0.9, "final_val_loss": None,
                 "final_test_accuracy": 0.9, "bytes_per_step": 1.0, "fp32_allreduce_bytes_per_step": 1.0,
                 "comm_rounds": None, "steps": None, "ranks_agree": None, "wall_s": 1.0})
    conv.add_gaps(rows)
    assert rows[1]["gap_to_adam"] == pytest.approx(1.0)
    table = conv.markdown_table(rows + [{"workload": "lm_keras", "optimizer": "binsgdm", "np": 3,
                                         "error": "exit status 1", "wall_s": 2.0}])
    assert "+1.00%" in table and "20.0x" in table and "FAILED (exit status 1)" in table
    extras = ["lm_torch=--lr 1", "lm_torch/binsgdm=--beta 0.95", "*/binsgdm=--lr 2"]
    assert conv.extra_args(extras, "lm_torch", "binsgdm") == ["--lr", "1", "--beta", "0.95", "--lr", "2"]
    assert conv.extra_args(extras, "lm_keras", "adam") == []


def test_runner_variants_add_labelled_jobs():
    conv = _load_convergence()
    args = conv.parse_args(["--workloads", "lm_torch", "digits", "--np", "2", "--optimizers", "adam",
                            "--variant", "binsgdm+lr3e-3=--lr 3e-3",
                            "--variant", "lm_torch/zero_one_adam+k=--var-update-scaler 1000"])
    jobs = conv.job_list(args, args.workloads)
    assert jobs == [("lm_torch", 2, "adam", "adam", []),
                    ("lm_torch", 2, "binsgdm", "binsgdm+lr3e-3", ["--lr", "3e-3"]),
                    ("lm_torch", 2, "zero_one_adam", "zero_one_adam+k", ["--var-update-scaler", "1000"]),
                    ("digits", 2, "adam", "adam", []),
                    ("digits", 2, "binsgdm", "binsgdm+lr3e-3", ["--lr", "3e-3"])]
    cmd = conv.job_command(Path("/bin"), "lm_torch", "binsgdm", 2, args, "out.json", ["--lr", "3e-3"])
    assert cmd[cmd.index("--optimizer") + 1] == "binsgdm" and cmd[-2:] == ["--lr", "3e-3"]
    only = conv.parse_args(["--optimizers", "--variant", "binsgdm+x=--lr 1"])
    assert [j[3] for j in conv.job_list(only, ["lm_torch"])] == ["binsgdm+x", "binsgdm+x"]
    for bad in ["binsgdm=--lr 1", "nosuch+x=--lr 1", "mars/binsgdm+x=--lr 1"]:
        with pytest.raises(SystemExit):
            conv.parse_args(["--variant", bad])
    with pytest.raises(SystemExit):
        conv.parse_args(["--optimizers"])


def test_runner_reports_a_failing_or_hanging_job():
    conv = _load_convergence()
    with pytest.raises(conv.JobFailed, match="exit status 3") as err:
        conv.run_job([sys.executable, "-c", "print('the reason'); raise SystemExit(3)"], 60, echo=False)
    assert "the reason" in str(err.value)
    with pytest.raises(conv.JobFailed, match="timed out"):
        conv.run_job([sys.executable, "-c", "import time; time.sleep(60)"], 1, echo=False)



def _load_keras_fit_table():
    spec = importlib.util.spec_from_file_location("keras_fit_table", HERE.parent / "benchmarks" / "keras_fit_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keras_fit_table_gaps_are_paired_by_seed_and_runs_are_reused(tmp_path):
    table = _load_keras_fit_table()

    def run(config, seed, acc, np_=2, epochs=30, **extra):
        return {"np": np_, "config": config, "seed": seed, "epochs": epochs, "final_test_accuracy": acc,
                "identical_weights": True, "bytes_per_step": 100.0, **extra}

    runs = [run("none", 0, 0.97), run("none", 1, 0.99), run("none", 2, 0.95),
            run("ef_sign", 0, 0.96), run("ef_sign", 1, 0.99)]
    rows = table.summarize(runs, 2, ["none", "ef_sign"])
    # ef_sign has seeds 0 and 1 only: its gap is against none's seeds 0 and 1 (-0.5), not
    # against none's three-seed mean (97.0, which would give +0.5).
    assert rows["ef_sign"]["seed_gaps"] == pytest.approx({0: -1.0, 1: 0.0})
    assert rows["ef_sign"]["gap"] == pytest.approx(-0.5) and rows["none"]["mean"] == pytest.approx(97.0)
    args = table.parse_args(["none", "ef_sign", "--np", "2", "3", "--seeds", "0", "1"])
    text = table.markdown_table(args, runs + [run("ef_sign", 0, 0.9, np_=3, error="exit status 1")])
    assert "| 2 | ef_sign | 97.50 | 96.00-99.00 | 96.00 / 99.00 | -0.50 | -1.00 / +0.00 | yes |" in text
    assert "| 3 | ef_sign | FAILED (exit status 1) |" in text
    # --load: successful runs with the same epochs are reused, failed or other-length ones not.
    saved = tmp_path / "runs.json"
    saved.write_text(json.dumps(runs + [run("marsit", 0, 0.9, error="x"), run("marsit", 1, 0.9, epochs=10)]))
    found = table.load_runs([saved], 30)
    assert set(found) == {(2, "none", 0), (2, "none", 1), (2, "none", 2), (2, "ef_sign", 0), (2, "ef_sign", 1)}
    cmd = table.job_command(Path("/bin"), 3, "opt=binsgdm", 4, 10, "o.json")
    assert cmd[:3] == ["/bin/horovodrun", "-np", "3"] and cmd[cmd.index("--optimizer") + 1] == "binsgdm"
    assert cmd[cmd.index("--seed") + 1] == "4" and cmd[cmd.index("--epochs") + 1] == "10"

# --- the scripts under horovodrun ---------------------------------------------------------
# Each framework's examples run as cases of one horovodrun job (tests/mp/examples_worker.py:
# one start-up for all of them); every case is checked by its own test below.
TINY = ["--steps", "6", "--eval-every", "3", "--batch", "4", "--context", "32", "--d-model", "32",
        "--heads", "2", "--layers", "1", "--val-windows", "8", "--corpus-bytes", str(SMALL)]
LM_ONE_BIT = {"onebit_adam": ["--freeze-step", "3"],
              "zero_one_adam": ["--var-freeze-step", "3", "--local-step-scaler", "1", "--local-step-clipper", "2"],
              "binsgdm": []}
DIGITS_TORCH = ["adam", "onebit_adam", "zero_one_adam", "binsgdm"]
DIGITS_TF = ["adam", "zero_one_adam", "binsgdm"]
KERAS_FIT = {"onebit_adam": ["--optimizer", "onebit_adam"],
             "mixed_float16-ef_sign": ["--policy", "mixed_float16", "--compression", "ef_sign"],
             # The 1-bit optimizer inside hq.DistributedOptimizer for loss scaling: compile's own
             # LossScaleOptimizer around it is refused on every rank.
             "mixed_float16-onebit_adam": ["--policy", "mixed_float16", "--optimizer", "onebit_adam"]}


def torch_cases(out):
    cases = [["lm_torch-adam", "lm_torch.py", ["--optimizer", "adam", *TINY]]]
    cases += [[f"lm_torch-{o}", "lm_torch.py", ["--optimizer", o, *TINY, *extra]] for o, extra in LM_ONE_BIT.items()]
    cases += [[f"pytorch_train-{o}", "pytorch_train.py", ["--optimizer", o, "--epochs", "1"]] for o in DIGITS_TORCH]
    cases += [[f"gan-{path}", "gan_torch.py", ["--path", path, "--steps", "50"]] for path in ("ours", "stock")]
    return _with_json(cases, out)


def tf_cases(out):
    # Six steps with the variance frozen after three: at the default lr 3e-3 the Keras model
    # (a different initialisation than torch's) overshoots once 1-bit rounds begin.
    cases = [[f"lm_keras-{o}", "lm_keras.py", ["--optimizer", o, *TINY, "--freeze-step", "3", "--lr", "1e-3"]]
             for o in ("adam", "onebit_adam")]
    cases += [[f"tensorflow2_train-{o}", "tensorflow2_train.py", ["--optimizer", o, "--epochs", "1"]] for o in DIGITS_TF]
    cases += [[f"keras_fit-{k}", "keras_fit.py", [*args, "--epochs", "2"]] for k, args in KERAS_FIT.items()]
    return _with_json(cases, out)


def _with_json(cases, out):
    return [[label, str(EXAMPLES / script), [*args, "--json", str(out / f"{label}.json")]]
            for label, script, args in cases if not script.startswith("gan")] + \
           [[label, str(EXAMPLES / script), args] for label, script, args in cases if script.startswith("gan")]


def _examples_job(tmp_path_factory, name, cases, timeout):
    out = tmp_path_factory.mktemp(name)
    run_horovod(HERE / "mp" / "examples_worker.py", 2, [out, json.dumps(cases(out))], timeout=timeout)
    return out


@pytest.fixture(scope="module")
def torch_examples(tmp_path_factory):
    return _examples_job(tmp_path_factory, "torch_examples", torch_cases, timeout=420)


@pytest.fixture(scope="module")
def tf_examples(tmp_path_factory):
    return _examples_job(tmp_path_factory, "tf_examples", tf_cases, timeout=600)


def _case(out, label, summary=True):
    """One case's JSON summary (or its rank-0 output), after checking it ran."""
    status = json.loads((out / f"{label}.status").read_text())
    assert status["ok"], status.get("error")
    if summary:
        return json.loads((out / f"{label}.json").read_text())
    return (out / f"{label}.out").read_text()


def _check_summary(s, optimizer):
    assert s["optimizer"] == optimizer and s["ranks"] == 2 and s["steps"] == 6
    assert [h["step"] for h in s["history"]] == [3, 6]
    assert all(np.isfinite(h["val_loss"]) and np.isfinite(h["train_loss"]) for h in s["history"])
    assert s["final_val_loss"] < np.log(256) + 0.1
    assert len(s["weights_digests"]) == 2 and len(s["bytes_per_step_per_rank"]) == 2
    assert sum(s["step_kinds"].values()) == 6


@pytest.mark.multiprocess
@pytest.mark.timeout(480)  # the job's own limit (420 s) runs in the first test's set-up
def test_lm_torch_trains_with_adam_on_two_ranks(torch_examples):
    s = _case(torch_examples, "lm_torch-adam")
    _check_summary(s, "adam")
    assert s["ranks_agree"] and s["final_val_loss_spread"] == 0.0
    assert s["comm_rounds"] == 6
    # fp32 allreduce: 2 (n-1)/n * 4 bytes per parameter (plus the one-off check, < 1 byte/step).
    assert s["bytes_per_step"] == pytest.approx(s["fp32_allreduce_bytes_per_step"], abs=10)


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
@pytest.mark.parametrize("optimizer", list(LM_ONE_BIT))
def test_lm_torch_runs_the_one_bit_optimizers(torch_examples, optimizer):
    s = _case(torch_examples, f"lm_torch-{optimizer}")
    _check_summary(s, optimizer)
    assert s["bytes_per_step"] < s["fp32_allreduce_bytes_per_step"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(660)  # the job's own limit (600 s) runs in the first test's set-up
@pytest.mark.parametrize("optimizer", ["adam", "onebit_adam"])
def test_lm_keras_trains_on_two_ranks(tf_examples, optimizer):
    s = _case(tf_examples, f"lm_keras-{optimizer}")
    _check_summary(s, optimizer)
    if optimizer == "adam":
        assert s["ranks_agree"]
        assert s["bytes_per_step"] == pytest.approx(s["fp32_allreduce_bytes_per_step"], abs=10)
    else:
        assert s["bytes_per_step"] < s["fp32_allreduce_bytes_per_step"]


# --- the digits examples' --optimizer -------------------------------------------------
def _digits_case(examples, script, optimizer):
    """What digits example ``script`` reports for ``--optimizer``: Adam reduces in fp32
    through our DistributedOptimizer; the 1-bit optimizers send fewer bytes than that, and
    their own meters account for every step. Returns the report."""
    s = _case(examples, f"{script}-{optimizer}")
    assert s["optimizer"] == optimizer and s["ranks"] == 2 and len(s["history"]) == 1
    assert np.isfinite(s["history"][0]["loss"]) and s["final_test_accuracy"] > 0.3
    assert s["bytes_per_step"] > 0 and s["mean_bytes_per_step"] > 0
    if optimizer == "adam":
        assert s["bytes_per_step"] == pytest.approx(s["fp32_allreduce_bytes_per_step"], rel=0.01)
    else:
        assert s["mean_bytes_per_step"] < s["fp32_allreduce_bytes_per_step"]
        assert sum(s["kind_counts"].values()) == 22 and 0 < s["comm_rounds"] <= 22  # 1437 // 2 // 32 steps
    return s


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
@pytest.mark.parametrize("optimizer", DIGITS_TORCH)
def test_pytorch_train_takes_every_optimizer(torch_examples, optimizer):
    s = _digits_case(torch_examples, "pytorch_train", optimizer)
    if optimizer == "adam":  # fp32 allreduce through our DistributedOptimizer
        assert s["comm_rounds"] is None
    elif optimizer == "zero_one_adam":  # local steps skip communication
        kinds = s["kind_counts"]
        assert kinds.get("local", 0) > 0 and s["comm_rounds"] == 22 - kinds["local"]


def test_one_bit_optimizer_refuses_a_compressor():
    import subprocess
    proc = subprocess.run([sys.executable, str(EXAMPLES / "pytorch_train.py"), "--optimizer", "binsgdm",
                           "--compression", "ef_sign"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "communicates by itself" in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("optimizer", DIGITS_TF)
def test_tensorflow2_train_takes_the_optimizers(tf_examples, optimizer):
    _digits_case(tf_examples, "tensorflow2_train", optimizer)


# --- the GAN example: two optimizers, one compression object --------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
@pytest.mark.parametrize("path", ["ours", "stock"])
def test_gan_example_keeps_one_state_per_optimizer(torch_examples, path):
    # Generator and discriminator have identically named and shaped parameters (0.weight
    # is 32x2 in both): had they shared one residual per name, their states would be equal.
    out = _case(torch_examples, f"gan-{path}", summary=False)
    assert f"2 ranks, {path} optimizer, one object for both" in out, out
    losses = re.search(r"step +50 +D loss (\S+) +G loss (\S+)", out)
    assert losses and all(np.isfinite(float(v)) for v in losses.groups()), out
    equal, total = map(int, re.search(r"state entries equal between the two optimizers: (\d+) of (\d+)", out).groups())
    assert total >= 4 and equal == 0, out  # a residual per parameter, none shared
    sent = re.search(r"bytes sent per rank: generator ([\d,]+), discriminator ([\d,]+)", out).groups()
    assert all(int(v.replace(",", "")) > 0 for v in sent), out
    assert "weights identical on every rank: True" in out, out


# --- keras_fit.py: a 1-bit optimizer, mixed_float16 ------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("case", list(KERAS_FIT))
def test_keras_fit_example_runs(tf_examples, case):
    args = KERAS_FIT[case]
    s = _case(tf_examples, f"keras_fit-{case}")
    opts = dict(zip(args[::2], args[1::2]))
    assert s["ranks"] == 2 and len(s["history"]) == 2
    assert s["policy"] == opts.get("--policy", "float32") and s["optimizer"] == opts.get("--optimizer", "sgd")
    assert s["identical_weights"], s["weights_digest_per_rank"]
    assert all(np.isfinite(h["loss"]) for h in s["history"]) and s["final_test_accuracy"] > 0.5
    # The second epoch: 1-bit rounds only (1-bit Adam's warm-up is the first quarter of
    # the run), or EF-SignSGD's bits; either far below the fp32 allreduce.
    assert 0 < s["bytes_per_step"] < s["fp32_allreduce_bytes_per_step"] / 8, s["bytes_per_step"]
