"""Compression objects are configuration; state belongs to whoever uses them.

Unit tests (numpy oracle, one process): the state store's owner-supplied variables, the
runner's random-stream checkpoints, the handle's table of owners. Multi-process tests
(``tests/mp/ownership_worker.py``): one object shared by a GAN's two optimizers (Horovod's
stock torch optimizer and ours), by two TF tapes, two Keras optimizers and Horovod's stock
tape, for models with identical parameter names: no state is shared, and training is bit
for bit what it is with separate objects.
"""

import gc

import numpy as np
import pytest

import hvd_quant
from hvd_quant.core.backend import NumpyBackend
from hvd_quant.core.handle import CompressorHandle
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.core.simulate import ThreadWorld
from hvd_quant.core.state import StateStore

from horovod_launch import HERE, rank_results_fixture

B = NumpyBackend()
SEGMENTS = [("w", 5), ("b", 3)]


class NumpyHandle(CompressorHandle):
    framework = "numpy"

    def make_backend(self):
        return B


class Owner:
    """Stands for an optimizer (anything weakly referenceable)."""


def reduce_steps(runners, xs, group="g"):
    """xs[step][rank] through one runner per rank; returns outs[step][rank]."""
    outs = []
    for step_inputs in xs:
        world = ThreadWorld(len(runners))
        outs.append(world.run(lambda c: runners[c.rank].reduce(step_inputs[c.rank], c, group, SEGMENTS)))
    return outs


def inputs(n, steps, seed):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(8).astype(np.float32) for _ in range(n)] for _ in range(steps)]


# --- state store -----------------------------------------------------------------------------
def test_store_without_factory_creates_lazily_as_before():
    store = StateStore(B)
    view = store.view("g", SEGMENTS)
    assert np.array_equal(view.get("residual"), np.zeros(8, np.float32))
    view.set("residual", np.arange(8, dtype=np.float32))
    assert store.state_dict()["b/residual"].tolist() == [5, 6, 7]


def test_store_with_factory_creates_only_when_allocated():
    made = []

    def make_variable(name, initial):
        made.append(name)
        return B.variable(initial)

    store = StateStore(B, make_variable)
    store.load_state_dict({"w/residual": np.ones(5)})  # waits for its buffer
    store.allocate("g", SEGMENTS, {"residual": "float32"})
    assert made == ["g_residual"] and len(store.variables()) == 1
    assert store.view("g", SEGMENTS).get("residual").tolist() == [1] * 5 + [0] * 3
    with pytest.raises(KeyError, match="not allocated"):
        store.view("g", SEGMENTS).get("other")
    with pytest.raises(ValueError, match="elements"):
        store.load_state_dict({"b/residual": np.ones(4)})


def test_runner_build_allocates_declared_slots():
    made = []
    runner = CompressorRunner(hvd_quant.get("ef_sign"), B,
                              make_variable=lambda n, v: made.append(n) or B.variable(v))
    assert runner.state_slots() == ("residual",)
    runner.build(0, [("fused0", SEGMENTS)])
    assert made == ["fused0_residual"] and len(runner.variables()) == 1
    assert CompressorRunner(hvd_quant.get("global_qsgd"), B).state_slots() == ()


def test_random_streams_resume_from_a_checkpoint():
    comp, n = hvd_quant.get("global_qsgd"), 2
    xs = inputs(n, 3, seed=1)
    first = [CompressorRunner(comp, B, seed=4) for _ in range(n)]
    reduce_steps(first, xs[:2])
    saved = [r.rng_state() for r in first]
    assert all(s for s in saved), "a stochastic compressor has drawn"
    restored = [CompressorRunner(comp, B, seed=4) for _ in range(n)]
    for runner, state in zip(restored, saved):
        runner.load_rng_state(state)
    a, b = reduce_steps(first, xs[2:]), reduce_steps(restored, xs[2:])
    np.testing.assert_array_equal(a[0][0], b[0][0])


def test_a_scope_prefixes_collective_names():
    assert CompressorRunner(hvd_quant.get("none"), B, scope="o7").collective_prefix("fused0") == "o7.fused0"
    assert CompressorRunner(hvd_quant.get("none"), B).collective_prefix("fused0") == "fused0"
    handle = NumpyHandle("ef_sign")
    assert handle.make_runner().scope != handle.make_runner().scope


# --- the handle is configuration -----------------------------------------------------------
def test_each_owner_gets_its_own_runner():
    handle = NumpyHandle("ef_sign")
    a, b = Owner(), Owner()
    assert handle.owned(a) is handle.owned(a)
    assert handle.owned(a) is not handle.owned(b)
    assert handle.owned(a).runner is not handle.owned(b).runner
    v1, v2 = Owner(), Owner()
    assert handle.owned([v1, v2]) is handle.owned((v2, v1)), "a variable set in any order"
    assert handle() is not handle and handle().config() == handle.config()


def test_equal_configurations_share_their_owners_state():
    """``Compression.marsit`` makes a new handle on every access, as a tf.function step
    does on every trace: the same owner must find the same state through any equal one."""
    owner = Owner()
    first = NumpyHandle("marsit", seed=1)
    assert NumpyHandle("marsit", seed=1).owned(owner) is first.owned(owner)
    assert first().owned(owner) is first.owned(owner)
    assert NumpyHandle("marsit", seed=2).owned(owner) is not first.owned(owner)
    assert NumpyHandle("marsit", seed=1, compensation=False).owned(owner) is not first.owned(owner)
    assert NumpyHandle("ef_sign", seed=1).owned(owner) is not first.owned(owner)


def test_tf_tape_built_inside_a_tf_function_keeps_its_state_across_traces():
    """The documented custom loop: the tape and its compression object are made inside
    the traced step (a failure here: 'tf.function only supports singleton tf.Variables')."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import horovod.tensorflow as hvd
    import hvd_quant.tensorflow as hq

    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32)
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hq.DistributedGradientTape(tape, compression=hq.Compression.marsit)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(step(x, y)) for _ in range(3)]
    assert losses[2] < losses[0]


def test_dead_owners_take_their_state_with_them():
    handle = NumpyHandle("ef_sign")
    owner = Owner()
    handle.owned(owner)
    assert len(list(handle._live_owners())) == 1
    del owner
    gc.collect()
    assert list(handle._live_owners()) == [] and handle._owners == {}


def test_shared_handle_keeps_owners_apart_and_equals_separate_handles():
    n = 2
    shared = NumpyHandle("ef_sign")
    g, d = Owner(), Owner()
    xs_g, xs_d = inputs(n, 3, seed=2), inputs(n, 3, seed=3)
    # Identical parameter names in both owners ("w", "b"): a per-name store would mix them.
    out_g = reduce_steps([CompressorRunner(shared.algorithm, B) for _ in range(n)], xs_g)
    out_d = reduce_steps([CompressorRunner(shared.algorithm, B) for _ in range(n)], xs_d)
    # Rank 0 holds the shared object; the other ranks' runners only mirror its scope.
    own_g, own_d = shared.owned(g).runner, shared.owned(d).runner
    runners_g = [own_g] + [CompressorRunner(shared.algorithm, B, scope=own_g.scope) for _ in range(n - 1)]
    runners_d = [own_d] + [CompressorRunner(shared.algorithm, B, scope=own_d.scope) for _ in range(n - 1)]
    for step in range(3):  # interleaved, as a GAN steps its two optimizers
        got_g = reduce_steps(runners_g, [xs_g[step]])[0]
        got_d = reduce_steps(runners_d, [xs_d[step]])[0]
        np.testing.assert_array_equal(got_g[0], out_g[step][0])
        np.testing.assert_array_equal(got_d[0], out_d[step][0])
    state_g, state_d = shared.state_dict(g), shared.state_dict(d)
    assert sorted(state_g) == sorted(state_d) == ["b/residual", "w/residual"]
    assert not np.array_equal(state_g["w/residual"], state_d["w/residual"])


def test_state_dict_needs_the_owner_when_ambiguous():
    handle = NumpyHandle("ef_sign")
    assert handle.state_dict() == {}
    with pytest.raises(TypeError, match="owner"):
        handle.load_state_dict({"w/residual": np.ones(5)})
    a, b = Owner(), Owner()
    handle.load_state_dict({"w/residual": np.ones(5), "hvd_quant.rng/0/calls": np.int64(3)}, a)
    assert handle.state_dict()["w/residual"].tolist() == [1] * 5  # one owner: no need to name it
    assert handle.owned(a).runner._rng_restored == {0: 3}
    handle.owned(b)
    with pytest.raises(ValueError, match="2 owners"):
        handle.state_dict()
    assert handle.state_dict(b) == {}


# --- real ranks --------------------------------------------------------------------------------
WORKER = HERE / "mp" / "ownership_worker.py"
# The jobs run in module fixtures (600 s), whose setup pytest-timeout counts against the
# first test that uses them: the limit must exceed the job's own, not pyproject's 300 s.
pytestmark = pytest.mark.timeout(660)


def _ok(value):
    assert not (isinstance(value, dict) and "error" in value), value
    return value


torch_job = rank_results_fixture(WORKER, "torch")
tf_job = rank_results_fixture(WORKER, "tf")
legacy_job = rank_results_fixture(WORKER, "legacy", env={"TF_USE_LEGACY_KERAS": "1"})


def check_shared_equals_separate(result, models_key, states_key, stateful=False, label=None):
    """Training with one shared compression object equals training with one per owner;
    ``stateful``: and each owner of the shared object has its own state."""
    shared, separate = result["shared"], result["separate"]
    assert shared[models_key] == separate[models_key], "training differs with a shared object"
    assert shared[states_key] == separate[states_key], "state differs with a shared object"
    if stateful:
        assert shared[states_key][0] != shared[states_key][1], label


def check_rebuilt_starts_fresh(job, key):
    """A model rebuilt with the same compression object trains as with a fresh one."""
    for rank in job:
        r = _ok(rank[key])
        assert r["first"] == r["again"] == r["fresh"]


def check_two_model_tapes(job, key, stateful):
    """Every rank's ``job[r][key]`` (tests/mp/ownership_worker.py's ``two_model_tape`` per
    compressor): two models with identical variable names, one compression object shared
    or one each; ``stateful(name)``: whether compressor ``name`` keeps state per owner."""
    for rank in job:
        for name, result in _ok(rank[key]).items():
            assert result["shared"]["names"][0] == result["shared"]["names"][1], "identical names"
            check_shared_equals_separate(result, "models", "states", stateful(name), name)


@pytest.mark.multiprocess
def test_torch_gan_with_one_object_trains_like_two(torch_job):
    for rank in torch_job:
        for label, result in _ok(rank["gan"]).items():
            shared, separate = result["shared"], result["separate"]
            assert (shared["G"], shared["D"]) == (separate["G"], separate["D"]), label
            assert (shared["state_G"], shared["state_D"]) == (separate["state_G"], separate["state_D"]), label
            if "ef_sign" in label or "marsit" in label:  # stateful: each optimizer its own residuals
                assert sorted(shared["state_G"]) == sorted(shared["state_D"])
                assert shared["state_G"]["0.weight/residual"] != shared["state_D"]["0.weight/residual"], label
            assert shared["bytes_G"] > 0 and shared["bytes_D"] > 0
    for label in _ok(torch_job[0]["gan"]):  # and every rank has the same models
        assert torch_job[0]["gan"][label]["shared"]["G"] == torch_job[1]["gan"][label]["shared"]["G"]


@pytest.mark.multiprocess
def test_torch_model_rebuilt_with_the_same_object_starts_fresh(torch_job):
    check_rebuilt_starts_fresh(torch_job, "rebuilt")


@pytest.mark.multiprocess
def test_torch_stock_optimizer_state_checkpoints_per_optimizer(torch_job):
    for rank in torch_job:
        result = _ok(rank["stock_checkpoint"])
        assert result["ef_sign"]["equal"] and result["global_qsgd"]["equal"]
        assert result["ef_sign"]["keys"] == ["0.bias/residual", "0.weight/residual",
                                             "2.bias/residual", "2.weight/residual"]
        assert result["global_qsgd"]["keys"] == [f"hvd_quant.rng/{rank_index}/calls"
                                                 for rank_index in [torch_job.index(rank)]]


@pytest.mark.multiprocess
def test_tf_tapes_sharing_one_object_in_one_graph(tf_job):
    check_two_model_tapes(tf_job, "tape", stateful=lambda name: name != "global_qsgd")
    assert tf_job[0]["tape"]["marsit"]["shared"]["models"] == tf_job[1]["tape"]["marsit"]["shared"]["models"]


@pytest.mark.multiprocess
def test_tf_model_rebuilt_with_the_same_object_starts_fresh(tf_job):
    check_rebuilt_starts_fresh(tf_job, "tape_rebuilt")


@pytest.mark.multiprocess
def test_keras_optimizers_sharing_one_object(tf_job):
    for rank in tf_job:
        for name, result in _ok(rank["keras"]).items():
            check_shared_equals_separate(result, "models", "states", stateful=name == "ef_sign")


@pytest.mark.multiprocess
def test_stock_tf_tape_sharing_one_object(legacy_job):
    check_two_model_tapes(legacy_job, "stock_tape", stateful=lambda name: name == "ef_sign")
