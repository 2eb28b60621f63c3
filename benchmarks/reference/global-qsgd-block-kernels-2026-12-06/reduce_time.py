"""One rank's reduction of a 7.37M-float buffer (the time-to-quality LM's gradient) through the
runner, torch CPU, one thread, its collectives replaced by copies of this rank's own tensors
(every rank the same input): what a step's compression costs a rank apart from the wire.
    PYTHONPATH=. .venv/bin/python reduce_time.py LABEL N"""
import sys, time, statistics, torch
torch.set_num_threads(1)
from hvd_quant import kernels
kernels.set_threads(1); kernels.warm_up()
import hvd_quant
from hvd_quant.core.runner import CompressorRunner
from hvd_quant.torch.backend import TorchBackend
sys.path.insert(0, "tests")
from solo_comm import SoloComm
N = int(sys.argv[2])
class CommN(SoloComm):
    size = N
    def allgather(self, x, name):
        return torch.cat([x] * N)
B = TorchBackend()
d = 7_370_000
x = torch.randn(d, generator=torch.Generator().manual_seed(0)) * 1e-3
for name, opts in (("global_qsgd", {"block": None}), ("global_qsgd", {}), ("global_qsgd", {"norm": "l2"}),
                   ("qsgd", {"block": None}), ("qsgd", {})):
    r = CompressorRunner(hvd_quant.get(name, **opts), B, seed=1)
    buf = torch.empty_like(x)
    f = lambda: r.reduce(buf.copy_(x), CommN(), "g", [("g", d)])
    f(); f()
    ts = []
    for _ in range(15):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    print(sys.argv[1], N, name, opts, f"{1e3 * statistics.median(ts):.1f} ms", flush=True)
