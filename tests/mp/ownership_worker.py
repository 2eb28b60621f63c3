"""Runs inside every rank for tests/test_state_ownership.py: one compression object shared
by several optimizers/tapes keeps one state per owner, and training equals training with
separate objects, bit for bit.

``python ownership_worker.py MODE OUTDIR``; MODE is ``torch`` (Horovod's stock optimizer
and ours, a GAN whose two models have identical parameter names), ``tf`` (Keras 3: our
tape and our Keras optimizer, two models with identical layer names reduced in one
``tf.function``) or ``legacy`` (tf-keras: Horovod's stock tape).
"""

import sys
from pathlib import Path

import numpy as np

import worker_common
from worker_common import digest

MODE, OUT = sys.argv[1], Path(sys.argv[2])
results = worker_common.Results(message_chars=2000, trace_chars=3000)
record = results.record


def state_digest(state):
    return {k: digest([np.asarray(v)]) for k, v in sorted(state.items())}


# --- torch ---------------------------------------------------------------------------------------
def torch_mode():
    import torch
    import horovod.torch as hvd
    import hvd_quant.torch as hq

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def net():
        # Generator and discriminator alike: identical names *and* shapes, so shared
        # state would be silently mixed up rather than refused.
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    def compressor_state(path, comp, opt):
        if path == "stock":
            return comp.state_dict(opt)
        return opt.state_dict()["hvd_quant"]["state"]

    def gan(path, name, shared, steps=4):
        torch.manual_seed(0)
        G, D = net(), net()
        wrap = hq.DistributedOptimizer if path == "ours" else hvd.DistributedOptimizer
        comp_g = hq.Compression.get(name)
        comp_d = comp_g if shared else hq.Compression.get(name)
        opt_g = wrap(torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.5),
                     named_parameters=G.named_parameters(), compression=comp_g)
        opt_d = wrap(torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.5),
                     named_parameters=D.named_parameters(), compression=comp_d)
        gen = torch.Generator().manual_seed(10 + rank)
        ones, zeros = torch.ones(8), torch.zeros(8)
        for _ in range(steps):
            real = torch.randn(8, 4, generator=gen) + 2.0
            z = torch.randn(8, 4, generator=gen)
            opt_d.zero_grad()
            d_loss = bce(D(real).mean(1), ones) + bce(D(G(z).detach()).mean(1), zeros)
            d_loss.backward()
            opt_d.step()
            for p in D.parameters():  # the generator's step must not touch D's gradients
                p.requires_grad_(False)
            opt_g.zero_grad()
            bce(D(G(z)).mean(1), ones).backward()
            opt_g.step()
            for p in D.parameters():
                p.requires_grad_(True)
        out = {"G": digest([p.detach() for p in G.parameters()]),
               "D": digest([p.detach() for p in D.parameters()]),
               "state_G": state_digest(compressor_state(path, comp_g, opt_g)),
               "state_D": state_digest(compressor_state(path, comp_d, opt_d))}
        if path == "stock":
            out["bytes_G"] = comp_g.bytes_sent_by(opt_g)
            out["bytes_D"] = comp_d.bytes_sent_by(opt_d)
        else:
            out["bytes_G"], out["bytes_D"] = opt_g.bytes_sent, opt_d.bytes_sent
        return out

    def gans():
        out = {}
        for path in ("stock", "ours"):
            for name in ("ef_sign", "marsit", "global_qsgd"):
                out[f"{path}/{name}"] = {"shared": gan(path, name, True), "separate": gan(path, name, False)}
        return out

    def rebuilt():
        """A model rebuilt after a restart with the same compression object starts from
        fresh state: the same result as with a new object."""
        def train(comp):
            torch.manual_seed(1)
            model = net()
            opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), compression=comp)
            gen = torch.Generator().manual_seed(20 + rank)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
                opt.step()
            return digest([p.detach() for p in model.parameters()])

        comp = hq.Compression.ef_sign
        first = train(comp)
        again = train(comp)  # same object, new model and optimizer
        fresh = train(hq.Compression.ef_sign)
        return {"first": first, "again": again, "fresh": fresh}

    def stock_checkpoint():
        """Horovod's stock optimizer: ``compression.state_dict(opt)`` saved per rank and
        loaded into a new optimizer resumes exactly (residuals and random streams)."""
        import io

        out = {}
        gen = torch.Generator().manual_seed(40 + rank)
        batches = [torch.randn(8, 4, generator=gen) for _ in range(4)]

        def steps(model, opt, xs):
            for x in xs:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()

        for name in ("ef_sign", "global_qsgd"):
            comp = hq.Compression.get(name)
            torch.manual_seed(2)
            model = net()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), compression=comp)
            steps(model, opt, batches[:2])
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "compression": comp.state_dict(opt)}, buf)
            steps(model, opt, batches[2:])
            buf.seek(0)
            ckpt = torch.load(buf)  # weights_only=True by default
            model2 = net()
            model2.load_state_dict(ckpt["model"])
            opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=model2.named_parameters(), compression=comp)
            opt2.load_state_dict(ckpt["opt"])
            comp.load_state_dict(ckpt["compression"], opt2)  # same object, new owner
            steps(model2, opt2, batches[2:])
            out[name] = {"equal": all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters())),
                         "keys": sorted(ckpt["compression"])}
        return out

    record("gan", gans)
    record("rebuilt", rebuilt)
    record("stock_checkpoint", stock_checkpoint)
    return rank


# --- TensorFlow ----------------------------------------------------------------------------------
def tf_model(keras, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                             keras.layers.Dense(2, name="out")], name="net")  # same names twice


def tf_batches(rank, steps=3):
    rng = np.random.default_rng(30 + rank)
    return [(rng.standard_normal((8, 4)).astype("float32"), rng.integers(0, 2, 8)) for _ in range(steps)]


def two_model_tape(tf, keras, wrap, name, shared, rank):
    """Two models with identical variable names, one tf.function step reducing both."""
    import hvd_quant.tensorflow as hq

    from hvd_quant.tensorflow.compression import variable_name

    models = [tf_model(keras, 0), tf_model(keras, 1)]
    opts = [keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)]
    first = hq.Compression.get(name)
    comps = [first, first if shared else hq.Compression.get(name)]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        for model, opt, comp in zip(models, opts, comps):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x))
            tape = wrap(tape, compression=comp)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

    for x, y in tf_batches(rank):
        step(x, y)
    return {"models": [digest([v.numpy() for v in m.trainable_variables]) for m in models],
            "states": [state_digest(c.state_dict(m.trainable_variables)) for c, m in zip(comps, models)],
            "names": [[variable_name(v) for v in m.trainable_variables] for m in models]}


def tf_mode():
    tf, hvd = worker_common.tf_setup()
    import keras
    import hvd_quant.tensorflow as hq

    rank = hvd.rank()

    def tapes():
        out = {}
        for name in ("ef_sign", "marsit", "global_qsgd"):
            out[name] = {"shared": two_model_tape(tf, keras, hq.DistributedGradientTape, name, True, rank),
                         "separate": two_model_tape(tf, keras, hq.DistributedGradientTape, name, False, rank)}
        return out

    def tape_rebuilt():
        def train(comp):
            model = tf_model(keras, 3)
            opt = keras.optimizers.SGD(0.1)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            for x, y in tf_batches(rank):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x))
                tape = hq.DistributedGradientTape(tape, compression=comp)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            return digest([v.numpy() for v in model.trainable_variables])

        comp = hq.Compression.ef_sign
        return {"first": train(comp), "again": train(comp), "fresh": train(hq.Compression.ef_sign)}

    def keras_optimizers(name, shared):
        """Two Keras DistributedOptimizers sharing one object, applied in one tf.function."""
        models = [tf_model(keras, 0), tf_model(keras, 1)]
        first = hq.Compression.get(name)
        comps = [first, first if shared else hq.Compression.get(name)]
        opts = [hq.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=c) for c in comps]
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step(x, y):
            for model, opt in zip(models, opts):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x))
                opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        for x, y in tf_batches(rank):
            step(x, y)
        # model.fit too, each model with its own compiled optimizer (same object)
        for model, opt in zip(models, opts):
            model.compile(optimizer=opt, loss=loss_fn)
            x, y = tf_batches(rank, 4)[3]
            model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
        return {"models": [digest([v.numpy() for v in m.trainable_variables]) for m in models],
                "states": [state_digest(o.compression_state_dict()) for o in opts]}

    def keras_all():
        return {name: {"shared": keras_optimizers(name, True), "separate": keras_optimizers(name, False)}
                for name in ("ef_sign", "global_qsgd")}

    record("tape", tapes)
    record("tape_rebuilt", tape_rebuilt)
    record("keras", keras_all)
    return rank


def legacy_mode():
    tf, hvd = worker_common.tf_setup()
    keras = tf.keras
    rank = hvd.rank()

    def stock_tapes():
        return {name: {"shared": two_model_tape(tf, keras, hvd.DistributedGradientTape, name, True, rank),
                       "separate": two_model_tape(tf, keras, hvd.DistributedGradientTape, name, False, rank)}
                for name in ("ef_sign", "global_qsgd")}

    record("stock_tape", stock_tapes)
    return rank


rank = {"torch": torch_mode, "tf": tf_mode, "legacy": legacy_mode}[MODE]()
results.write(OUT, rank)
