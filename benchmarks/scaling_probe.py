"""Where the time of a step goes at many ranks: dependent collectives, their waits, CPU.

Run inside an emulated cluster (one Horovod job; every variant side by side, interleaved):

    sudo .venv/bin/python -m hvd_quant.cluster run --hosts 16 --rate 100mbit -- \\
        python benchmarks/scaling_probe.py chain --out chain.json
    sudo .venv/bin/python -m hvd_quant.cluster run --hosts 16 --rate 100mbit -- \\
        python benchmarks/scaling_probe.py digits --configs none,ef_sign,marsit --waits spin,sleep

``chain``
    Chains of dependent collectives of one kind and size (``allreduce``, ``allgather``,
    ``alltoall``, ``hop``: the ring hop of :meth:`HorovodTorchComm.sendrecv`, an
    alltoall with one non-empty split, and ``two_phase``: an allreduce as an alltoall of
    ``n`` chunks, their sum in float32 on the receiving rank, and an allgather of the sums),
    of a gradient of ``size / 4`` elements sent in each of ``--dtypes`` (``float16``: the
    wire of ``Compression.fp16``, which Gloo sums in float16), each call timed on every rank; per call the
    median wall time (slowest rank) and the CPU time the process used (all its threads:
    the caller's wait, Horovod's background thread, Gloo's), for every wait mode of
    :mod:`hvd_quant.torch.comm` (``spin``: ``hvd.synchronize``; ``sleep``: poll and sleep; ``default``: what the
    library chose, ``HVD_QUANT_WAIT`` or ``auto``).
``digits``
    The digits MLP of ``examples/pytorch_train.py`` (its defaults: hidden 128, batch 32,
    SGD with momentum) through ``hq.DistributedOptimizer`` with each ``--configs`` entry
    (``name`` or ``name:key=value,...``; ``horovod`` and ``horovod_fp16``: Horovod's own
    ``DistributedOptimizer`` and compression, whose collectives the wait columns miss) and each
    wait mode: blocks of ``--steps`` steps,
    the (config, wait) pairs in an order rotated every round. Per step: wall time,
    process CPU time, number of collectives and the time spent waiting in them.

Every rank prints nothing but rank 0's summary; ``--out`` gets the raw numbers (JSON).
Timings taken while other work shares the machine say only how the variants compare.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "examples"))

import hvd_quant  # noqa: E402
import hvd_quant.torch as hq  # noqa: E402
from hvd_quant.torch import comm as torch_comm  # noqa: E402
from hvd_quant.torch.comm import HorovodTorchComm  # noqa: E402


# --- recording every wait ------------------------------------------------------------------
class WaitRecorder:
    """Counts the collectives waited for and the seconds spent in their waits (every
    collective of HorovodTorchComm goes through ``torch_comm.wait_for``)."""

    def __init__(self):
        self.calls, self.seconds = 0, 0.0
        self._inner = torch_comm.wait_for
        torch_comm.wait_for = self._wait

    def _wait(self, handle):
        t = time.perf_counter()
        try:
            return self._inner(handle)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1

    def take(self):
        out = (self.calls, self.seconds)
        self.calls, self.seconds = 0, 0.0
        return out


def barrier():
    hvd.barrier()


def gather_rows(values):
    """Every rank's list of floats -> ``[rank][i]``."""
    t = hvd.allgather(torch.tensor(values, dtype=torch.float64).reshape(1, -1), name=f"probe.g{len(values)}")
    return t.tolist()


# --- chains of collectives --------------------------------------------------------------------
def run_chain(comm, kind, nbytes, calls, tag, dtype="float32"):
    """``calls`` dependent collectives of ``kind``, each timed on this rank (seconds). Every
    rank sends ones, so each result is known: the first call's is checked (a variant that
    is fast because it is wrong must not win)."""
    n, r = comm.size, comm.rank
    numel = max(1, nbytes // 4)  # the gradient's elements; the wire has `dtype`'s
    x = torch.ones(numel, dtype=getattr(torch, dtype))
    times = []
    for i in range(calls):
        name = f"probe.{tag}.{kind}.{nbytes}.{dtype}.{i % 4}"  # a few names, reused: Horovod's cache hits
        t = time.perf_counter()
        if kind == "allreduce":
            out, expected = comm.allreduce(x, "sum", name), n
        elif kind == "two_phase":
            chunk = -(-numel // n)
            padded = torch.zeros(chunk * n, dtype=x.dtype)
            padded[:numel] = x
            mine = comm.alltoall(padded, name + ".a2a").reshape(n, chunk)
            total = mine.to(torch.float32).sum(0).to(x.dtype)  # one rounding, not n - 1
            out, expected = comm.allgather(total, name + ".ag")[:numel].to(torch.float32), n
        elif kind == "allgather":
            out, expected = comm.allgather(x, name), 1
        elif kind == "alltoall":
            out, expected = comm.alltoall(torch.ones(numel * n), name), 1
        elif kind == "hop":
            out, expected = comm.sendrecv(x, (r + 1) % n, (r - 1) % n, name), 1
        else:
            raise ValueError(kind)
        times.append(time.perf_counter() - t)
        if i == 0 and not bool((out == expected).all()):
            raise AssertionError(f"probe: {kind} of {dtype} ones gave {out.unique().tolist()}, not all {expected}")
    return times


def idle_cpu(seconds):
    """CPU seconds per second this process uses while its main thread sleeps: Horovod's
    background loop (a cycle every HOROVOD_CYCLE_TIME, each with a cross-rank exchange)."""
    barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def set_wait(wait):
    """Select a wait mode of :mod:`hvd_quant.torch.comm` (``default``: the one the library
    chose, from ``HVD_QUANT_WAIT`` or ``auto``)."""
    torch_comm.WAIT = DEFAULT_WAIT if wait == "default" else wait


DEFAULT_WAIT = torch_comm.WAIT


def chain(args):
    comm = HorovodTorchComm()
    kinds = args.kinds.split(",")
    dtypes = args.dtypes.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    waits = args.waits.split(",")
    results = {}
    idle = gather_rows([idle_cpu(args.idle)])
    results["idle"] = {"cpu_s_per_s_mean_rank": statistics.fmean(r[0] for r in idle)}
    if hvd.rank() == 0:
        print(f"[probe] idle: Horovod's loop uses {100 * results['idle']['cpu_s_per_s_mean_rank']:.1f}% "
              f"of a core per rank while nothing is sent", flush=True)
    for kind, dtype in [(k, d) for k in kinds for d in dtypes]:
        for nbytes in sizes:
            for wait in waits:  # warm-up: first use of each name is negotiated in full
                set_wait(wait)
                run_chain(comm, kind, nbytes, 4, "w", dtype)
            per = {w: {"wall": [], "cpu": []} for w in waits}
            for rep in range(args.repeats):
                order = waits[rep % len(waits):] + waits[:rep % len(waits)]
                for wait in order:
                    set_wait(wait)
                    barrier()
                    c0 = time.process_time()
                    times = run_chain(comm, kind, nbytes, args.calls, "t", dtype)
                    cpu = (time.process_time() - c0) / args.calls
                    per[wait]["wall"] += times
                    per[wait]["cpu"].append(cpu)
            for wait in waits:
                walls = gather_rows(per[wait]["wall"])
                cpus = gather_rows(per[wait]["cpu"])
                slowest = [max(col) for col in zip(*walls)]
                key = f"{kind}/{nbytes}/{wait}" + ("" if dtype == "float32" else f"/{dtype}")
                results[key] = {"kind": kind, "bytes": nbytes, "dtype": dtype, "wait": wait,
                                "median_s": statistics.median(slowest),
                                "mean_s": statistics.fmean(slowest),
                                "cpu_s_per_call_mean_rank": statistics.fmean(statistics.fmean(c) for c in cpus),
                                "raw_slowest_s": slowest}
                if hvd.rank() == 0:
                    r = results[key]
                    print(f"[probe] {kind:9s} {dtype:7s} {nbytes:9d} B  wait={wait:5s}  median {1e3 * r['median_s']:8.2f} ms"
                          f"  mean {1e3 * r['mean_s']:8.2f} ms  cpu/call/rank {1e3 * r['cpu_s_per_call_mean_rank']:7.2f} ms",
                          flush=True)
    return results


# --- the digits MLP -----------------------------------------------------------------------------
#: ``digits`` configs run on ``hvd.DistributedOptimizer`` with Horovod's compression.
STOCK = {"horovod": hvd.Compression.none, "horovod_fp16": hvd.Compression.fp16}


def digits(args):
    from common import digits_split

    (x_train, y_train), _ = digits_split(hvd.rank(), hvd.size())
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    recorder = WaitRecorder()
    h = args.hidden

    def build(config):
        name, _, text = config.partition(":")
        options = {}
        for kv in filter(None, text.split(",")):
            k, v = kv.split("=", 1)
            options[k] = int(v) if v.lstrip("-").isdigit() else v
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 10))
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if name in STOCK:  # Horovod's own optimizer and compression: what its users have
            opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=STOCK[name])
            opt.bytes_sent = float("nan")  # Horovod counts no bytes
        else:
            opt = hq.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                          compression=hq.Compression.get(name, **options))
        return model, opt

    gen = torch.Generator().manual_seed(hvd.rank())
    batch = args.batch

    def steps(model, opt, count):
        for _ in range(count):
            idx = torch.randint(0, len(x_train), (batch,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()

    configs = args.configs.split(",")
    waits = args.waits.split(",")
    pairs = [(c, w) for c in configs for w in waits]
    built = {}
    for c in configs:
        built[c] = build(c)
        for w in waits:
            set_wait(w)
            steps(*built[c], 3)  # warm-up: state, agreement check, first negotiations
    recorder.take()
    rows = {f"{c}|{w}": {"wall": [], "cpu": [], "calls": [], "wait": []} for c, w in pairs}
    for rnd in range(args.rounds):
        order = pairs[rnd % len(pairs):] + pairs[:rnd % len(pairs)]
        for c, w in order:
            set_wait(w)
            barrier()
            recorder.take()
            c0, t0 = time.process_time(), time.perf_counter()
            steps(*built[c], args.steps)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            calls, waited = recorder.take()
            row = rows[f"{c}|{w}"]
            row["wall"].append(wall / args.steps)
            row["cpu"].append(cpu / args.steps)
            row["calls"].append(calls / args.steps)
            row["wait"].append(waited / args.steps)
        if hvd.rank() == 0:
            print(f"[probe] round {rnd + 1}/{args.rounds} done", flush=True)
    results = {}
    for key, row in rows.items():
        g = {k: gather_rows(v) for k, v in row.items()}
        slowest = [max(col) for col in zip(*g["wall"])]
        results[key] = {"config": key.split("|")[0], "wait": key.split("|")[1],
                        "step_s_median": statistics.median(slowest),
                        "step_s_rounds": slowest,
                        "cpu_s_per_step_mean_rank": float(np.mean(g["cpu"])),
                        "collectives_per_step": float(np.mean(g["calls"])),
                        "wait_s_per_step_mean_rank": float(np.mean(g["wait"])),
                        "bytes_per_step": None}
    for c in configs:
        opt = built[c][1]
        for w in waits:
            results[f"{c}|{w}"]["bytes_sent_total"] = float(opt.bytes_sent)
    if hvd.rank() == 0:
        print(f"{'config':34s} {'wait':6s} {'step ms':>9s} {'cpu ms/step':>12s} {'colls/step':>10s} {'wait ms/step':>12s}")
        for key, r in results.items():
            print(f"{r['config']:34s} {r['wait']:6s} {1e3 * r['step_s_median']:9.1f} "
                  f"{1e3 * r['cpu_s_per_step_mean_rank']:12.1f} {r['collectives_per_step']:10.1f} "
                  f"{1e3 * r['wait_s_per_step_mean_rank']:12.1f}", flush=True)
    return results


def parser():
    """The command line: ``chain`` and ``digits`` with their options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("chain")
    c.add_argument("--kinds", default="allreduce,allgather,alltoall,hop")
    c.add_argument("--sizes", default="4,16384", help="bytes of the float32 gradient")
    c.add_argument("--dtypes", default="float32", help="wire dtypes, e.g. float32,float16")
    c.add_argument("--calls", type=int, default=20)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--waits", default="spin,sleep")
    c.add_argument("--idle", type=float, default=3.0, help="seconds of idle CPU measurement")
    d = sub.add_parser("digits")
    d.add_argument("--configs", default="none,ef_sign,marsit,onebit,global_qsgd")
    d.add_argument("--waits", default="spin,sleep")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--rounds", type=int, default=4)
    d.add_argument("--hidden", type=int, default=128)
    d.add_argument("--batch", type=int, default=32)
    for q in (c, d):
        q.add_argument("--out", default="")
    # "default": the library's own choice (HVD_QUANT_WAIT or auto), left as it is.
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    hvd.init()
    torch.set_num_threads(hvd_quant.threads_per_rank())
    t0 = time.perf_counter()
    results = chain(args) if args.what == "chain" else digits(args)
    if hvd.rank() == 0:
        import os
        meta = {"ranks": hvd.size(), "local_size": hvd.local_size(), "argv": sys.argv,
                "cycle_time_env": os.environ.get("HOROVOD_CYCLE_TIME"),
                "rate": os.environ.get("HVDQ_CLUSTER_RATE"), "elapsed_s": time.perf_counter() - t0}
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
