"""Training checks for the torch worker: fused vs stock Horovod, checkpoints, bad models."""

import io
import os

import numpy as np
import torch
import horovod.torch as hvd

import hvd_quant.torch as hq
from hvd_quant.core.runner import RankDisagreement
from logged import captured_warnings

STOCK_AND_OURS = ("ef_sign", "marsit", "global_qsgd", "onebit")


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def batches(n, seed_base=0):
    g = torch.Generator().manual_seed(seed_base + hvd.rank())
    return [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def fused_vs_stock(host=None):
    """Final parameters per compressor and path; ``host``: a dict that receives the bytes
    each run staged through host buffers (``HVD_QUANT_WIRE=staged``)."""
    out = {}
    data = batches(3)
    for name in STOCK_AND_OURS:
        for path in ("ours", "stock"):
            model = make_model()
            base = torch.optim.SGD(model.parameters(), lr=0.1)
            wrap = hq.DistributedOptimizer if path == "ours" else hvd.DistributedOptimizer
            compression = hq.Compression.get(name)
            opt = wrap(base, named_parameters=model.named_parameters(), compression=compression)
            train(model, opt, data)
            out[f"{name}/{path}"] = flat(model)
            if host is not None:
                host[f"{name}/{path}"] = opt.host_bytes if path == "ours" else compression.host_bytes(opt)
    return out


def staged_vs_host():
    """:func:`fused_vs_stock` with every collective's tensors staged through separate host
    buffers (``HVD_QUANT_WIRE=staged``, what GPU tensors get from a Horovod without GPU
    operations): the same parameters, bit for bit, and the bytes that crossed."""
    host = {}
    os.environ["HVD_QUANT_WIRE"] = "staged"
    try:
        params = fused_vs_stock(host)
    finally:
        del os.environ["HVD_QUANT_WIRE"]
    return {"params": params, "host_bytes": host}


def checkpoint_roundtrip(name="ef_sign"):
    data = batches(4, seed_base=50)
    model = make_model()
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.get(name))
    train(model, opt, data[:2])
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    # In memory, through torch's file format (a fixed /tmp name was shared by two suites
    # running at once, and left behind).
    buf = io.BytesIO()
    torch.save({"model": saved_model, "opt": saved_opt}, buf)
    train(model, opt, data[2:])
    uninterrupted = flat(model)

    buf.seek(0)
    ckpt = torch.load(buf)  # default weights_only=True
    model2 = make_model(seed=123)
    model2.load_state_dict(ckpt["model"])
    opt2 = hq.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model2.named_parameters(),
                                   compression=hq.Compression.get(name))
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, data[2:])
    return {"uninterrupted": uninterrupted, "restored": flat(model2),
            "state_keys": sorted(ckpt["opt"]["hvd_quant"]["state"])}


def params_differ():
    """Ranks that never broadcast: strict raises on every rank at the first step; the
    default trains on (as Horovod) and rank 0 warns once, at the second step."""
    out = {}
    for strict in (True, False):
        model = make_model(seed=hvd.rank())  # no broadcast: ranks differ
        opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=hq.Compression.ef_sign, strict=strict)
        with captured_warnings() as messages:
            try:
                train(model, opt, batches(3))
                out[f"strict={strict}"] = {"error": None}
            except RankDisagreement as exc:
                out[f"strict={strict}"] = {"error": "RankDisagreement", "message": str(exc)}
        out[f"strict={strict}"]["warnings"] = [m for m in messages if "different values" in m]
    return out

