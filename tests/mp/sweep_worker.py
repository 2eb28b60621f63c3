"""Runs inside every rank for tests/test_fault_sweep_mp.py: the fault and input sweep of
tests/test_fault_sweep.py (which runs on simulated ranks) under real Horovod.

``python sweep_worker.py FRAMEWORK OUTDIR``. Per case, each rank records what the test
judges: the output's digest (ranks must agree), shape, finiteness, the bounds the oracle
test checks, and whether the compressor's state survived a non-finite step unchanged.
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_fault_sweep import COMPRESSORS, HP, RULES, SIZES, inputs  # noqa: E402

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
if FRAMEWORK == "torch":
    import torch
    import horovod.torch as hvd
    import hvd_quant.torch as hq
    from hvd_quant.torch.backend import TorchBackend as Backend
    from hvd_quant.torch.comm import HorovodTorchComm as Comm

    def tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a))
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import hvd_quant.tensorflow as hq
    from hvd_quant.tensorflow.backend import TFBackend as Backend
    from hvd_quant.tensorflow.comm import HorovodTFComm as Comm

    def tensor(a):
        return tf.constant(a)

import hvd_quant  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
B = Backend()
results = {"rank": RANK, "size": SIZE}


def record(key, fn):
    try:
        results[key] = fn()
    except Exception as exc:  # recorded for the test to judge
        import traceback
        results[key] = {"error": type(exc).__name__, "message": str(exc)[:1500],
                        "trace": traceback.format_exc()[-2500:]}


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a, np.float32)).tobytes())
    return h.hexdigest()[:16]


def label(name, opts):
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def compressor_sweep():
    out = {}
    for name, opts in COMPRESSORS:
        for d in SIZES:
            for kind in ("normal", "zeros", "subnormal", "near_max"):
                xs = inputs(kind, SIZE, d)
                runner = CompressorRunner(hvd_quant.get(name, **opts), B, seed=1)
                comm = Comm()
                segs = [("w", d // 2), ("b", d - d // 2)]
                ys = [B.to_numpy(runner.reduce(tensor(xs[RANK]), comm, f"sweep.{name}.{d}.{kind}", segs))
                      for _ in range(2 if kind != "near_max" else 1)]
                top = float(np.abs(np.asarray(xs)).max(initial=0.0))
                out[f"{label(name, opts)}/{d}/{kind}"] = {
                    "digest": digest(ys), "shape_ok": all(y.shape == (d,) and y.dtype == np.float32 for y in ys),
                    "finite": all(bool(np.isfinite(y).all()) for y in ys),
                    "max_abs": max((float(np.abs(y).max(initial=0.0)) for y in ys), default=0.0),
                    "zeros_ok": kind != "zeros" or all(bool(np.all(np.abs(y) == opts.get("scale", 0.0))) for y in ys),
                    "input_max": top}
    return out


def non_finite_sweep():
    """One element of the last rank's input is inf/-inf/NaN after two warm steps."""
    out = {}
    d, segs = 37, [("w", 20), ("b", 17)]
    for name, opts in COMPRESSORS:
        for bad in (np.inf, -np.inf, np.nan):
            runner = CompressorRunner(hvd_quant.get(name, **opts), B, seed=1)
            comm = Comm()
            for w in range(2):
                runner.reduce(tensor(inputs("normal", SIZE, d + w)[RANK][:d]), comm, "nf", segs)
            before = {k: np.array(v) for k, v in runner.state_dict().items()}
            x = inputs("normal", SIZE, d)[RANK].copy()
            if RANK == SIZE - 1:
                x[11] = bad
            y = B.to_numpy(runner.reduce(tensor(x), comm, "nf", segs))
            after = runner.state_dict()
            out[f"{label(name, opts)}/{bad}"] = {
                "all_non_finite": bool(not np.isfinite(y).any()),
                "only_element_11": bool(not np.isfinite(y[11]) and np.isfinite(np.delete(y, 11)).all()),
                "state_unchanged": before.keys() == after.keys() and all(
                    np.array_equal(before[k], np.asarray(after[k])) for k in before)}
    return out


def make_optimizer(name, params, lr):
    """This framework's 1-bit optimizer for a sweep label of tests/test_fault_sweep.RULES."""
    options = {"onebit_adam": dict(freeze_step=3),
               "zero_one_adam": dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=2,
                                     local_step_clipper=2),
               "binsgdm_flat": dict(ranks_per_node=SIZE), "binsgdm_2x2": dict(ranks_per_node=2)}[name]
    cls = {"onebit": hq.OnebitAdam, "zero": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}[name.split("_")[0]]
    hp = {"betas": (0.9,)} if name.startswith("binsgdm") else {"betas": HP["betas"], "eps": HP["eps"]}
    if FRAMEWORK == "torch":
        return cls(params, lr=lr, **hp, **options)
    return cls(learning_rate=lr, **hp, **options)


def optimizer_rules_sweep():
    """The 1-bit optimizers on awkward inputs (tests/test_fault_sweep.py's cases)."""
    out = {}
    for name, _ in RULES:
        if name == "binsgdm_2x2" and SIZE % 2:
            continue
        for d in SIZES:
            for kind in ("normal", "zeros", "subnormal"):
                grads = [inputs(kind, SIZE, d)[RANK] for _ in range(10)]
                if FRAMEWORK == "torch":
                    p = torch.nn.Parameter(torch.ones(d))
                    opt = make_optimizer(name, [p], 1e-2)
                    for g in grads:
                        p.grad = torch.from_numpy(g.copy())
                        opt.step()
                    x = p.detach().numpy()
                else:
                    v = tf.Variable(np.ones(d, np.float32), name=f"p{d}")
                    opt = make_optimizer(name, None, 1e-2)
                    for g in grads:
                        opt.apply([tf.constant(g)], [v])
                    x = v.numpy()
                out[f"{name}/{d}/{kind}"] = {
                    "digest": digest([x]), "finite": bool(np.isfinite(x).all()), "skipped": int(opt.skipped_steps),
                    "unchanged": bool(np.array_equal(x, np.ones(d, np.float32)))}
    return out


def torch_none_gradient():
    """A parameter with no gradient on one rank only is reduced as zeros there."""
    out = {}
    configs = [("distributed/" + label(n, o), n, o) for n, o in COMPRESSORS] + \
        [(f"optimizer/{n}", n, None) for n in ("onebit_adam", "zero_one_adam", "binsgdm")]
    for key, name, opts in configs:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 4), "b": torch.nn.Linear(6, 4)})
        if opts is None:
            cls = {"onebit_adam": hq.OnebitAdam, "zero_one_adam": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}[name]
            extra = {"onebit_adam": dict(freeze_step=2), "zero_one_adam": dict(var_freeze_step=2)}.get(name, {})
            opt = cls(model.parameters(), lr=1e-2, named_parameters=model.named_parameters(), **extra)
        else:
            opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(),
                                          compression=hq.Compression.get(name, **opts))
        rng = np.random.default_rng(RANK)
        for step in range(4):
            x = torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32))
            opt.zero_grad(set_to_none=True)
            loss = model["a"](x).square().mean()
            if not (RANK == SIZE - 1 and step in (1, 2)):  # "b" unused on the last rank
                loss = loss + model["b"](x).square().mean()
            loss.backward()
            opt.step()
        params = [p.detach().numpy() for p in model.parameters()]
        out[key] = {"digest": digest(params), "finite": all(bool(np.isfinite(p).all()) for p in params)}
    return out


def tf_none_gradient():
    """The same with our tape and our Keras optimizers (a None gradient on one rank)."""
    import keras
    out = {}
    configs = [("tape/" + label(n, o), n, o) for n, o in COMPRESSORS] + \
        [(f"optimizer/{n}", n, None) for n in ("onebit_adam", "zero_one_adam", "binsgdm")]
    for key, name, opts in configs:
        keras.utils.set_random_seed(0)
        a, b = keras.layers.Dense(4, name="a"), keras.layers.Dense(4, name="b")
        a.build((None, 6))
        b.build((None, 6))
        variables = a.trainable_variables + b.trainable_variables
        if opts is None:
            cls = {"onebit_adam": hq.OnebitAdam, "zero_one_adam": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}[name]
            extra = {"onebit_adam": dict(freeze_step=2), "zero_one_adam": dict(var_freeze_step=2)}.get(name, {})
            opt = cls(learning_rate=1e-2, **extra)
        else:
            opt = keras.optimizers.SGD(0.1)
            compression = hq.Compression.get(name, **opts)
        rng = np.random.default_rng(RANK)
        for step in range(4):
            x = tf.constant(rng.standard_normal((8, 6)).astype(np.float32))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(a(x)))
                if not (RANK == SIZE - 1 and step in (1, 2)):
                    loss = loss + tf.reduce_mean(tf.square(b(x)))
            if opts is None:
                grads = tape.gradient(loss, variables)
            else:
                grads = hq.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)
                grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
            opt.apply(grads, variables)
        params = [v.numpy() for v in variables]
        out[key] = {"digest": digest(params), "finite": all(bool(np.isfinite(p).all()) for p in params)}
    return out


record("compressors", compressor_sweep)
record("non_finite", non_finite_sweep)
record("rules", optimizer_rules_sweep)
record("none_gradient", torch_none_gradient if FRAMEWORK == "torch" else tf_none_gradient)
OUT.mkdir(parents=True, exist_ok=True)
(OUT / f"rank{RANK}.json").write_text(json.dumps(results))
print(f"rank {RANK}: wrote {OUT / f'rank{RANK}.json'}")
