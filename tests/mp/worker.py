"""Runs inside every rank (under horovodrun) for tests/test_multiprocess.py.

``python worker.py FRAMEWORK OUTDIR`` runs every check below with the framework's
Horovod communicator and writes ``OUTDIR/rank{r}.json``; the pytest side compares ranks
with each other and with the numpy oracle. Checks that are expected to raise record the
error message instead, and every rank raises at the same collective, so the job goes on.
"""

import sys
from pathlib import Path

import numpy as np

import cases  # tests/mp/cases.py: inputs shared with the oracle
import worker_common

from hvd_quant.core import ring
from hvd_quant.core.runner import CompressorRunner

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
torch, tf, hvd, hq, B, Comm, tensor = worker_common.framework(FRAMEWORK)
RANK, SIZE = hvd.rank(), hvd.size()
results = worker_common.Results(rank=RANK, size=SIZE)
record = results.record


GRAPH_SIZE = cases.SIZES[-1]
RNG_BEFORE = {}  # label -> the random streams' positions before reduce_cases' GRAPH_SIZE


def reduce_cases():
    out = {}
    for label, name, options in cases.COMPRESSORS:
        runner = CompressorRunner(__import__("hvd_quant").get(name, **options), B, seed=7)
        comm = Comm()
        per_size = {}
        for d in cases.SIZES:
            if d == GRAPH_SIZE:  # reduce_cases_graph resumes the random streams from here
                RNG_BEFORE[label] = runner.rng_state()
            steps = []
            for step in range(cases.STEPS):
                x = cases.rank_input(RANK, d, step)
                segs = cases.segments(d)
                y = runner.reduce(tensor(x), comm, f"{label}.{d}", segs)
                steps.append(B.to_numpy(y).astype(np.float64).tolist())
            per_size[str(d)] = steps
        out[label] = {"values": per_size, "bytes": comm.meter.bytes_sent}
    return out


# The compressors whose hot paths are fused kernels on TensorFlow too.
GRAPH_LABELS = ("ef_sign", "marsit", "global_qsgd", "global_qsgd_exp", "onebit", "onebit_gather",
                "marsit_gather", "cascading_gather")


def reduce_cases_graph():
    """reduce_cases of the largest size inside one tf.function for all GRAPH_LABELS (state
    in variables), with fresh runners whose random streams resume where reduce_cases' were
    at that size: the same values as its eager run, bit for bit. One graph holds every
    reduction, two of them ring reductions (marsit, global_qsgd_exp) whose hops TensorFlow
    may run in any order: each rank still completes them (no hang) with the eager values."""
    d = GRAPH_SIZE
    runners, comms = {}, {}
    for label, name, options in cases.COMPRESSORS:
        if label not in GRAPH_LABELS:
            continue
        runner = CompressorRunner(__import__("hvd_quant").get(name, **options), B, seed=7,
                                  make_variable=lambda n, init: tf.Variable(init))
        runner.build(RANK, [(f"{label}.{d}", cases.segments(d))], size=SIZE)
        runner.load_rng_state(RNG_BEFORE.get(label, {}))
        runners[label], comms[label] = runner, Comm()
    step = tf.function(lambda x: [runner.reduce(x, comms[label], f"{label}.{d}", cases.segments(d))
                                  for label, runner in runners.items()], autograph=False)
    out = {label: {str(d): []} for label in runners}
    for s in range(cases.STEPS):
        for label, y in zip(runners, step(tensor(cases.rank_input(RANK, d, s)))):
            out[label][str(d)].append(B.to_numpy(y).astype(np.float64).tolist())
    return out


def exact_cases():
    def reduce(name, options, case):
        runner = CompressorRunner(__import__("hvd_quant").get(name, **options), B, seed=11)
        x = tensor(cases.exact_input(case, RANK, SIZE))
        return runner.reduce(x, Comm(), f"exact.{name}.{options}.{case}", [("v", 5)])
    return cases.run_exact_cases(reduce, B.to_numpy)


def ring_int_sum():
    comm = Comm()
    out = {}
    for d in cases.SIZES:
        x = tensor(cases.rank_ints(RANK, d))
        r = ring.ring_allreduce(B, comm, x, ring.IntSum(), f"ringsum.{d}", B.generator(0))
        ref = hvd.allreduce(x, op=hvd.Sum, name=f"refsum.{d}")
        xf = tensor(cases.rank_input(RANK, d, 0))
        rf = ring.ring_allreduce(B, comm, xf, ring.FloatSum(), f"ringfloat.{d}", B.generator(0))
        reff = hvd.allreduce(xf, op=hvd.Sum, name=f"reffloat.{d}")
        out[str(d)] = {"ring": B.to_numpy(r).tolist(), "hvd": B.to_numpy(ref).tolist(),
                       "ring_float": B.to_numpy(rf).tolist(), "hvd_float": B.to_numpy(reff).tolist()}
        if SIZE % 2 == 0:
            row, col = comm.subgroups(2)
            t = ring.torus_allreduce(B, row, col, x, ring.IntSum(), f"torussum.{d}", B.generator(0))
            out[str(d)]["torus"] = B.to_numpy(t).tolist()
    return out


def probe_shards():
    """A probe's shard of the exact mean (``exact_mean_shard``: an alltoall and a sum),
    with the bytes counted."""
    from hvd_quant.core.metrics import exact_mean_shard

    out = {}
    for d in cases.SIZES[1:]:
        comm = Comm()
        lo, hi, shard = exact_mean_shard(B, comm, tensor(cases.rank_input(RANK, d, 0)), f"probeshard.{d}")
        out[str(d)] = {"lo": lo, "hi": hi, "shard": B.to_numpy(shard).tolist(),
                       "bytes": comm.meter.bytes_sent}
    return out


def alltoall_pieces():
    """torch: alltoalls in pieces (hvd_quant.core.comm.PIECE_BYTES set small here) against
    the same alltoalls whole, bit for bit, sync and async, with the bytes counted once; and
    a probe's shard through them. Element ``i`` of rank ``r``'s input is ``1000 r + i``
    (plus a quarter where the dtype holds it), so a misplaced column shows; the int64
    share, 4 pieces' worth, goes whole."""
    from hvd_quant.core.metrics import exact_mean_shard
    from hvd_quant.core import comm as core_comm

    out, default = {}, core_comm.PIECE_BYTES
    in_pieces = Comm.in_pieces  # False with a Horovod whose Gloo receives first: pieces asked for here
    Comm.in_pieces = True
    try:
        for dtype, share in (("float32", 103), ("uint8", 301), ("int64", 4)):
            x = np.arange(SIZE * share, dtype=np.float64) + 1000 * RANK + 0.25
            x = tensor(x.astype(dtype) if dtype != "uint8" else (x % 251).astype(dtype))
            got = {}
            for piece in (0, 8):
                core_comm.PIECE_BYTES = piece
                comm = Comm()
                got[piece] = (comm.alltoall(x, f"pieces.{dtype}.{piece}"),
                              comm.alltoall_async(x, f"pieces.{dtype}.{piece}.async").wait(),
                              comm.meter.bytes_sent)
            pieces = core_comm.alltoall_pieces(x.numel(), SIZE, x.element_size())
            out[dtype] = {"pieces": len(pieces) if pieces else 0,
                          "same": all(torch.equal(got[0][0], y) for y in got[8][:2]),
                          "same_bytes": got[0][2] == got[8][2],
                          "values": B.to_numpy(got[8][0]).tolist()}
        d = cases.SIZES[-1]
        comm = Comm()
        lo, hi, shard = exact_mean_shard(B, comm, tensor(cases.rank_input(RANK, d, 0)), f"piecesprobe.{d}")
        out["probe"] = {"lo": lo, "hi": hi, "shard": B.to_numpy(shard).tolist()}
    finally:
        core_comm.PIECE_BYTES = default
        Comm.in_pieces = in_pieces
    return out


def fp16_sum():
    """Horovod's own fp16 sum (its CPU operations, Gloo or MPI): the bits of each element,
    for the test to set beside numpy's fp16 additions."""
    x = tensor(cases.fp16_sum_inputs(SIZE)[RANK])
    return B.to_numpy(hvd.allreduce(x, op=hvd.Sum, name="fp16sum")).view(np.uint16).tolist()


def disagreeing_compressor():
    name = "ef_sign" if RANK == 0 else "none"
    runner = CompressorRunner(__import__("hvd_quant").get(name), B)
    runner.check_once(Comm(), "disagree")
    return "no error"


def disagreeing_options():
    runner = CompressorRunner(__import__("hvd_quant").get("global_qsgd", norm="max" if RANK else "l2"), B)
    runner.check_once(Comm(), "disagree_opts")
    return "no error"


def auto_cases():
    """Compression.auto per family: the link measured once, a method chosen per bucket, the
    same choices on every rank, and the values of the chosen method run on its own."""
    hq_ = __import__("hvd_quant")
    out = {}
    for family in ("onebit_ef", "unbiased", "any"):
        comp = hq_.get("auto", family=family)
        runner, comm = CompressorRunner(comp, B, seed=7), Comm()
        got = {}
        for d in (7, 1001, 20000):
            name = f"auto.{family}.{d}"
            x = tensor(cases.rank_input(RANK, d, 0))
            y = B.to_numpy(runner.reduce(x, comm, name, cases.segments(d)))
            chosen = comp.choices(comm)[name]
            alone = CompressorRunner(hq_.get(chosen), B, seed=7)
            z = B.to_numpy(alone.reduce(x, Comm(), name, cases.segments(d)))
            got[str(d)] = {"chosen": chosen, "values": y.astype(np.float64).tolist(),
                           "same_as_alone": bool(np.array_equal(y, z))}
        out[family] = got
    return out


def unknown_name():
    return repr(hq.Compression.get("ef_sing"))


def non_float_passthrough():
    comp = hq.Compression.ef_sign
    x = tensor(np.arange(5, dtype=np.int32))
    y, ctx = comp.compress(x)
    return {"same": bool(np.array_equal(B.to_numpy(comp.decompress(y, ctx)), np.arange(5))),
            "ctx_is_none": ctx is None}


record("reduce", reduce_cases)
if FRAMEWORK != "torch":
    record("reduce_graph", reduce_cases_graph)
record("ring_int_sum", ring_int_sum)
record("fp16_sum", fp16_sum)
record("probe_shards", probe_shards)
if FRAMEWORK == "torch":
    record("alltoall_pieces", alltoall_pieces)
record("exact", exact_cases)
record("disagree_compressor", disagreeing_compressor)
record("disagree_options", disagreeing_options)
record("unknown_name", unknown_name)
record("auto", auto_cases)
record("non_float", non_float_passthrough)

if FRAMEWORK == "torch":
    import train_torch as train
else:
    import train_tf as train
record("train", train.fused_vs_stock)
if FRAMEWORK == "torch":
    record("train_staged", train.staged_vs_host)
record("checkpoint", train.checkpoint_roundtrip)
record("checkpoint_onebit", lambda: train.checkpoint_roundtrip("onebit"))
record("params_differ", train.params_differ)
if FRAMEWORK != "torch":
    record("stock_multi_hop", train.stock_refuses_multi_hop)

results.write(OUT, RANK)
