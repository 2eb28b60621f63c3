"""Worker for tests/test_bucketing.py: bucketed (overlapped) reduction against the
step-time path with the same groups, under horovodrun. Writes ``rank{r}.json``."""

import hashlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hq

BUCKET_MB = 0.02  # 5242 float32 values: three buckets of the model below
STEPS = 3


def make_model(extra=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
              torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)]
    model = torch.nn.Sequential(*layers)
    if extra:
        model = WithAux(model)
    return model


class WithAux(torch.nn.Module):
    def __init__(self, seq):
        super().__init__()
        self.seq = seq
        self.aux = torch.nn.Linear(32, 4)  # used on some steps, on some ranks only


def batch(step, k=0):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + 10 * step + k)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def loss_of(model, step, k=0, use_aux=False):
    x, y = batch(step, k)
    seq = model.seq if isinstance(model, WithAux) else model
    if use_aux:
        h = seq[:6](x)
        return torch.nn.functional.cross_entropy(seq[6](h) + model.aux(h), y)
    return torch.nn.functional.cross_entropy(seq(x), y)


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def params_digest(model):
    return digest(list(model.parameters()))


def state_digest(opt):
    ours = opt.state_dict()["hvd_quant"]
    return {"keys": sorted(ours["state"]), "state": digest([ours["state"][k] for k in sorted(ours["state"])]),
            "rng": {str(k): v for k, v in sorted(ours["rng"].items())}}


def build(model, name, bucketed, **kw):
    comp = hq.Compression.get(name)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if bucketed:
        return hq.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp,
                                       bucket_size_mb=BUCKET_MB, **kw)
    # The step-time path with the groups the bucketed optimizer forms.
    probe = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                    named_parameters=model.named_parameters(), compression=comp,
                                    bucket_size_mb=BUCKET_MB, overlap=False)
    by_name = dict(model.named_parameters())
    groups = [[by_name[n] for n in g] for g in probe.bucket_groups]
    kw.pop("pipeline_chunk_mb", None)
    return hq.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp,
                                   groups=groups, **kw)


def train(name, bucketed, steps=STEPS, extra=False, aux_when=None, passes=1, slow_rank=None, **kw):
    model = make_model(extra)
    opt = build(model, name, bucketed, backward_passes_per_step=passes, **kw)
    launched = []
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            use_aux = bool(aux_when and aux_when(step))
            x_hook = None
            if slow_rank is not None and hvd.rank() == slow_rank:
                # Delay this rank's gradients of the first layers: readiness order and
                # timing now differ between ranks; the collectives must not.
                x_hook = (model.seq if isinstance(model, WithAux) else model)[2].weight.register_hook(lambda g: (time.sleep(0.02), g)[1])
            loss_of(model, step, k, use_aux).backward()
            if x_hook is not None:
                x_hook.remove()
        if bucketed:
            launched.append([opt._pipeline.launched(b) for b in range(len(opt._groups))])
        opt.step()
    return model, opt, launched


def compare(name, **kw):
    a_model, a_opt, launched = train(name, True, **kw)
    b_model, b_opt, _ = train(name, False, **kw)
    return {"buckets": len(a_opt.bucket_groups),
            "launched_in_backward": bool(launched and any(any(x) for x in launched)),
            "params_equal": params_digest(a_model) == params_digest(b_model),
            "state_equal": state_digest(a_opt) == state_digest(b_opt),
            "bytes_equal": a_opt.bytes_sent == b_opt.bytes_sent,
            "params": params_digest(a_model)}


def every_compressor():
    out = {}
    # auto measures the link for each owner, so two owners may choose differently: its
    # own cases are in tests/mp/train_torch.py.
    for name in (n for n in hvd_quant.available() if n != "auto"):
        out[name] = record(lambda: compare(name))
    return out


def scenario_equal(**kw):
    c = compare(**kw)
    c["equal"] = c["params_equal"] and c["state_equal"]
    return c


def unused_param():
    # aux gets gradients on rank 0 on odd steps only: other ranks launch its bucket at the
    # step with zeros (no hang), and results match the step-time path.
    res = {}
    for name in ("ef_sign", "marsit"):
        res[name] = scenario_equal(name=name, extra=True, aux_when=lambda s: hvd.rank() == 0 and s % 2 == 1)
    res["equal"] = all(r["equal"] for r in res.values())
    return res


def two_passes():
    res = {}
    for name in ("ef_sign", "global_qsgd"):
        res[name] = scenario_equal(name=name, passes=2)
    res["equal"] = all(r["equal"] for r in res.values())
    return res


def grad_scaler():
    def run(bucketed):
        model = make_model()
        opt = build(model, "ef_sign", bucketed)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scales = []
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step)
            if step == 1 and hvd.rank() == hvd.size() - 1:
                x = x * float("inf")  # one rank overflows: every rank must skip this step
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return params_digest(model), state_digest(opt), scales
    a, b = run(True), run(False)
    return {"equal": a == b, "scales": a[2], "skipped_once": a[2][1] < a[2][0]}


def chunked_ef_sign():
    return scenario_equal(name="ef_sign", pipeline_chunk_mb=0.002)  # 524 values per chunk


def checkpoint():
    model, opt, _ = train("ef_sign", True, steps=2)
    buf = io.BytesIO()  # through torch's file format, as a checkpoint file goes
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)

    def more(model, opt):
        for step in range(2, 4):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        return params_digest(model)
    uninterrupted = more(model, opt)
    buf.seek(0)
    ckpt = torch.load(buf)
    model2 = make_model()
    model2.load_state_dict(ckpt["model"])
    opt2 = build(model2, "ef_sign", True)
    opt2.load_state_dict(ckpt["opt"])
    restored = more(model2, opt2)
    _, plain, _ = train("ef_sign", False, steps=2)
    keys_same = sorted(ckpt["opt"]["hvd_quant"]["state"]) == sorted(plain.state_dict()["hvd_quant"]["state"])
    return {"equal": uninterrupted == restored and keys_same, "keys_same": keys_same}


def ring_thread_order():
    return scenario_equal(name="marsit", slow_rank=hvd.size() - 1)


def metrics():
    """opt.metrics() under overlap with probes on steps 2 and 4 and a non-finite step 3
    (one rank's loss is inf; GradScaler skips it): the global figures, for
    tests/test_metrics.py to compare across ranks."""
    model = make_model()
    opt = build(model, "ef_sign", True, probe_every=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step)
        if step == 2 and hvd.rank() == hvd.size() - 1:
            x = x * float("inf")
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    m = opt.metrics()
    keys = ["steps", "probes", "skipped_steps", "fp32_bytes", "probe_rel_error", "probe_cosine",
            "residual_ratio", "grad_norm", "probe_rel_error.mean"]
    keys += [k for k in m if k.startswith("bucket") and k.split("/")[1] in ("probe_rel_error", "nonfinite.mean")]
    return {"global": {k: m[k] for k in keys}, "buckets": len(opt.bucket_groups),
            "local": {k: m[k] for k in ("bytes_sent", "encode_s", "wait_s", "decode_s", "step_s")}}


def guard():
    """The guard under overlap (issue 54; tests/test_guard.py has the rest): a bound below
    any sign method's error makes every bucket fall back to fp32 after 2 probes, for 2
    steps; every rank must flag the same buckets at the same steps. report_after=4 also
    runs the "does it pay" line's link measurement between two rounds of buckets."""
    model = make_model()
    opt = build(model, "ef_sign", True, probe_every=1, report_after=4,
                guard={"error_bound": 1e-6, "patience": 2, "fallback_steps": 2})
    flags = []
    for step in range(6):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
        m = opt.metrics()
        flags.append([m[f"bucket{i}/fallback"] for i in range(len(opt.bucket_groups))])
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"flags": flags, "guard": opt.state_dict()["hvd_quant"]["guard"], "finite": finite,
            "saves_s": opt.metrics()["saves_s"], "fp32_s": opt._metrics.verdict.fp32_s}


def zero_grad_refused():
    model = make_model()
    opt = build(model, "ef_sign", True)
    loss_of(model, 0).backward()
    try:
        opt.zero_grad()
    except AssertionError:
        opt.synchronize()  # every rank finishes the round it started
        return True
    return False


def record(fn):
    start = time.monotonic()
    try:
        return fn()
    except Exception as exc:  # reported, so one failure does not hide the rest
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    finally:
        if hvd.rank() == 0:
            print(f"bucket_worker: {getattr(fn, '__name__', '?')} {time.monotonic() - start:.2f}s", flush=True)


def main():
    out_dir = Path(sys.argv[1])
    t0 = time.monotonic()
    hvd.init()
    print(f"bucket_worker: init {time.monotonic() - t0:.2f}s", flush=True)
    torch.set_num_threads(1)
    result = {"compressors": every_compressor()}
    for fn in (unused_param, two_passes, grad_scaler, chunked_ef_sign, checkpoint, ring_thread_order,
               zero_grad_refused, metrics, guard):
        result[fn.__name__] = record(fn)
    ef = result["compressors"].get("ef_sign", {})
    result["agree"] = ef.get("params") if isinstance(ef, dict) else None
    (out_dir / f"rank{hvd.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
