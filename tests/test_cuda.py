"""The torch backend on CUDA tensors against the numpy oracle (skipped without a GPU).

On a GPU the fused primitives run as Triton kernels (hvd_quant.kernels.gpu). These tests
run, where they run for users:

* every compressor and every 1-bit optimizer rule on simulated ranks (ThreadWorld, 2 and 3
  ranks) whose tensors live on the GPU, against the numpy oracle on the same inputs and
  seeds, through the Triton kernels and through the generic path (plain torch operations,
  as with ``HVD_QUANT_KERNELS=0`` or without Triton); and the torch adapter's compressor
  with gradients on the GPU;
* every Triton primitive against the numba CPU kernels, bit for bit, on the GPU itself:
  the cases of ``tests/gpu_cases.py`` (which the interpreter runs in CI) at larger sizes;
* that ``TorchBackend("cuda")`` hands out the Triton kernels, that no primitive makes the
  host wait (``torch.cuda.set_sync_debug_mode("error")``, and a CUDA graph that captures
  them: they launch on the current stream and copy nothing to the device per call).

CI has no GPU: this file is run on a GPU machine by ``scripts/gpu_check.sh``
(docs/development.md#a-gpu-check).

Inputs of the whole-method tests are dyadic (multiples of 2**-10), so sums and means over
ranks and segments are exact in any order, and most results agree bit for bit. What may
differ is where a reduction's order rounds (the L2 norms of the scales): the comparison
allows a few float32 ulps there, and nothing else.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import hvd_quant  # noqa: E402
from solo_comm import FrameworkComm  # noqa: E402
from hvd_quant.core.backend import NumpyBackend  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402
from hvd_quant.core.simulate import ThreadWorld  # noqa: E402
from hvd_quant.optimizers import BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule  # noqa: E402
from hvd_quant.optimizers.oracle import OracleOptimizer  # noqa: E402
from hvd_quant import kernels  # noqa: E402
from hvd_quant.kernels import segment_tables  # noqa: E402
from hvd_quant.torch.backend import TorchBackend  # noqa: E402

NP = NumpyBackend()
GPU = TorchBackend("cuda")
GPU_KERNELS = kernels.gpu_module()  # hvd_quant.kernels.gpu, or None (no usable Triton)
SEGMENTS = [("w1", 700), ("b1", 3), ("w2", 1300), ("empty", 0), ("b2", 65)]
D = sum(n for _, n in SEGMENTS)
STEPS = 3
COMPRESSORS = [("ef_sign", {}), ("marsit", {}), ("marsit", {"compensation": "global"}),
               ("cascading_sign", {}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
               ("global_qsgd_exp", {}), ("onebit", {})]
HP = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def dyadic(shape, seed):
    return (np.random.default_rng(seed).integers(-2048, 2049, shape) / 1024.0).astype(np.float32)


def assert_close(got, want, what, ulps=8):
    """Equal, but for ``ulps`` float32 ulps of the largest magnitude in ``want``
    (a reduction that rounds in another order shifts a scale by an ulp or two)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    tol = ulps * float(np.spacing(np.float32(np.max(np.abs(want), initial=1.0))))
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = np.flatnonzero(diff > tol)
    assert bad.size == 0, (f"{what}: {bad.size} of {want.size} elements differ by more than "
                           f"{ulps} ulps (max {diff.max():.3g} at {int(np.argmax(diff))})")


def reduce_steps(backend, comp, xs):
    """``STEPS`` reductions on ``len(xs)`` ranks; per rank the outputs (numpy) and the
    runner's state after the last step."""
    n = len(xs)
    runners = [CompressorRunner(comp, backend, seed=5) for _ in range(n)]

    def body(c):
        comm = c if backend is NP else FrameworkComm(c, backend)
        outs = []
        for s in range(STEPS):
            x = backend.constant(xs[c.rank][s], "float32")
            outs.append(backend.to_numpy(runners[c.rank].reduce(x, comm, "g", SEGMENTS)))
        return outs

    outs = ThreadWorld(n).run(body)
    return outs, [r.state_dict() for r in runners]


@pytest.mark.parametrize("path", ["kernels", "generic"])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=[f"{n}-{o}" for n, o in COMPRESSORS])
def test_compressors_on_the_gpu_equal_the_oracle(name, opts, n, path, monkeypatch):
    if path == "generic":
        monkeypatch.setattr(GPU, "kernel", lambda name, *tensors: None)
    elif GPU_KERNELS is None:
        pytest.skip(f"no Triton kernels: {kernels.why_gpu_disabled()}")
    comp = hvd_quant.get(name, **opts)
    xs = [[dyadic(D, 100 * r + s) for s in range(STEPS)] for r in range(n)]
    want, want_state = reduce_steps(NP, comp, xs)
    got, got_state = reduce_steps(GPU, comp, xs)
    for r in range(n):
        for s in range(STEPS):
            np.testing.assert_array_equal(got[r][s], got[0][s])  # every rank the same bits
            assert_close(got[r][s], want[r][s], f"rank {r} step {s}")
        assert sorted(got_state[r]) == sorted(want_state[r])
        for key in want_state[r]:
            assert_close(np.asarray(got_state[r][key]), np.asarray(want_state[r][key]), f"rank {r} {key}")


class GPUOptimizer(OracleOptimizer):
    """The oracle's optimizer with its parameters, gradients and state on the GPU."""

    def __init__(self, rule, x, comm, hp, **kwargs):
        super().__init__(rule, x, FrameworkComm(comm, GPU), hp, backend=GPU, **kwargs)
        self.x = GPU.constant(self.x, "float32")
        self.state.slots = {k: GPU.constant(v, "float32") for k, v in self.state.slots.items()}
        if self.mask is not None:
            self.mask = GPU.constant(self.mask, "float32")

    def set_x(self, new_x):
        self.x = new_x

    def context(self, g, lr):
        ctx = super().context(g, lr)
        ctx.g = GPU.constant(np.asarray(g, np.float32), "float32")
        return ctx


RULES = {
    "onebit_adam": (lambda n: OnebitAdamRule(freeze_step=4), 10),
    "zero_one_adam": (lambda n: ZeroOneAdamRule(var_freeze_step=6, local_step_scaler=2, local_step_clipper=2), 16),
    "binsgdm": (lambda n: BinSGDMRule(ranks_per_node=1), 6),
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("which", sorted(RULES))
def test_optimizer_rules_on_the_gpu_equal_the_oracle(which, n):
    factory, steps = RULES[which]
    d = 1001
    x0 = dyadic(d, 7)
    grads = [[dyadic(d, 1000 * r + s) for s in range(steps)] for r in range(n)]
    mask = (np.arange(d) % 7 != 0).astype(np.float32)

    def run(cls):
        def body(comm):
            opt = cls(factory(n), x0, comm, HP, seed=3, mask=mask)
            for s in range(steps):
                opt.step(grads[comm.rank][s], 1e-2)
            return opt
        return ThreadWorld(n).run(body)

    want, got = run(OracleOptimizer), run(GPUOptimizer)
    for r in range(n):
        assert got[r].state.kinds == want[r].state.kinds
        assert got[r].x.device.type == "cuda"
        assert_close(GPU.to_numpy(got[r].x), want[r].x, f"rank {r} parameters")
        for key, value in want[r].state.slots.items():
            slot = got[r].state.slots[key]
            assert slot.device.type == "cuda", key
            assert_close(GPU.to_numpy(slot), value, f"rank {r} {key}")
        assert got[r].state.scalars == pytest.approx(want[r].state.scalars)


def test_cuda_tensors_get_the_triton_kernels_never_the_numba_ones():
    x = torch.ones(16, device="cuda")
    cpu = kernels.cpu_module()
    for name in kernels.NAMES:
        for backend in (GPU, TorchBackend()):  # the tensors' device decides
            fn = backend.kernel(name, x)
            if GPU_KERNELS is None:
                assert fn is None, name
            else:
                assert getattr(fn, "func", fn) is getattr(GPU_KERNELS, name), name
            assert fn is not getattr(cpu, name)
    if GPU_KERNELS is not None:  # random draws take no tensor: the backend's device
        assert GPU.kernel("uniform").keywords == {"device": GPU.device}
        assert GPU.kernel("uniform")(5, 10).device.type == "cuda"
    assert TorchBackend().kernel("sign_pack", x, torch.ones(16)) is None  # two devices: generic


@pytest.mark.parametrize("name", ["ef_sign", "marsit", "global_qsgd", "onebit"])
def test_the_stock_optimizers_compression_takes_gpu_gradients(name, monkeypatch):
    """``compression=hvd_quant.torch.Compression.<name>`` in Horovod's stock optimizer with
    a gradient on the GPU (fp32 and fp16): the result comes back on the gradient's device
    and dtype with the values a CPU gradient gets; the state stays in CPU tensors. Horovod's
    optimizer frame is stood in for (the parameter's name, op and owner it would give)."""
    import horovod.torch as hvd
    from hvd_quant.torch import compression as tc

    x = dyadic((33, 61), 11)  # 2013 elements
    results = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.float16)):
        owner = object.__new__(torch.optim.SGD)  # this run's state owner; never stepped
        monkeypatch.setattr(tc, "_horovod_call_site", lambda owner=owner: ("layer.weight", hvd.Average, owner))
        handle = getattr(tc.Compression, name)(seed=1)
        owned = handle.owned(owner)
        grad = torch.from_numpy(x).to(device=device, dtype=dtype)

        def body(c, handle=handle, owned=owned, grad=grad):
            owned.comm = FrameworkComm(c, TorchBackend())
            wire, ctx = handle.compress(grad)
            return handle.decompress(wire, ctx)

        out = ThreadWorld(1).run(body)[0]
        assert out.device == grad.device and out.dtype == dtype and out.shape == grad.shape
        for key, value in handle.state_dict(owner).items():
            assert value.device.type == "cpu", key
        results[(device, dtype)] = out.float().cpu().numpy()
    assert_close(results[("cuda", torch.float32)], results[("cpu", torch.float32)], name)
    assert_close(results[("cuda", torch.float16)], results[("cpu", torch.float32)], name, ulps=2 ** 14)


@pytest.mark.parametrize("name", ["ef_sign", "global_qsgd", "onebit"])
@pytest.mark.parametrize("bucket_size_mb", [0, None, 0.001])  # step time, default, tiny buckets
def test_the_distributed_optimizer_takes_a_gpu_model(name, bucket_size_mb, monkeypatch):
    """``hq.DistributedOptimizer`` over parameters on the GPU (a sparse embedding, fp32
    and fp16 tensors; at step time, in the default buckets and in tiny ones): three SGD
    steps end where the same parameters on the CPU end, and every gradient stays on its
    parameter's device in its dtype. The loss is linear in the parameters with dyadic weights, so the
    gradients are exact on both devices and what is compared is the reduction and the
    write-back. Horovod's communicator is stood in for by a simulated rank."""
    from hvd_quant.torch import Compression, DistributedOptimizer
    from hvd_quant.torch import optimizer as topt

    monkeypatch.setattr(topt, "HorovodTorchComm", lambda process_set=None: None)
    tokens = torch.tensor([[1, 5, 7, 1], [9, 9, 2, 3]])
    weights = {"emb": dyadic((2, 4, 16), 21), "w": dyadic((8, 16), 22), "b": dyadic(8, 23),
               "half": dyadic((4, 8), 24)}

    def run(device):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 16, sparse=True),
                                     "lin": torch.nn.Linear(16, 8)})
        model.half_weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.float16))
        model = model.to(device)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.125),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(Compression, name)(seed=2),
                                   bucket_size_mb=bucket_size_mb)
        c = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}

        def body(comm):
            opt._comm = FrameworkComm(comm, TorchBackend())
            for _ in range(3):
                opt.zero_grad()
                loss = ((model["emb"](tokens.to(device)) * c["emb"]).sum()
                        + (model["lin"].weight * c["w"]).sum() + (model["lin"].bias * c["b"]).sum()
                        + (model.half_weight.float() * c["half"]).sum())
                loss.backward()
                opt.step()
                for p in model.parameters():
                    assert p.grad.device == p.device and p.grad.dtype == p.dtype
            return [p.detach().float().cpu().numpy() for p in model.parameters()]

        return ThreadWorld(1).run(body)[0]

    for got, want in zip(run("cuda"), run("cpu")):
        assert_close(got, want, name)


# --- the Triton kernels themselves ----------------------------------------------------------
if GPU_KERNELS is not None:
    import gpu_cases  # noqa: E402

    _B, _T, _C = GPU_KERNELS.BLOCK, segment_tables.TILE, kernels.cpu_module().BLOCK
    _SMALL = [0, 1, 7, 8, 31, 32, 33]
    globals().update(gpu_cases.cases(
        GPU_KERNELS, torch.device("cuda"), GPU, sizes=_SMALL + [_B - 1, _B, _B + 1, (1 << 20) + 3],
        tile_sizes=_SMALL + [_T - 1, _T, _T + 1, (1 << 20) + 5],
        sum_sizes=[0, 1, 33, _T - 1, _T + 1, _C + 9, 5 * _C + 3],
        abs_sizes=[0, 1, 33, GPU_KERNELS._ABS_BLOCK + 1, (1 << 22) + 1],
        byte_sizes=[0, 1, 9, _T // 8 - 1, _T // 8 + 1, (1 << 17) + 3], draw_sizes=_SMALL + [4 * _B + 3, (1 << 20) + 7],
        inplace_sizes=[0, 33, _B + 1, (1 << 20) + 1]))


def _require_kernels():
    if GPU_KERNELS is None:
        pytest.skip(f"no Triton kernels: {kernels.why_gpu_disabled()}")


def test_no_primitive_makes_the_host_wait():
    """Every primitive with each of its flags and both kinds of scalars (the calls of
    ``gpu.warm_up``), once to compile and cache the layouts, then again with torch's sync
    debug mode set to raise on any synchronising call (``.item()``, a device-to-host copy,
    a synchronize, a blocking host-to-device copy): none; and no new segment layout."""
    _require_kernels()
    calls = GPU_KERNELS._warm_calls(torch.device("cuda"))  # the inputs made (copied) here, not in the calls
    for call in calls:
        call()
    layouts = segment_tables.cached()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert segment_tables.cached() == layouts


def test_the_kernels_launch_on_the_current_stream_and_capture_in_a_graph():
    """A step's primitives captured in a CUDA graph on a side stream (a launch on another
    stream, a synchronisation or a per-call copy to the device would fail the capture),
    replayed on new inputs: the results of direct calls."""
    _require_kernels()
    g = GPU_KERNELS
    d, counts = 100_003, [40_000, 0, 3, 60_000]
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    x, e = torch.randn(d, device="cuda"), torch.randn(d, device="cuda")
    scales = torch.rand(4, device="cuda")
    lr = torch.full((1,), 1e-3, device="cuda")

    def step():
        sums, bits = g.compensate_sums_signs(x, e, bounds)
        resid = g.sign_residual(x, e, scales, bounds)
        mean = g.unpack_scaled_sum(torch.stack([bits, bits]), torch.cat([scales, scales]), bounds, d)
        m, ok = g.absmax_finite(x)
        return sums, bits, resid, mean, m, ok, g.descend(x, e, lr, 0.01)

    step()  # compiled, layouts cached
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        captured = step()
    x.copy_(torch.randn(d, device="cuda"))
    lr.fill_(2e-3)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)
