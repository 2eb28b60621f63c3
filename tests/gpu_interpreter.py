"""The Triton kernels (hvd_quant.kernels.gpu) under Triton's interpreter, without a GPU.

Every GPU primitive runs on CPU tensors (``kernels.gpu_interpreted()``: the module's
kernels defined with ``TRITON_INTERPRET=1``) against the numba kernels
(hvd_quant.kernels.cpu) and the numpy oracle (the generic implementations on
``NumpyBackend``): bit for bit (NaN for NaN, and the sign of zero), except the float64
per-segment sums, which add in another order (a few float64 ulps). Sizes around the
Triton kernels' program sizes (``gpu.BLOCK`` element-wise, ``TILE`` elements or
``TILE / 8`` bytes for the segment and bit kernels) and the CPU kernels' ``BLOCK`` where
their sums change shape; segment layouts with empty segments, unaligned boundaries and a
tile crossing many segments; 1 to 5 ranks of rows; every flag the CPU kernels take; and
scalars given as one-element tensors (read by the kernels through their pointers).
The generic call sites are run through the interpreted kernels too (a torch backend
that hands them out for CPU tensors): every compressor and the Adam-family rules against
the oracle. ``tests/test_cuda.py`` runs the compiled kernels on a GPU.

The kernel cases themselves are in ``tests/gpu_cases.py`` (shared with the GPU run); the
interpreter is slow (a few milliseconds per program), so sizes stay small here. This file
runs in a process of its own, with Triton on its path (``tests/test_gpu_kernels.py``; its
name keeps the suite's own process from collecting it: ``tests/triton_env.py`` says why).
"""

import importlib.util
import logging
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not on the path (tests/test_gpu_kernels.py puts .venv/triton there)",
                allow_module_level=True)

import gpu_cases  # noqa: E402
import hvd_quant  # noqa: E402
from gpu_cases import _adam_inputs, assert_same, assert_sums, sign_rows  # noqa: E402
from hvd_quant import kernels  # noqa: E402
from hvd_quant.compressors import global_qsgd as gq  # noqa: E402
from hvd_quant.core.backend import NumpyBackend  # noqa: E402
from hvd_quant.core.packing import unpack_sums_signs  # noqa: E402
from hvd_quant.core.runner import CompressorRunner  # noqa: E402
from hvd_quant.core.segments import compensate_sums_signs, segment_bounds  # noqa: E402
from hvd_quant.core.simulate import ThreadWorld  # noqa: E402
from hvd_quant.kernels import segment_tables  # noqa: E402
from hvd_quant.optimizers import elementwise as ew  # noqa: E402
from hvd_quant.torch.backend import TorchBackend  # noqa: E402
from solo_comm import FrameworkComm  # noqa: E402

if not kernels.enabled():
    pytest.skip(f"numba kernels off: {kernels.why_disabled()}", allow_module_level=True)
try:
    G = kernels.gpu_interpreted()
except RuntimeError as exc:  # Triton already imported for compilation in this process
    pytest.skip(str(exc), allow_module_level=True)

# The interpreter computes the masked-off lanes too (x / 0, a saturating product): numpy
# warns where the kernels, by design, discard the result.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")
C = kernels.cpu_module()
B = NumpyBackend()
BLOCK, TILE, NB = G.BLOCK, segment_tables.TILE, segment_tables.TILE // 8
SMALL = [0, 1, 7, 8, 31, 32, 33]
SIZES = SMALL + [BLOCK - 1, BLOCK + 1]        # element-wise kernels: a program's block +- 1
TILE_SIZES = SMALL + [TILE - 1, TILE + 1]     # segment and bit kernels: a tile +- 1
_ONE_AT_A_TIME = threading.Lock()  # the interpreter patches triton.language while it runs


def T(a):
    """A CPU tensor with a copy of the numpy array ``a``."""
    return torch.from_numpy(np.array(a, copy=True))


# --- the generic call sites through the interpreted kernels -----------------------------------
class InterpretedBackend(TorchBackend):
    """The torch backend with the interpreted Triton kernels for its CPU tensors, one call
    at a time: what TorchBackend("cuda") does with the compiled ones."""

    name = "torch+triton-interpreter"

    def kernel(self, name, *tensors):
        fn = getattr(G, name, None)
        if fn is None or name not in kernels.NAMES:
            return None

        def call(*args, **kwargs):
            if name in ("uniform", "random_bytes"):
                kwargs.setdefault("device", "cpu")
            with _ONE_AT_A_TIME:
                return fn(*args, **kwargs)
        return call


IB = InterpretedBackend()
globals().update(gpu_cases.cases(
    G, torch.device("cpu"), IB, sizes=SIZES, tile_sizes=TILE_SIZES,
    sum_sizes=[0, 1, 33, TILE + 1, C.BLOCK + 9],  # a segment of cpu.BLOCK + 1: two CPU blocks
    abs_sizes=[0, 1, 33, G._ABS_BLOCK - 1, G._ABS_BLOCK + 1], byte_sizes=[0, 1, 9, NB - 1, NB + 1],
    draw_sizes=SIZES + [4 * BLOCK + 3], inplace_sizes=[0, 33, BLOCK + 1]))


def dyadic(d, seed):
    return (np.random.default_rng(seed).integers(-2048, 2049, d) / 1024.0).astype(np.float32)


SEGMENTS = [("w1", 300), ("b1", 3), ("empty", 0), ("w2", 130)]
COMPRESSORS = [("ef_sign", {}), ("marsit", {}), ("marsit", {"compensation": "global"}), ("global_qsgd", {}),
               ("global_qsgd", {"norm": "l2"}), ("global_qsgd", {"block": 64}),
               ("global_qsgd", {"norm": "l2", "block": 100}), ("global_qsgd_exp", {}), ("onebit", {})]


def _reduce(backend, comp, xs, steps):
    n = len(xs)
    runners = [CompressorRunner(comp, backend, seed=5) for _ in range(n)]

    def body(c):
        comm = c if backend is B else FrameworkComm(c, backend)
        return [backend.to_numpy(runners[c.rank].reduce(backend.constant(xs[c.rank][s], "float32"), comm, "g",
                                                        SEGMENTS)) for s in range(steps)]
    return ThreadWorld(len(xs)).run(body), [r.state_dict() for r in runners]


@pytest.mark.parametrize("name,opts", COMPRESSORS, ids=[f"{n}-{o}" for n, o in COMPRESSORS])
def test_compressors_through_the_interpreted_kernels_equal_the_oracle(name, opts):
    """Every compressor's whole reduction, 2 ranks, 2 steps (state carried), through the
    generic call sites with the GPU primitives' results (0-d tensors, float64 sums on the
    tensors' device): the oracle's bits (dyadic inputs: the sums are exact in any order)."""
    d = sum(c for _, c in SEGMENTS)
    xs = [[dyadic(d, 100 * r + s) for s in range(2)] for r in range(2)]
    comp = hvd_quant.get(name, **opts)
    (want, want_state), (got, got_state) = _reduce(B, comp, xs, 2), _reduce(IB, comp, xs, 2)
    for r in range(2):
        for s in range(2):
            assert_same(got[r][s], want[r][s], f"rank {r} step {s}")
        for key in want_state[r]:
            assert_same(np.asarray(got_state[r][key]), np.asarray(want_state[r][key]), key)


def test_elementwise_call_sites_equal_the_oracle():
    x, m, v, u, w = _adam_inputs(1001)
    for wd in (0.0, 0.01):
        got = [ew.ema(IB, T(m), T(x), 0.9), ew.descend(IB, T(x), T(w * 3), 1e-3, wd, divisor=3),
               *ew.adam_descend(IB, T(x), T(m), T(v), 1e-3, 1e-6, wd, acc=T(u)),
               ew.precondition(IB, T(u), T(v), 1e-8),
               *ew.zero_one_sync_input(IB, T(x), T(m), T(w), T(v), T(u), 0.9, 1e-3, 1e-8, wd),
               *ew.zero_one_sync_result(IB, T(x), T(u), T(w), T(v), 1e-8, 0.0123)]
        want = [ew.ema(B, m, x, 0.9), ew.descend(B, x, w * 3, 1e-3, wd, divisor=3),
                *ew.adam_descend(B, x, m, v, 1e-3, 1e-6, wd, acc=u), ew.precondition(B, u, v, 1e-8),
                *ew.zero_one_sync_input(B, x, m, w, v, u, 0.9, 1e-3, 1e-8, wd),
                *ew.zero_one_sync_result(B, x, u, w, v, 1e-8, 0.0123)]
        for i, (g, want_i) in enumerate(zip(got, want)):
            assert_same(g, want_i, f"result {i}")
    counts = [500, 0, 501]
    x, e = dyadic(1001, 1), dyadic(1001, 2)
    for g, want_i in zip(compensate_sums_signs(IB, T(x), T(e), counts), compensate_sums_signs(B, x, e, counts)):
        assert_same(g, want_i)  # dyadic: exact sums
    packed, scales = sign_rows(1001, 3, 3)
    got = unpack_sums_signs(IB, T(packed), T(scales), counts, 1001, base=T(x), squares=True)
    want = unpack_sums_signs(B, packed, scales, counts, 1001, base=x, squares=True)
    assert_same(got[0], want[0])
    assert_sums(got[1], want[1])
    assert_same(got[2], want[2])
    m, ok = gq.absmax_finite(IB, T(x))
    assert m.shape == (1,) and ok.shape == (1,) and bool(ok[0])
    assert_same(m, np.abs(x).max(keepdims=True))
    assert IB.all_finite(T(np.arange(5000, dtype=np.float32))).dtype == torch.bool


# --- the layout tables and the dispatch --------------------------------------------------------
def test_segment_tables_match_a_direct_search():
    rng = np.random.default_rng(0)
    for _ in range(30):
        counts = rng.choice([0, 1, 3, 100, 5000, 9000], size=rng.integers(1, 12)).tolist()
        bounds = segment_bounds(counts)
        tiles, pieces = segment_tables.tables(bounds, tile=64)
        tiles = tiles.reshape(-1, 4)
        d = int(bounds[-1])
        assert tiles.shape[0] == -(-d // 64)
        seg = np.searchsorted(bounds, np.arange(d), side="right") - 1
        partial = np.zeros(max(pieces[-1], 1))
        for t, (lo, hi, piece, steps) in enumerate(tiles):
            s = seg[64 * t:64 * t + 64]
            assert lo == s[0] and hi == s[-1] and (hi - lo) < 2 ** steps
            for j in range(lo, hi + 1):
                partial[piece + j - lo] = (s == j).sum()
        per_segment = [partial[pieces[i]:pieces[i + 1]].sum() for i in range(len(counts))]
        np.testing.assert_array_equal(per_segment, counts)


def test_segment_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(segment_tables, "CACHE_SIZE", 4)
    monkeypatch.setattr(segment_tables, "_cache", type(segment_tables._cache)())
    first = segment_tables.layout(segment_bounds([5, 7]), "cpu")
    assert segment_tables.layout(segment_bounds([5, 7]), "cpu") is first  # no copy the second time
    for n in range(10):
        segment_tables.layout(segment_bounds([n, 3]), "cpu")
    assert segment_tables.cached() == 4
    with pytest.raises(ValueError, match="start at 0"):
        segment_tables.layout(np.array([1, 5]), "cpu")


def test_the_torch_backend_hands_out_the_gpu_kernels_for_cuda(monkeypatch):
    """TorchBackend.kernel: Triton's kernels for CUDA (imported on first use), the numba
    ones for CPU tensors, none with HVD_QUANT_KERNELS=0; a missing Triton is said once."""
    monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
    monkeypatch.setitem(sys.modules, "hvd_quant.kernels.gpu", G)
    cuda = TorchBackend("cuda")
    assert cuda.kernel("sign_pack_residual") is G.sign_pack_residual
    assert cuda.kernel("uniform").func is G.uniform and cuda.kernel("uniform").keywords == {"device": cuda.device}
    assert cuda.kernel("add_rows") is None  # TF's own: no GPU twin
    assert TorchBackend().kernel("sign_pack", torch.zeros(3)) is not None  # CPU tensors: numba
    assert cuda.kernel("sign_pack", torch.zeros(3)) is None  # CPU tensors on a CUDA backend: generic

    monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
    monkeypatch.setenv("HVD_QUANT_KERNELS", "0")
    assert cuda.kernel("sign_pack") is None and "HVD_QUANT_KERNELS=0" in kernels.why_gpu_disabled()
    monkeypatch.delenv("HVD_QUANT_KERNELS")


def test_a_missing_triton_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
    monkeypatch.setitem(sys.modules, "hvd_quant.kernels.gpu", None)  # the import fails
    cuda = TorchBackend("cuda")
    with caplog.at_level(logging.WARNING, logger="hvd_quant"):
        assert cuda.kernel("sign_pack") is None and cuda.kernel("ema") is None
    warnings = [r for r in caplog.records if "GPU kernels off" in r.getMessage()]
    assert len(warnings) == 1 and "generic path" in warnings[0].getMessage()
    assert "Triton is not usable" in kernels.why_gpu_disabled()


def test_every_primitive_has_a_gpu_kernel_with_the_cpu_signature():
    import inspect

    for name in kernels.NAMES:
        cpu, gpu = inspect.signature(getattr(C, name)), inspect.signature(getattr(G, name))
        own = [p for p in gpu.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        assert [(p.name, p.default) for p in own] == [(p.name, p.default) for p in cpu.parameters.values()], name
    assert "add_rows" not in kernels.NAMES and not hasattr(G, "add_rows")


def test_the_compiled_ptx_has_no_fma_ftz_or_approximation():
    """The kernel with the most float arithmetic (0/1 Adam's sync input: divisions, square
    roots, multiply-add chains) compiled for sm_90 without a GPU (``scripts/check_ptx.py``, in a process of its own:
    this one imported Triton for the interpreter): no fma, no flush to zero, no
    approximate division or square root; and a control compiled with contraction allowed
    does hold fma. ``scripts/check_ptx.py`` alone checks every kernel variant."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    only = "_zero_one_sync_input_k"  # divisions, square roots, multiply-add chains
    run = subprocess.run([sys.executable, str(root / "scripts" / "check_ptx.py"), "--only", only],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout and "FAIL" not in run.stdout, run.stdout


def test_importing_hvd_quant_does_not_import_triton():
    import subprocess

    code = ("import sys, hvd_quant, hvd_quant.torch.backend, hvd_quant.kernels; "
            "sys.exit(1 if 'triton' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_launch_settings_are_checked(monkeypatch, tmp_path):
    """``set_launch`` refuses unknown families and keys and values that are not powers of
    two in range; ``HVD_QUANT_GPU_LAUNCH`` (JSON text or a file) is applied when the GPU
    kernels are first handed out, and a bad value raises there, to the caller."""
    saved = {f: dict(v) for f, v in G.LAUNCH.items()}
    for bad, match in (({"nope": {"num_warps": 4}}, "unknown family"), ({"sums": {"block": 1024}}, "keys must be"),
                       ({"sums": {"num_warps": 3}}, "power of two"), ({"quantize_lanes": {"block": 32}}, "64..65536"),
                       ({"sums": {"num_warps": True}}, "power of two"),
                       ([1], "JSON object")):
        with pytest.raises(ValueError, match=match):
            G.set_launch(bad)
    assert G.LAUNCH == saved  # nothing half-applied
    try:
        path = tmp_path / "launch.json"
        path.write_text('{"sums": {"num_warps": 8}, "quantize_lanes": {"block": 4096}}')
        for value in (str(path), path.read_text()):
            monkeypatch.setenv("HVD_QUANT_GPU_LAUNCH", value)
            monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
            monkeypatch.setitem(sys.modules, "hvd_quant.kernels.gpu", G)
            assert kernels.gpu_module() is G
            assert G.LAUNCH["sums"] == {"num_warps": 8}
            assert G.LAUNCH["quantize_lanes"] == {"num_warps": saved["quantize_lanes"]["num_warps"], "block": 4096}
            G.LAUNCH.clear()
            G.LAUNCH.update(saved)
        for value, match in (("{not json", "HVD_QUANT_GPU_LAUNCH"), (str(tmp_path / "missing.json"), "No such file"),
                             ('{"sums": {"num_warps": 5}}', "power of two")):
            monkeypatch.setenv("HVD_QUANT_GPU_LAUNCH", value)
            monkeypatch.setattr(kernels, "_gpu", {"checked": False, "module": None, "why": ""})
            with pytest.raises(ValueError, match=match):
                kernels.gpu_module()
            with pytest.raises(ValueError, match=match):  # again on the next call, until it is fixed
                kernels.gpu_module()
    finally:
        G.LAUNCH.clear()
        G.LAUNCH.update(saved)
