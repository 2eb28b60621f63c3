"""Runs inside every rank for tests/test_fault_sweep_mp.py: the fault and input sweep of
tests/test_fault_sweep.py (which runs on simulated ranks) under real Horovod.

``python sweep_worker.py FRAMEWORK OUTDIR``. Per case, each rank records what the test
judges: the output's digest (ranks must agree), shape, finiteness, the bounds the oracle
test checks, and whether the compressor's state survived a non-finite step unchanged.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_fault_sweep import COMPRESSORS, HP, OPTIMIZER_FAULTS, RULES, SIZES, inputs  # noqa: E402

import hvd_quant  # noqa: E402
import worker_common  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
torch, tf, hvd, hq, B, Comm, tensor = worker_common.framework(FRAMEWORK)
RANK, SIZE = hvd.rank(), hvd.size()
# Seconds per part, printed in the job's output: what each part adds to CI time.
results = worker_common.Results(message_chars=1500, trace_chars=2500, timing="printed", rank=RANK, size=SIZE)
record = results.record


def digest(arrays):
    return worker_common.digest(arrays, np.float32)


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


def make_optimizer(name, params, lr, **override):
    """This framework's 1-bit optimizer for a sweep label of tests/test_fault_sweep.RULES
    (``override`` replaces its options)."""
    options = {"onebit_adam": dict(freeze_step=3),
               "zero_one_adam": dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=2,
                                     local_step_clipper=2),
               "binsgdm_flat": dict(ranks_per_node=SIZE), "binsgdm_2x2": dict(ranks_per_node=2)}[name]
    options = dict(options, **override)
    cls = {"onebit": hq.OnebitAdam, "zero": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}[name.split("_")[0]]
    hp = {"betas": (0.9,)} if name.startswith("binsgdm") else {"betas": HP["betas"], "eps": HP["eps"]}
    if FRAMEWORK == "torch":
        return cls(params, lr=lr, **hp, **options)
    return cls(learning_rate=lr, **hp, **options)


class Stepper:
    """One 1-bit optimizer of this framework over one flat parameter, with its state.

    ``graph``: TensorFlow only, every step through one ``tf.function`` (as in
    ``model.fit``), where the skip is a ``tf.cond`` rather than a Python branch.
    """

    def __init__(self, name, x0, lr=1e-2, graph=False, **options):
        self.name = name
        if FRAMEWORK == "torch":
            self.p = torch.nn.Parameter(torch.from_numpy(np.array(x0, np.float32)))
            self.opt = make_optimizer(name, [self.p], lr, **options)
        else:
            self.v = tf.Variable(np.array(x0, np.float32), name="p")
            self.opt = make_optimizer(name, None, lr, **options)
            apply = lambda g: self.opt.apply([g], [self.v])  # noqa: E731
            self._apply = tf.function(apply) if graph else apply

    def step(self, g):
        if FRAMEWORK == "torch":
            self.p.grad = torch.from_numpy(np.array(g, np.float32))
            self.opt.step()
        else:
            self._apply(tf.constant(np.array(g, np.float32)))

    def x(self):
        return (self.p.detach() if FRAMEWORK == "torch" else self.v).numpy().copy()

    def slots(self):
        if FRAMEWORK == "torch":
            return {k: v.numpy().copy() for k, v in self.opt.state["hvd_quant.group0"]["slots"].items()}
        return {k: v.numpy().copy() for k, v in self.opt._hq_slots.items()}

    def scalars(self):
        if FRAMEWORK == "torch":
            return {k: float(v) for k, v in self.opt.state["hvd_quant.group0"]["scalars"].items()}
        return {k: float(v.numpy()) for k, v in self.opt._hq_scalars.items()}

    def skipped(self):
        return int(self.opt.skipped_steps)

    def kind(self):
        return self.opt.step_kinds[-1] if FRAMEWORK == "torch" else self.opt.last_step_kind


def optimizer_rules_sweep():
    """The 1-bit optimizers on awkward inputs (tests/test_fault_sweep.py's cases)."""
    out = {}
    for name, _ in RULES:
        if name == "binsgdm_2x2" and SIZE % 2:
            continue
        for d in SIZES:
            for kind in ("normal", "zeros", "subnormal", "near_max"):
                # near_max: 4 steps show the rule (every step after the first skipped by
                # the Adam family) at 40% of the CI time of 10.
                steps = 4 if kind == "near_max" else 10
                grads = [inputs(kind, SIZE, d)[RANK] for _ in range(steps)]
                opt = Stepper(name, np.ones(d, np.float32))
                for g in grads:
                    opt.step(g)
                x, slots, scalars = opt.x(), opt.slots(), opt.scalars()
                out[f"{name}/{d}/{kind}"] = {
                    "digest": digest([x]), "finite": bool(np.isfinite(x).all()), "skipped": opt.skipped(),
                    "steps": steps,
                    "unchanged": bool(np.array_equal(x, np.ones(d, np.float32))),
                    "moved": float(np.abs(x - 1.0).max(initial=0.0)),
                    "state_finite": all(bool(np.isfinite(v).all()) for v in slots.values()),
                    # Nothing but DeepSpeed's initialisation step (zeros through the 1-bit
                    # allreduce) left a trace: every slot zero, the step counter at 1.
                    "state_as_initialised": bool(all(not v.any() for v in slots.values())
                                                 and scalars["step"] == 1)}
    return out


def bad_steps(opt, g, values):
    """Step ``opt`` once per value in ``values`` with ``g``, whose element 11 holds that
    value on the last rank; what each step did (its kind, skip, and changes)."""
    records = []
    for bad in values:
        x, slots, scalars, skipped = opt.x(), opt.slots(), opt.scalars(), opt.skipped()
        poisoned = g.copy()
        if RANK == SIZE - 1:
            poisoned[11] = bad
        opt.step(poisoned)
        after = opt.slots()
        records.append({
            "kind": opt.kind(), "frozen_before": scalars.get("frozen"),
            "skipped": opt.skipped() - skipped, "x_finite": bool(np.isfinite(opt.x()).all()),
            "x_unchanged": bool(np.array_equal(opt.x(), x)),
            "slots_unchanged": after.keys() == slots.keys() and all(
                np.array_equal(after[k], slots[k]) for k in slots),
            "scalars_before": scalars, "scalars_after": opt.scalars()})
    return records


def after_step(opt):
    return {"kind": opt.kind(), "finite": bool(np.isfinite(opt.x()).all()),
            "momentum": digest([opt.slots()["exp_avg"]]), "scalars": opt.scalars()}


def optimizer_non_finite_sweep():
    """The last rank's gradient holds inf, -inf or NaN in one element at one step of each
    1-bit optimizer's phases (test_fault_sweep.OPTIMIZER_FAULTS). Each rank records, per
    bad step, its kind and what it skipped and changed (:func:`bad_steps`), the step
    after it, and whether the run ends like the same optimizer without the bad steps.

    A skipped step with a collective leaves the schedule where it was, so one run takes
    the three bad gradients in a row; a bad local step advances the schedule, so each
    bad value gets its own run there. TensorFlow also runs every step through one
    ``tf.function`` (``tf.cond`` instead of Python branches); tracing costs seconds, so
    there one run per optimizer visits all of its cases, the local step with NaN only."""
    out, d = {}, 37
    grads = [(np.random.default_rng(1000 * RANK + s).standard_normal(d) * 0.1).astype(np.float32)
             for s in range(12)]
    x0 = np.linspace(-1.0, 1.0, d, dtype=np.float32)
    values = (np.inf, -np.inf, np.nan)
    for case, name, options, where, kind, _ in OPTIMIZER_FAULTS:
        label = {"binsgdm": "binsgdm_flat"}.get(name, name)
        steps = where + 2
        clean = Stepper(label, x0, **options)
        for s in range(steps):
            clean.step(grads[s])
        for group in [values] if kind != "local" else [(bad,) for bad in values]:
            opt = Stepper(label, x0, **options)
            for s in range(where):
                opt.step(grads[s])
            run = {"bad": bad_steps(opt, grads[where], group)}  # the clean gradients follow
            opt.step(grads[where])
            run["next"] = after_step(opt)
            for s in range(where + 1, steps):
                opt.step(grads[s])
            run["same_as_clean"] = bool(np.array_equal(opt.x(), clean.x())) and all(
                np.array_equal(v, clean.slots()[k]) for k, v in opt.slots().items())
            out[f"{case}/eager/{'+'.join(map(str, group))}"] = run
    if FRAMEWORK == "tf":
        for name in dict.fromkeys(c[1] for c in OPTIMIZER_FAULTS):
            cases = [c for c in OPTIMIZER_FAULTS if c[1] == name]  # in step order
            options = cases[0][2]
            assert all(c[2] == options for c in cases)
            opt = Stepper({"binsgdm": "binsgdm_flat"}.get(name, name), x0, graph=True, **options)
            for s in range(cases[-1][3] + 1):
                case = next((c for c in cases if c[3] == s), None)
                group = () if case is None else (np.nan,) if case[4] == "local" else values
                records = bad_steps(opt, grads[s], group)
                opt.step(grads[s])
                if case is not None:
                    out[f"{case[0]}/graph/{'+'.join(map(str, group))}"] = {
                        "bad": records, "next": after_step(opt)}
    return out


def none_gradient_cases(reducer):
    """The None-gradient checks' cases: ``(key, name, options)`` per compressor through
    ``reducer`` (the framework's optimizer or tape), and ``(key, name, None)`` per 1-bit
    optimizer."""
    return [(f"{reducer}/" + label(n, o), n, o) for n, o in COMPRESSORS] + \
        [(f"optimizer/{n}", n, None) for n in ("onebit_adam", "zero_one_adam", "binsgdm")]


def none_gradient_optimizer(name, *args, **kwargs):
    """1-bit optimizer ``name`` of this framework (``args``, ``kwargs``: its parameters and
    learning rate) whose 1-bit rounds start after step 2, among the None gradients."""
    cls = {"onebit_adam": hq.OnebitAdam, "zero_one_adam": hq.ZeroOneAdam, "binsgdm": hq.BinSGDM}[name]
    extra = {"onebit_adam": dict(freeze_step=2), "zero_one_adam": dict(var_freeze_step=2)}.get(name, {})
    return cls(*args, **kwargs, **extra)


def torch_none_gradient():
    """A parameter with no gradient on one rank only is reduced as zeros there."""
    out = {}
    for key, name, opts in none_gradient_cases("distributed"):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 4), "b": torch.nn.Linear(6, 4)})
        if opts is None:
            opt = none_gradient_optimizer(name, model.parameters(), lr=1e-2,
                                          named_parameters=model.named_parameters())
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
    for key, name, opts in none_gradient_cases("tape"):
        keras.utils.set_random_seed(0)
        a, b = keras.layers.Dense(4, name="a"), keras.layers.Dense(4, name="b")
        a.build((None, 6))
        b.build((None, 6))
        variables = a.trainable_variables + b.trainable_variables
        if opts is None:
            opt = none_gradient_optimizer(name, learning_rate=1e-2)
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
record("optimizer_non_finite", optimizer_non_finite_sweep)
record("none_gradient", torch_none_gradient if FRAMEWORK == "torch" else tf_none_gradient)
results.write(OUT, RANK)
