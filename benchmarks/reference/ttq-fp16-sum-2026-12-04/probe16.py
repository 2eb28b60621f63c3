"""What Compression.auto's fp16 probe (hvd_quant.compressors.auto.measure_link with fp16=True) reads
on loopback: three measurements per job. Run: horovodrun -np N -H localhost:N --gloo python probe16.py
(with the p5 wheel first on PYTHONPATH for the software sum). Output: probe16.txt."""
import horovod.torch as hvd
from hvd_quant.torch.backend import TorchBackend
from hvd_quant.torch.comm import HorovodTorchComm
from hvd_quant.compressors.auto import measure_link, choose
hvd.init()
B, comm = TorchBackend(), HorovodTorchComm()
for rep in range(3):
    link = measure_link(B, comm, prefix=f"p{rep}", fp16=True)
    if hvd.rank() == 0:
        print(f"n={hvd.size()} rate {link.rate_bps/1e6:.0f} Mbit/s, fp16 sum +{1e9*link.sum_s_per_byte['float16']:.2f} ns/byte;",
              "choice for 3.18M:", choose(("fp16", "global_qsgd", "global_qsgd_exp"), 3_175_936, hvd.size(), link)[0], flush=True)
