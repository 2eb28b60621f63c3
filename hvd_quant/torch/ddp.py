"""DDP communication hooks: hvd_quant's compressors inside ``DistributedDataParallel``.

PyTorch's ``DistributedDataParallel`` (DDP) fuses gradients into buckets and, by
default, allreduces each bucket in fp32. A *communication hook* replaces that allreduce
(``model.register_comm_hook(state, hook)``; PyTorch ships fp16, bf16 and PowerSGD
hooks, Vogels et al. 2019). This module gives every hvd_quant compressor as such a hook::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hvd_quant.torch as hq

    dist.init_process_group("gloo")            # torchrun sets the environment; NCCL on GPUs
    model = DDP(net)
    state, hook = hq.ddp.comm_hook(hq.Compression.ef_sign, model=model)
    model.register_comm_hook(state, hook)
    # ... train as usual; save ``state.state_dict()`` with the checkpoint

The compressors are the ones :class:`hvd_quant.torch.DistributedOptimizer` runs over
Horovod (``ef_sign``, ``marsit``, ``onebit``, ``global_qsgd``, ``global_qsgd_exp``,
``cascading_sign``, ``auto``, ``fp16``, ``none``, and any registered one), run by the
same :class:`~hvd_quant.core.runner.CompressorRunner` on one fused buffer per bucket, over
a ``torch.distributed`` process group (:class:`hvd_quant.torch.dist_comm.DistComm`). Fed
the same fused buffer, made of the same parameters in the same order, with the same
error feedback and random-stream position, a hook and ``hq.DistributedOptimizer`` give the
same bits.

How a bucket is reduced
-----------------------
DDP hands the hook a ``GradBucket``: a flat buffer holding the gradients of
``bucket.parameters()`` one after the other. The hook

1. puts the parameters in a *canonical order*: reverse registration order, the order
   ``hq.DistributedOptimizer`` fuses them in (DDP's first buckets hold them in that order
   already; the buckets it rebuilds after the first iteration follow the order in which
   the gradients became ready, which may differ between runs). A fused buffer is thus
   defined by the *set* of its parameters, and the compressor's per-buffer quantities
   (a scale, a norm) do not depend on when a gradient was ready;
2. averages it with the compressor (``chunked_reduce``, as the optimizer does), in fp32
   whatever the parameters' dtype;
3. returns a completed ``torch.futures.Future`` holding the mean in DDP's layout and
   dtype; DDP writes it into ``.grad``.

The reduction runs inside the hook, on the thread that runs backward: the compressors'
collectives are chains (a scale, then the bits; ring hops), issued in DDP's bucket order
on every rank. A bucket's collectives therefore do not overlap the rest of backward, as
PowerSGD's own matrix products do not either.

State (:class:`CompressorHookState`)
------------------------------------
Error feedback and random streams belong to one hook state (one model). Error feedback
is kept per fused buffer and keyed by *parameter name*, not by ``bucket.index()``: DDP
rebuilds its buckets once, after the first iteration, and indices then name other
parameters. When a bucket made of new parameters appears (that rebuild), the state of
the old buffers is carried over element by element, per parameter, to the new ones.
Per-buffer state that cannot be split by parameter (``onebit``'s worker and server
errors) restarts from zero then, once.

Names come from ``model=`` (the DDP module or the model it wraps: names without DDP's
``module.`` prefix, as ``model.named_parameters()`` gives them to
``hq.DistributedOptimizer``, so checkpoints carry over between the two). Without it, a
parameter is named ``param.<k>`` in the order DDP's first-iteration buckets hold them
(the same on every rank and in every run of the same model).

``state.state_dict()`` / ``state.load_state_dict()`` save and restore the error feedback
and the random streams' positions with a checkpoint (each rank saves its own: the state
differs between ranks). ``torch.save(state)`` works as well (the process group is not
pickled; a loaded state uses the default group).

Non-finite gradients: as on the Horovod path, a NaN or inf on any rank makes the whole
reduced buffer non-finite on every rank (the compressors' contract), so
``torch.amp.GradScaler`` skips the same step everywhere.

Metrics (``state.metrics()``, the figures of ``hq.DistributedOptimizer.metrics()``,
:mod:`hvd_quant.core.metrics`): per bucket and summed, the bytes, the phases' times (also
``torch.profiler`` ranges ``hvd_quant/encode|wait|decode|probe``), the non-finite steps,
and on probe steps (``probe_every``) the error against the exact fp32 mean and the
residual's norm. A step ends with the iteration's last bucket (``bucket.is_last()``):
``step_s`` runs from one iteration's last bucket to the next one's, ``sync_s`` is the time
in the hook, and ``update_s`` is 0 (a hook does not see the optimizer; its update is in
``rest_s``). When DDP rebuilds its buckets, the figures of the buffers it no longer uses
are dropped, and the new ones count their reductions towards a probe from zero. After
``report_after`` iterations rank 0 logs whether the method pays on this link, with DDP's
fp32 allreduce of the same buckets timed then, in the last bucket's hook
(:class:`~hvd_quant.core.metrics.PaysReport`, as ``hq.DistributedOptimizer`` does).

The guard (``guard=``, :mod:`hvd_quant.core.guard`; off by default, on for ``auto``): a
bucket whose probes stay above the bound is reduced by one fp32 allreduce for its next
``fallback_steps`` iterations, as in ``hq.DistributedOptimizer``. Its state is keyed by
the fused buffer (the set of its parameters, as the error feedback is), goes into
``state.state_dict()``, and is dropped with the figures of a buffer DDP stops using.

``no_sync()`` (gradient accumulation), ``gradient_as_bucket_view=True``,
``static_graph=True`` and ``find_unused_parameters=True`` need nothing special: the hook
sees the bucket as DDP fills it.
"""

import itertools
import time

import torch

from ..core.guard import DIVERGENCE_HINT, checked_guard
from ..core.metrics import DEFAULT_PROBE_EVERY, DEFAULT_REPORT_AFTER, PaysReport, check_probe_every
from ..core.pipeline import chunked_reduce
from ..core.runner import digest63
from ..core.state import StateStore, layout_digest
from .compression import Compression, TorchCompressor
from .dist_comm import DistComm
from .monitoring import NONFINITE_HINT

__all__ = ["CompressorHookState", "comm_hook", "compressor_hook", "register"]


class CompressorHookState:
    """Everything the hook keeps between steps, in one place.

    Parameters
    ----------
    compression : TorchCompressor or str
        ``hq.Compression.<name>`` (with its options), or its name.
    process_group : ProcessGroup or None
        The group the gradients are averaged over (``None``: the world), as given to DDP.
    model : torch.nn.Module or None
        The DDP module (or the module it wraps), for the parameter names (module
        docstring).
    pipeline_chunk_mb : float or None
        As ``hq.DistributedOptimizer``'s: chunks of a chunkable compressor's buffer whose
        collectives are in flight while the next chunk is encoded (the same bits).
    strict : bool or None
        As ``hq.DistributedOptimizer``'s (the first-step agreement check).
    probe_every : int
        As ``hq.DistributedOptimizer``'s: every ``probe_every``-th reduction of a bucket
        also sums it in fp32 once, to measure the compressed mean's error (``0``: never).
    report_after : int
        As ``hq.DistributedOptimizer``'s: after this many iterations (``0``: never), rank 0
        logs one line saying whether the method pays on this link against DDP's own fp32
        allreduce, timed then on the same buckets
        (:class:`~hvd_quant.core.metrics.PaysReport`).
    guard : bool, dict, GuardSettings or None
        As ``hq.DistributedOptimizer``'s (:mod:`hvd_quant.core.guard`): ``None`` leaves it
        to the method (on for ``auto``), ``True`` the defaults, a dict some settings. A bad
        setting, or a guard with ``probe_every=0``, is a ``ValueError`` here.

    Attributes
    ----------
    comm : DistComm or None
        The communicator (made at the first bucket; its ``meter`` counts the bytes sent).
    runner : CompressorRunner or None
        The compressor's state: error feedback and random streams (made at the first
        bucket, on the gradients' device).
    """

    def __init__(self, compression, process_group=None, model=None, pipeline_chunk_mb=None,
                 strict=None, probe_every=DEFAULT_PROBE_EVERY, report_after=DEFAULT_REPORT_AFTER,
                 guard=None):
        self.compression = _compressor(compression)
        self.probe_every = check_probe_every(probe_every)
        self.guard = guard  # as given (pickled); the Guard itself is the metrics' guard
        self._guard = checked_guard(True, guard, self.compression.algorithm_for(False), self.probe_every,
                                    NONFINITE_HINT, DIVERGENCE_HINT)
        self.report_after = report_after
        self._report = PaysReport(report_after, _INSTEAD, compresses=self.compression.name != "none")
        self.process_group = process_group
        self.pipeline_chunk_mb = pipeline_chunk_mb
        self.strict = strict
        self.comm = None
        self.runner = None
        self._chunk_numel = int(pipeline_chunk_mb * 2 ** 20) // 4 if pipeline_chunk_mb else 0
        self._position = {}   # parameter -> (canonical position, name)
        self._named = False   # names came from the model
        self._layouts = {}    # tuple of parameter ids -> _Layout
        self._live = {}       # group key -> set of parameter names, of the buffers in use
        self._pending = None  # a checkpoint loaded before the runner existed
        self._sync_s = 0.0    # this iteration's time in the hook (the metrics' sync_s)
        if model is not None:
            self.name_parameters(model)

    # --- parameters and layouts ------------------------------------------------------------
    def name_parameters(self, model):
        """Take the names (and the canonical order: reverse registration) from ``model``."""
        inner = getattr(model, "module", model)  # DDP's wrapped module: names without "module."
        named = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        last = len(named) - 1
        self._position = {p: (last - i, n) for i, (n, p) in enumerate(named)}
        self._named = True
        self._layouts.clear()

    def _layout(self, params):
        key = tuple(id(p) for p in params)
        layout = self._layouts.get(key)
        if layout is None:
            for p in params:
                if p not in self._position:
                    if self._named:
                        raise ValueError("hvd_quant: DDP's bucket holds a parameter that the model "
                                         "given to comm_hook(model=...) does not have")
                    k = len(self._position)  # first-iteration bucket order (module docstring)
                    self._position[p] = (k, f"param.{k}")
            layout = self._layouts[key] = _Layout(params, self._position)
        return layout

    def _ensure_runner(self, device):
        if self.runner is not None:
            return
        self.comm = DistComm(self.process_group)
        self.runner = self.compression.make_runner(strict=self.strict, device=device)
        # The runner's scope numbers owners in creation order, to keep collective names
        # apart in a TensorFlow graph. torch.distributed matches collectives by order, not
        # name, and ranks may make different numbers of hook states (a model on a sub-group
        # exists on its members only): an empty scope keeps the first-step check comparing
        # the model, not how many hook states each process made before.
        self.runner.scope = ""
        self.runner.observe(self.probe_every, ranges=torch.profiler.record_function, guard=self._guard)
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None

    def _enter(self, layout):
        """Make ``layout``'s buffer current: if it holds parameters of buffers in use (DDP
        rebuilt its buckets), carry their state over per parameter first."""
        if layout.group in self._live:
            return
        names = set(layout.names)
        stale = [g for g, held in self._live.items() if held & names]
        if stale and self.runner.store is not None:
            saved = self.runner.state_dict()
            self.runner.store = StateStore(self.runner.backend)
            self.runner.store.load_state_dict(saved)  # waits per parameter for the new buffers
        for g in stale:
            del self._live[g]
            self.runner.metrics.forget(g)
        self._live[layout.group] = names

    # --- the reduction ----------------------------------------------------------------------
    def reduce_bucket(self, bucket):
        """The mean over ranks of ``bucket``'s buffer, in DDP's layout and dtype."""
        start = time.perf_counter()
        mean = self._reduce(bucket)
        self._sync_s += time.perf_counter() - start
        if bucket.is_last():  # the iteration's last bucket: its step ends
            self.runner.metrics.record_step(self._sync_s, 0.0)
            self._sync_s = 0.0
            # Every rank reaches the last bucket at the same iteration, and no other bucket
            # is in flight then (each is reduced inside its hook): fp32 can be timed here.
            self._report.step_ended(self.runner.metrics, self.compression.name, self.runner.backend, self.comm)
        return mean

    def _reduce(self, bucket):
        buf = bucket.buffer()
        layout = self._layout(bucket.parameters())
        self._ensure_runner(buf.device)
        self._enter(layout)
        flat = layout.canonical(buf)
        self.runner.check_once(self.comm, layout.group, lambda: (layout.structure, 0))
        # The mean is written over ``flat`` where the compressor can (ReduceContext.out):
        # DDP's own buffer when the bucket is float32 and already in canonical order.
        mean = self.runner.measured(
            flat, self.comm, layout.group, layout.segments,
            lambda comm: chunked_reduce(self.runner, flat, comm, layout.group, layout.segments,
                                        self._chunk_numel, out=flat))
        return layout.restore(mean, buf)

    # --- monitoring and checkpoints ---------------------------------------------------------
    @property
    def bytes_sent(self):
        """Bytes this rank has sent for the gradients (the cost model of ``WireMeter``)."""
        return self.comm.meter.bytes_sent if self.comm is not None else 0.0

    def metrics(self):
        """What compression did, as ``hq.DistributedOptimizer.metrics()`` gives it (a dict of
        plain numbers, ``None`` where not measured yet; empty before the first bucket)."""
        return self.runner.metrics.snapshot() if self.runner is not None else {}

    def state_dict(self):
        """This rank's compressor state: error feedback per parameter, the random streams'
        positions (torch tensors: ``torch.load(weights_only=True)`` reads it) and, with a
        guard, the guard's (plain numbers, the same on every rank)."""
        if self.runner is None:
            saved = dict(self._pending) if self._pending is not None else {
                "compressor": repr(self.compression), "state": {}, "rng": {}}
        else:
            saved = {"compressor": repr(self.compression),
                     "state": {k: torch.from_numpy(v) for k, v in self.runner.state_dict().items()},
                     "rng": {int(r): int(c) for r, c in self.runner.rng_state().items()}}
        if self._guard is not None:
            saved["guard"] = self._guard.state_dict()
        return saved

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`'s output (before or after the first step)."""
        if self._guard is not None and "guard" in state:
            self._guard.load_state_dict(state["guard"])
        state = {"compressor": state.get("compressor"), "state": dict(state.get("state", {})),
                 "rng": dict(state.get("rng", {}))}
        if self.runner is None:
            self._pending = state
        else:
            self._apply(state)

    def _apply(self, state):
        if self.runner.store is not None:  # what the live buffers hold is replaced
            self.runner.store = StateStore(self.runner.backend)
            self._live.clear()
        self.runner.load_state_dict(state["state"])
        self.runner.load_rng_state(state["rng"])

    def __getstate__(self):
        # As PowerSGD's state: everything but the process group (and what is bound to it).
        return {"compression": self.compression, "pipeline_chunk_mb": self.pipeline_chunk_mb,
                "strict": self.strict, "probe_every": self.probe_every, "report_after": self.report_after,
                "guard": self.guard, "saved": self.state_dict()}

    def __setstate__(self, d):
        self.__init__(d["compression"], None, None, d["pipeline_chunk_mb"], d["strict"],
                      d.get("probe_every", DEFAULT_PROBE_EVERY), d.get("report_after", DEFAULT_REPORT_AFTER),
                      d.get("guard"))
        self.load_state_dict(d["saved"])


#: The "does it pay" line's advice when the method does not pay (PaysReport).
_INSTEAD = ("Use DDP's own allreduce here (no communication hook), or hq.Compression.auto(), which "
            "measures the link and chooses per bucket.")


class _Layout:
    """One bucket's parameters: the permutation into canonical order, the segments and
    the state key of its fused buffer."""

    def __init__(self, params, position):
        sizes = [p.numel() for p in params]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        order = sorted(range(len(params)), key=lambda i: position[params[i]][0])
        self.identity = order == list(range(len(params)))
        self.slices = [(offsets[i], offsets[i] + sizes[i]) for i in order]
        self.names = [position[params[i]][1] for i in order]
        self.segments = [(n, sizes[i]) for n, i in zip(self.names, order)]
        self.group = "ddp." + layout_digest(self.segments)
        self.structure = digest63(*(f"{position[params[i]][1]}:{tuple(params[i].shape)}:"
                                    f"{params[i].dtype}" for i in order))

    def canonical(self, buf):
        """The bucket's gradients as a float32 buffer in canonical order."""
        flat = buf.detach().reshape(-1)
        if not self.identity:
            flat = torch.cat([flat[a:b] for a, b in self.slices])
        if flat.dtype != torch.float32:
            flat = flat.float()
        return flat

    def restore(self, mean, buf):
        """``mean`` (canonical order, float32) in the bucket's layout and dtype."""
        if self.identity:
            return mean if mean.dtype == buf.dtype else mean.to(buf.dtype)
        out = torch.empty_like(buf)
        pos = 0
        for a, b in self.slices:
            out[a:b].copy_(mean[pos:pos + b - a])
            pos += b - a
        return out


def compressor_hook(state, bucket):
    """The DDP communication hook: ``bucket``'s gradients averaged over
    ``state.process_group`` with ``state.compression`` (:class:`CompressorHookState`),
    as a completed ``torch.futures.Future``."""
    fut = torch.futures.Future()
    fut.set_result(state.reduce_bucket(bucket))
    return fut


def comm_hook(compression="ef_sign", process_group=None, model=None,
              pipeline_chunk_mb=None, strict=None, probe_every=DEFAULT_PROBE_EVERY,
              report_after=DEFAULT_REPORT_AFTER, guard=None):
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``compression``: ``hq.Compression.<name>`` (or its name; the default is a name, since
    building a compressor loads its kernels and checks the host's threads, which belongs to
    the call, not to ``import hvd_quant.torch``); ``process_group``: the one
    given to DDP (``None``: the world); ``model``: the DDP module, for the parameter names
    that key the state (recommended; see the module docstring). The other arguments are
    :class:`CompressorHookState`'s."""
    state = CompressorHookState(compression, process_group=process_group, model=model,
                                pipeline_chunk_mb=pipeline_chunk_mb, strict=strict,
                                probe_every=probe_every, report_after=report_after, guard=guard)
    return state, compressor_hook


def register(ddp_model, compression="ef_sign", process_group=None, **options):
    """Register the hook on ``ddp_model`` (named from it) and return its state."""
    state, hook = comm_hook(compression, process_group=process_group, model=ddp_model, **options)
    ddp_model.register_comm_hook(state, hook)
    return state


def _compressor(compression):
    if isinstance(compression, str):
        compression = getattr(Compression, compression)
    if not isinstance(compression, TorchCompressor):
        raise TypeError("hvd_quant.torch.ddp needs an hvd_quant compressor "
                        f"(hvd_quant.torch.Compression.<name>), got {compression!r}")
    compression.prepare()
    return compression
