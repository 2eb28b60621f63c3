"""``hvd_quant.torch.DistributedOptimizer``: Horovod's signature, fused compressed reduction.

The gradients are flattened into float32 buffers: by default *buckets* of an eighth of the
model's gradient (at least 1 MB, at most 25 MB; :func:`default_bucket_mb`), each reduced
during backward as soon as its gradients are ready (as Horovod and DDP overlap by
default; "Overlap" below). The compressor averages each buffer over ranks with
whatever collectives it needs, and the mean goes back into ``.grad`` by ``step()`` (or an
explicit ``synchronize()``): a float32 gradient becomes a view of the reduced buffer,
which is kept and refilled at the next reduction (as DDP's ``gradient_as_bucket_view``;
keep a ``.clone()`` of a gradient that must outlive the next step), other dtypes get a
copy. Fusing gives one scale/allgather/ring per buffer instead of one per tensor, which is
what makes 1-bit methods pay off on small tensors.

Differences from ``horovod.torch.DistributedOptimizer`` (same arguments):

* gradients are fused into buckets of up to 25 MB (DDP's default size; a model under
  200 MB gets smaller ones, below) rather than Horovod's 64 MB fusion buffer of whichever
  tensors are ready; ``bucket_size_mb=0`` (or ``overlap=False``) fuses every gradient into
  one buffer reduced at ``step()``/``synchronize()`` instead, and ``num_groups``/``groups``
  into the groups given;
* ``op`` may be ``hvd.Average`` (default) or ``hvd.Sum``; ``hvd.Adasum`` is refused;
* on the first step all ranks check that they use the same compressor and options and
  the same parameter names/shapes/dtypes, and raise
  :class:`~hvd_quant.core.runner.RankDisagreement` together if not (those would hang or
  corrupt the state). Parameter values that differ between ranks are averaged over as
  Horovod does; if they still differ at the second step, rank 0 warns once that the
  ranks train different models (``strict=True`` or ``HVD_QUANT_STRICT=1``: an error at
  the first step instead; :class:`~hvd_quant.core.runner.ValueAgreement`);
* a rank outside ``process_set`` reduces nothing and trains on its own gradients, as
  under Horovod;
* ``state_dict()`` carries this rank's compressor state (error feedback, random-stream
  positions) under the key ``"hvd_quant"``, keyed by parameter name;
  ``load_state_dict()`` restores it;
* the compression object is configuration: each optimizer keeps its own state, so one
  object may serve several optimizers (a GAN's generator and discriminator);
* gradients on a GPU are reduced on the GPU: the fused buffers and the compressor's state
  live on the parameters' device, and only what the collectives carry (packed bytes and
  scales) crosses to the host when Horovod has no GPU operations
  (:mod:`hvd_quant.torch.staging`; ``host_bytes`` counts it). Under overlap the buckets
  are reduced on a CUDA stream of their own (:mod:`hvd_quant.torch.devices`). Parameters
  on several devices are reduced through the host, as before (one warning);
* fp16 and bf16 parameters and gradients are reduced in fp32 and written back in the
  parameter's dtype. With ``torch.amp.GradScaler``, reduce before unscaling, as with
  Horovod: ``opt.synchronize(); scaler.unscale_(opt); with opt.skip_synchronize():
  scaler.step(opt)``. A non-finite gradient on any rank makes the reduced gradient
  non-finite on every rank, so every rank's scaler skips the same step.

Overlap (buckets)
-----------------
By default the parameters go into buckets of an eighth of the model's float32 gradient, at
least 1 MB and at most 25 MB (:func:`default_bucket_mb`), in *reverse* registration order, as
DDP does (the last layers' gradients are ready first). A fixed 25 MB, DDP's size, makes a
model of a few tens of MB two or three buckets, complete only near the end of backward, so
nothing overlaps. A post-accumulate-grad hook on every parameter counts its gradients; when
every parameter of a bucket has received ``backward_passes_per_step`` of them, the bucket
is handed to one worker thread that reduces buckets strictly in bucket order (0, 1, ...),
each with the compressor's full reduction (its collectives, in the step-time order). So
every rank issues the same collectives in the same order with the same names whatever
order its gradients arrive in, ring methods included, and ``step()``/``synchronize()``
only waits for what is still in flight.

A bucket is a group: the result is bit-identical to the step-time path with the same
groups (``groups=opt.bucket_groups``), for every compressor: same state keys, error
feedback and random streams. ``overlap=False`` with an explicit ``bucket_size_mb`` keeps
the buckets and reduces them at the step. A parameter without a gradient this step
(unused on this rank) keeps its bucket waiting until ``step()``/``synchronize()``, which
launches it with zeros for that parameter, as the step-time path does. Calling
``zero_grad()`` between ``backward()`` and the step raises (as Horovod does): the
reduction already started. So does a gradient computed more than
``backward_passes_per_step`` times before the step (as with Horovod): accumulating over
several ``backward()`` calls needs that argument, or ``overlap=False``.
``pipeline_chunk_mb`` additionally cuts each buffer of a chunkable compressor (``ef_sign``,
``global_qsgd``) into chunks whose collectives are in flight while the next chunk is
encoded (:mod:`hvd_quant.core.pipeline`; bit-identical as well).
"""

import logging
import numbers
import threading
import time
import weakref
from contextlib import contextmanager

import torch
import horovod.torch as hvd

from ..core import adaptive_check
from ..core.guard import DIVERGENCE_HINT, checked_guard
from ..core.metrics import DEFAULT_PROBE_EVERY, DEFAULT_REPORT_AFTER, OwnerMetrics, PaysReport, check_probe_every
from ..core.pipeline import BucketPipeline, chunked_reduce
from ..core.runner import digest63, values_digest63
from ..optimizers.base import same_memory
from ..process_sets import includes_this_rank
from .compression import Compression
from .devices import BucketStreams, home_device
from .monitoring import NONFINITE_HINT
from .sparse import fill_flat, kept_flat
from .staging import host_bytes, make_comm

log = logging.getLogger("hvd_quant")


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, op, groups, process_set,
                 bucket_size_mb=None, overlap=None, pipeline_chunk_mb=None,
                 backward_passes_per_step=1, sparse_as_dense=True, strict=None,
                 gradient_predivide_factor=1.0, probe_every=DEFAULT_PROBE_EVERY, guard=None,
                 report_after=DEFAULT_REPORT_AFTER, metrics=True):
        super(self.__class__, self).__init__(params)
        compression = _adopted_compression(compression)
        probe_every = check_probe_every(probe_every)
        self._report = PaysReport(report_after, _INSTEAD, compresses=compression.name != "none")
        adaptive = isinstance(self, _ADAPTIVE)
        guard = _checked_guard(guard, compression, probe_every, adaptive, metrics)
        bucket_size_mb = _checked_bucket_size(bucket_size_mb, groups, overlap, op, pipeline_chunk_mb)
        self._passes = _check_passes(backward_passes_per_step)
        # hvd.broadcast_optimizer_state creates missing state with one step, on the ranks
        # without state only, and skips the reduction for Horovod's own class, which it
        # recognises by module name (horovod/torch/functions.py). Answering to that check
        # (on this instance; the class keeps its module) makes it step the wrapped
        # optimizer instead of reducing on some ranks, which hung.
        self.__module__ = hvd.DistributedOptimizer.__module__
        self._compression = compression
        compression.prepare()  # Horovod is initialised now: the ranks on this host are known
        all_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        # The fused buffers and the compressor's state live on the parameters' device.
        self._device, _ = home_device(all_params, "hvd_quant.torch.DistributedOptimizer")
        # This optimizer's own state; an adaptive one (Adam and kin) may get another method
        # from a compressor that chooses (auto: none with error feedback).
        self._runner = compression.make_runner(strict=strict, device=self._device, adaptive=adaptive)
        # What compression does while training (opt.metrics(); hvd_quant.core.metrics):
        # each phase of a bucket's reduction is also a range for torch.profiler.
        # metrics=False: the step's own times only (nothing per bucket, no probe, no report).
        self._metrics = (self._runner.observe(probe_every, ranges=torch.profiler.record_function, guard=guard)
                         if metrics else OwnerMetrics(0))
        if not metrics:
            self._report = PaysReport(0)
        self._sync_s = 0.0  # this step's time in synchronize(), for the step's metrics
        # Horovod's public attributes, read by integrations (Lightning, Ray).
        self.op, self.process_set, self.sparse_as_dense = op, process_set, bool(sparse_as_dense)
        self.backward_passes_per_step = self._passes
        self.gradient_predivide_factor = gradient_predivide_factor
        # A rank outside the process set trains on its own gradients, as under Horovod: no
        # collective, no agreement check (hybrid-parallel programs give a sub-model's
        # optimizer the set of ranks that hold that sub-model).
        self._included = includes_this_rank(process_set)
        self._comm = make_comm(process_set, self._device) if self._included else None
        if self._included:  # rank 0 of its ranks says it once (hvd_quant.core.adaptive_check)
            adaptive_check.warn_once(self._runner.compressor, type(self).__name__, adaptive,
                                     self._comm.rank)
        self._param_name = _parameter_names(all_params, named_parameters)
        if bucket_size_mb is None:
            bucket_size_mb = default_bucket_mb(all_params)
        if bucket_size_mb:
            self._groups = _buckets(all_params, bucket_size_mb)
        else:
            self._groups = _split_groups(all_params, groups)
        # (parameter name, numel) per fused buffer: fixed for the optimizer's lifetime.
        self._segments = [[(self._param_name[p], p.numel()) for p in group] for group in self._groups]
        self._should_sync = True
        self._fused = {}  # group -> kept float32 buffer of its concatenated gradients
        self._sparse_noted = False  # the sparse_as_dense=False warning was given
        self._chunk_numel = int(pipeline_chunk_mb * 2 ** 20) // 4 if pipeline_chunk_mb else 0
        self._overlap = bool(bucket_size_mb) if overlap is None else bool(overlap)
        self._hooks = []
        self._streams = None
        if self._overlap and self._included:
            self._install_overlap(all_params)

    def _install_overlap(self, all_params):
        """Buckets reduced during backward (module docstring, "Overlap"): a worker that
        reduces them in bucket order, and a post-accumulate-grad hook on every parameter
        that counts its gradients."""
        self._streams = BucketStreams.make(self._device, len(self._groups))
        self._pipeline = BucketPipeline(len(self._groups), self._reduce_bucket)
        self._group_of = {p: gi for gi, group in enumerate(self._groups) for p in group}
        self._hook_lock = threading.Lock()
        self._reset_counts()
        hook = self._make_hook()
        for p in all_params:
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))
            p._hvd_quant_hook_owner = weakref.ref(self)  # see _make_hook
        weakref.finalize(self, _remove_hooks, self._hooks)

    # --- overlap ----------------------------------------------------------------------------
    @property
    def bucket_groups(self):
        """The fused buffers (buckets), as lists of parameter names, in reduction order.
        ``groups=`` with the same parameters in the same order gives identical results."""
        return [[n for n, _ in segments] for segments in self._segments]

    def _reset_counts(self):
        self._grad_count = {p: 0 for p in self._group_of}
        self._remaining = [len(g) * self._passes for g in self._groups]
        self._hook_launched = set()  # buckets that backward completed this round
        if self._streams is not None:
            self._streams.end_round()

    def set_backward_passes_per_step(self, passes):
        """Reduce after ``passes`` backward passes per step from now on (Horovod's
        method; integrations such as PyTorch Lightning call it). Call it between steps:
        a round whose reduction has started keeps the count it started with."""
        passes = _check_passes(passes)
        if self._included and self._overlap and self._pipeline.active:
            raise RuntimeError("hvd_quant: set_backward_passes_per_step() was called after "
                               "backward() and before step()/synchronize(); the reduction of the "
                               "gradients has already started. Call it between steps.")
        self._passes = self.backward_passes_per_step = passes
        if self._included and self._overlap:
            self._reset_counts()

    def _make_hook(self):
        # The parameters hold their hooks: through a weak reference, a dropped optimizer is
        # freed (its buffers and state with it) and its finalizer removes the hooks. An
        # optimizer kept alive after it failed (by a traceback, or by the user) must not
        # launch reductions either once a newer optimizer covers the same parameters: its
        # collectives would mix with the new one's, after an hvd.shutdown()/init() too. So
        # only the newest optimizer over a parameter counts its gradients (the parameter's
        # _hvd_quant_hook_owner); an older one still reduces everything at its step(),
        # without overlap.
        ref = weakref.ref(self)

        def hook(p):
            opt = ref()
            owner = getattr(p, "_hvd_quant_hook_owner", None)
            if opt is not None and owner is not None and owner() is opt:
                opt._count_gradient(p)
        return hook

    def _count_gradient(self, p):
        """A gradient of ``p`` was accumulated: launch its bucket once it is complete."""
        gi = self._group_of.get(p)
        if gi is None:
            return
        if self._streams is not None:  # the bucket's worker stream waits for this gradient
            self._streams.gradient_ready(p)
        with self._hook_lock:
            count = self._grad_count[p] + 1
            too_many = count > self._passes or self._pipeline.launched(gi)
            if not too_many:
                self._grad_count[p] = count
                self._remaining[gi] -= 1
                ready = self._remaining[gi] == 0
        if too_many:
            self._finish_round()
            raise RuntimeError(
                "hvd_quant: a gradient was computed more than backward_passes_per_step="
                f"{self._passes} times before step()/synchronize() (its bucket is "
                "already being reduced). Raise backward_passes_per_step, or call "
                "step()/synchronize() after each backward(), or pass overlap=False.")
        if ready:
            self._hook_launched.add(gi)
            self._pipeline.launch(gi)

    def _finish_round(self):
        """Before raising an error in the middle of a round (from backward, or a
        ``zero_grad()`` before the step): reduce the round's remaining buckets and drop
        the results. Every rank that reaches this point issues the same collectives, as
        ``synchronize()`` would, so none is left in flight: a program that catches the
        error and calls ``hvd.shutdown()``/``hvd.init()`` starts clean. On a GPU the streams
        are ordered as in ``synchronize()``: the buckets launched here wait for the caller's
        stream, and the caller's stream for them (a later ``zero_grad()`` must not race a
        bucket still writing into ``.grad``)."""
        try:
            if self._streams is not None:
                self._streams.round_point()
            means = self._pipeline.wait_all()
            if self._streams is not None:
                for gi, mean in enumerate(means):
                    self._streams.hand_over(gi, mean)
        except Exception:  # noqa: BLE001 - the error being raised is the one to report
            pass
        finally:
            self._reset_counts()

    def zero_grad(self, set_to_none=True):
        if self._included and self._overlap and self._pipeline.active:
            self._finish_round()
            raise AssertionError(
                "hvd_quant: optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); the reduction of the gradients "
                "has already started (bucket_size_mb/overlap). Call step() or synchronize() first.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # --- communication --------------------------------------------------------------------
    def _reduce_bucket(self, gi):
        """The bucket worker's reduction of bucket ``gi``: on a GPU, on the worker's own
        stream, after the bucket's gradients (:class:`~hvd_quant.torch.devices.BucketStreams`)."""
        if self._streams is None:
            return self._reduce_group(gi)
        return self._streams.run(gi, self._groups[gi], gi in self._hook_launched,
                                 lambda: self._reduce_group(gi))

    def _reduce_group(self, gi):
        """Mean (or sum) over ranks of group ``gi``'s gradients, as a flat float32 tensor.
        Runs on the bucket worker thread under overlap, else on the caller's."""
        group, segments = self._groups[gi], self._segments[gi]
        key = f"fused{gi}"
        self._runner.check_once(self._comm, key, lambda: (_structure_digest(segments, group),
                                                          _value_digest(group)))
        # One dense float32 gradient is reduced through a flat view of itself, and the
        # result goes back into the same memory where the compressor can (ReduceContext.out):
        # then the mean is already in .grad, with no fresh buffer and no copy (_write_back
        # sees the same storage). Several go into one kept buffer (sparse.fill_flat).
        # The buffer is on the parameters' device (the host when they are on several:
        # gradients are copied in, and _write_back copies the means back).
        g = group[0].grad if len(group) == 1 else None
        if (g is not None and not g.is_sparse and g.dtype == torch.float32 and g.is_contiguous()
                and g.device == self._device):
            flat = g.detach().reshape(-1)
        else:
            if not self.sparse_as_dense:
                self._note_sparse(group)
            flat = fill_flat(kept_flat(self._fused, gi, sum(p.numel() for p in group), self._device),
                             group, True, self._param_name.get, "DistributedOptimizer")
        into = flat if flat.is_contiguous() and self.op == hvd.Average else None
        mean = self._runner.measured(
            flat, self._comm, key, segments,
            lambda comm: chunked_reduce(self._runner, flat, comm, key, segments, self._chunk_numel,
                                        out=into))
        if self.op == hvd.Sum:
            mean = mean * self._comm.size
        return mean

    def _note_sparse(self, group):
        """``sparse_as_dense=False`` (Horovod's default) with a sparse gradient: hvd_quant
        has no sparse reduction, so it is reduced as dense all the same; rank 0 says so
        once, with the cost."""
        if self._sparse_noted or self._comm.rank != 0:
            return
        for p in group:
            if p.grad is not None and p.grad.is_sparse:
                self._sparse_noted = True
                log.warning(
                    "hvd_quant: the gradient of %s is sparse and DistributedOptimizer has "
                    "sparse_as_dense=False (Horovod's default). hvd_quant has no sparse reduction: "
                    "it reduces the gradient as a dense buffer of the parameter's full size "
                    "(%.3g MB of float32 per step) and gives it back sparse, with the averaged "
                    "values Horovod's sparse allreduce gives. Pass sparse_as_dense=True to "
                    "silence this.", self._param_name[p], 4 * p.numel() / 1e6)
                return

    def _write_back(self, gi, mean):
        """The mean into ``.grad``: a float32 gradient becomes a view of the reduced buffer
        (no copy; the buffer is refilled at the next reduction, as DDP's
        ``gradient_as_bucket_view`` gradients are), others (other dtypes; parameters on
        another device than the buffer's, when the model spans several) get a copy in their
        dtype on their device, and a sparse one stays sparse (as Horovod
        gives it back; ``torch.optim.SparseAdam`` needs it): the rows of the mean."""
        offset = 0
        for p in self._groups[gi]:
            n = p.numel()
            value = mean[offset:offset + n].view_as(p)
            if p.grad is not None and p.grad.is_sparse:
                p.grad = value.to(device=p.device, dtype=p.dtype).to_sparse(min(1, value.dim()))
            elif p.grad is not None and same_memory(value, p.grad):
                pass  # reduced in place already
            elif value.dtype == p.dtype and value.device == p.device:
                p.grad = value
            elif p.grad is None:
                p.grad = value.to(device=p.device, dtype=p.dtype)
            else:
                p.grad.copy_(value)
            offset += n

    def synchronize(self):
        """Average every gradient over ranks now (``step()`` does this unless skipped).
        Under overlap: launch the buckets backward did not complete, wait for all. On a
        rank outside the optimizer's process set: nothing (its gradients stay its own)."""
        if not self._included:
            self._should_sync = False
            return
        start = time.perf_counter()
        with torch.profiler.record_function("hvd_quant/synchronize"):
            self._synchronize()
        self._metrics.reduced_all()
        self._sync_s += time.perf_counter() - start
        self._should_sync = False

    def _synchronize(self):
        if self._overlap:
            if self._streams is not None:
                self._streams.round_point()
            try:
                means = self._pipeline.wait_all()
            finally:
                self._reset_counts()
            if self._streams is not None:  # the step waits for the worker's stream
                for gi, mean in enumerate(means):
                    self._streams.hand_over(gi, mean)
        else:
            means = [self._reduce_group(gi) for gi in range(len(self._groups))]
        for gi, mean in enumerate(means):
            self._write_back(gi, mean)

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. to clip the averaged gradients)."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure=None):
        if self._should_sync:
            self.synchronize()
        self._should_sync = True
        start = time.perf_counter()
        with torch.profiler.record_function("hvd_quant/update"):
            out = super(self.__class__, self).step(closure)
        self._metrics.record_step(self._sync_s, time.perf_counter() - start)
        self._sync_s = 0.0
        self._report_pays()
        return out

    def _report_pays(self):
        """After ``report_after`` steps, rank 0's one line: does compression pay on this
        link (:class:`~hvd_quant.core.metrics.PaysReport`)?"""
        if self._included:
            self._report.step_ended(self._metrics, self._compression.name, self._runner.backend, self._comm)

    # --- monitoring and checkpoints ---------------------------------------------------------
    def metrics(self):
        """What compression did, as a dict of plain numbers (``None`` where not measured
        yet): for each figure ``F``, ``F`` (the last step, summed over buckets),
        ``F.mean`` (per step, over the whole run) and ``bucket<i>/F`` and
        ``bucket<i>/F.mean`` per bucket (in :attr:`bucket_groups` order). Bytes sent,
        fp32's bytes and their ratio; seconds of encoding, waiting on collectives and
        decoding per bucket (on the bucket worker under overlap), of the step's wait for
        them (``sync_s``), of the update and of the rest of the step; on probe steps
        (``probe_every``) the relative error and cosine against the exact fp32 mean and
        the error-feedback residual's norm against the gradient's; the steps whose
        averaged gradient held inf or NaN (``skipped_steps``). The figures and their
        definitions: :mod:`hvd_quant.core.metrics` and docs/guide/monitoring.md."""
        return self._metrics.snapshot()

    @property
    def metrics_steps(self):
        """Steps taken so far: ``metrics()["steps"]`` without building the snapshot (a
        writer's step hook reads it every step)."""
        return self._metrics.steps

    @property
    def bytes_sent(self):
        """Bytes this rank has sent for gradient reduction (cost model of WireMeter)."""
        return self._comm.meter.bytes_sent if self._comm is not None else 0.0

    @property
    def host_bytes(self):
        """Bytes copied between the GPU and host memory for the collectives since the
        optimizer was made (:func:`hvd_quant.torch.staging.host_bytes`)."""
        return host_bytes(self._comm)

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        # torch tensors, not numpy arrays, so torch.load(weights_only=True) accepts it.
        state["hvd_quant"] = {"compressor": repr(self._compression),
                              "state": {k: torch.from_numpy(v) for k, v in self._runner.state_dict().items()},
                              "rng": {int(r): int(c) for r, c in self._runner.rng_state().items()}}
        if self._metrics.guard is not None:  # plain numbers: torch.load(weights_only=True) takes them
            state["hvd_quant"]["guard"] = self._metrics.guard.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvd_quant", None)
        if self._included and self._overlap and self._pipeline.active:
            # A round that was started and never finished (an elastic reset after a failed
            # step): drop what was not reduced yet, issue no more collectives for it.
            self._pipeline.abandon()
            self._reset_counts()
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            self._runner.load_state_dict(ours["state"])
            self._runner.load_rng_state(ours.get("rng", {}))
            if self._metrics.guard is not None and "guard" in ours:
                self._metrics.guard.load_state_dict(ours["guard"])


#: torch's adaptive optimizers: a per-element second moment or accumulator, which a
#: compressor's error feedback flattens (hvd_quant.core.adaptive_check says why).
_ADAPTIVE = tuple(getattr(torch.optim, name) for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                                                            "Adadelta", "RMSprop", "SparseAdam")
                  if hasattr(torch.optim, name))



#: What the "does it pay" line recommends when compression does not pay.
_INSTEAD = ("Use fp32 here (compression=hq.Compression.none), or hq.Compression.auto(), which measures "
            "the link and chooses per bucket.")

#: The guard's advice when the averaged gradient stays non-finite (hvd_quant.core.guard).
_NONFINITE_HINT = NONFINITE_HINT + (" Reduce before unscaling (opt.synchronize(); scaler.unscale_(opt); "
                                    "with opt.skip_synchronize(): scaler.step(opt)).")


def _checked_guard(guard, compression, probe_every, adaptive=False, metrics=True):
    """:func:`~hvd_quant.core.guard.checked_guard` for this optimizer's buckets (an adaptive
    optimizer's get ``for_adaptive_optimizer()``'s method); none without metrics."""
    return checked_guard(metrics, guard, compression.algorithm_for(adaptive), probe_every, _NONFINITE_HINT,
                         DIVERGENCE_HINT)


def _adopted_compression(compression):
    """``compression`` as an hvd_quant compressor (Horovod's ``none``/``fp16`` taken as
    ours), or the ``TypeError`` that says why a Horovod compressor of one's own is not."""
    return Compression.require(compression, hvd.Compression, "hvd_quant.torch.DistributedOptimizer",
                               "Horovod's hvd.DistributedOptimizer",
                               " (hvd_quant fuses gradients into buckets and runs its compressors' "
                               "own collectives)")


def _checked_bucket_size(bucket_size_mb, groups, overlap, op, pipeline_chunk_mb):
    """The bucket size in MB to use (0: no buckets; ``None``: :func:`default_bucket_mb`),
    after checking the arguments that shape the fused buffers; a ``ValueError`` names a
    bad one."""
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("hvd_quant.torch.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
    if pipeline_chunk_mb is not None and not pipeline_chunk_mb > 0:
        raise ValueError(f"pipeline_chunk_mb must be > 0 or None, got {pipeline_chunk_mb!r}")
    given_groups = groups not in (None, 0)
    if bucket_size_mb is None:
        # The default: buckets reduced during backward, as Horovod and DDP overlap by
        # default (their size follows the model: None), unless the caller chose the groups
        # or asked for no overlap.
        return 0 if given_groups or overlap is False else None
    if (isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real)
            or not bucket_size_mb >= 0):
        raise ValueError(f"bucket_size_mb must be >= 0 (0: no buckets), got {bucket_size_mb!r}")
    if bucket_size_mb and given_groups:
        raise ValueError("bucket_size_mb forms the groups itself (one per bucket); "
                         "do not also pass num_groups/groups")
    return bucket_size_mb


def _parameter_names(all_params, named_parameters):
    """``{parameter: name}``: the names given (which key the compressor state in
    checkpoints), else ``param.{i}``; duplicate names, or parameters left unnamed, are a
    ``ValueError``."""
    names = {}
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        dups = {n for n, _ in named_parameters if sum(1 for m, _ in named_parameters if m == n) > 1}
        if dups:
            raise ValueError(f"named_parameters has duplicate names: {sorted(dups)}")
        names = {p: n for n, p in named_parameters}
        missing = [i for i, p in enumerate(all_params) if p not in names]
        if missing:
            raise ValueError(f"named_parameters does not name {len(missing)} parameter(s) "
                             "the optimizer updates; pass model.named_parameters()")
    return {p: names.get(p, f"param.{i}") for i, p in enumerate(all_params)}


def _check_passes(passes):
    """``passes`` as an int; a whole number >= 1 (``2.0`` too, as Horovod takes it)."""
    if (isinstance(passes, bool) or not isinstance(passes, numbers.Real) or passes != int(passes)
            or passes < 1):
        raise ValueError(f"backward_passes_per_step must be a whole number >= 1, got {passes!r}")
    return int(passes)


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


#: The largest default bucket, MB of float32 gradient (DDP's default ``bucket_cap_mb``).
DEFAULT_BUCKET_MB = 25
#: The smallest default bucket, MB (DDP's first bucket, ``_DEFAULT_FIRST_BUCKET_BYTES``).
MIN_DEFAULT_BUCKET_MB = 1
#: A model under 200 MB is cut into about this many default buckets.
DEFAULT_BUCKETS = 8


def default_bucket_mb(params):
    """The default bucket size for ``params``, MB: an eighth of their float32 gradient, at
    least 1 MB and at most 25 MB.

    Why not DDP's fixed 25 MB: backward fills the buckets from the last layer down and a
    bucket goes out only when all of its gradients are in, so a model of two or three
    buckets sends almost everything after backward ends. The time-to-quality LM (29.5 MB)
    made two and hid nothing; with this size it makes five, three of which go out while
    backward still runs. At 2 emulated hosts its step took 6-12% less for ``global_qsgd``
    and ``ef_sign`` at 100 Mbit/s and 4-5% less on average for ``none``, ``fp16`` and
    ``global_qsgd`` at 1 Gbit/s, pairs run in both orders; the 1-bit methods at 1 Gbit/s,
    with little on the wire to hide, went with the order, not the size, and at 8 emulated
    hosts on 2 cores ``ef_sign`` was 5.8% slower on average (-3% to +14%, six pairs)
    (benchmarks/reference/buckets-overlap-2026-12-07/). The floor keeps a small model from
    many collectives of a few kB each, whose latency would cost more than the overlap
    gives; from 200 MB up this is DDP's 25 MB. Every rank computes the same size from the
    same parameters."""
    total_mb = 4 * sum(p.numel() for p in params) / 2 ** 20
    return min(DEFAULT_BUCKET_MB, max(MIN_DEFAULT_BUCKET_MB, total_mb / DEFAULT_BUCKETS))


def _split_groups(params, groups):
    if groups is None or groups == 0:
        return [params]
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("num_groups must be >= 0")
        size = -(-len(params) // groups)
        return [params[i:i + size] for i in range(0, len(params), size)]
    listed = [list(g) for g in groups]
    seen = {p for g in listed for p in g}
    rest = [p for p in params if p not in seen]
    return [g for g in listed if g] + ([rest] if rest else [])


def _buckets(params, bucket_size_mb):
    """Parameters in reverse registration order, cut greedily into buckets of at most
    ``bucket_size_mb`` MB of float32 gradient (a larger parameter is a bucket of its own);
    within a bucket, parameters stay in that reverse order (as DDP forms its buckets)."""
    cap = float(bucket_size_mb) * 2 ** 20
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = 4 * p.numel()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _structure_digest(segments, params):
    return digest63(*(f"{n}:{tuple(p.shape)}:{p.dtype}" for (n, _), p in zip(segments, params)))


def _value_digest(params):
    # The raw bytes (numpy has no bfloat16).
    return values_digest63(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                           for p in params)


# Long only by its docstring: every argument, Horovod's and ours, documented where users look.
def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=True, process_set=hvd.global_process_set,
                         bucket_size_mb=None, overlap=None, pipeline_chunk_mb=None, strict=None,
                         probe_every=DEFAULT_PROBE_EVERY, guard=None, report_after=DEFAULT_REPORT_AFTER,
                         metrics=True):
    """Wrap ``optimizer`` so that ``step()`` first averages gradients with ``compression``.

    Parameters mirror ``horovod.torch.DistributedOptimizer``. ``compression`` is an
    ``hvd_quant.torch.Compression.<name>`` object. ``num_groups``/``groups`` split the
    parameters into that many fused buffers, reduced at the step (default: buckets
    reduced during backward, below). ``gradient_predivide_factor``
    is accepted for compatibility (averaging is exact).

    sparse_as_dense : bool
        Default True: a sparse gradient (``nn.Embedding(sparse=True)``) is reduced as a dense
        gradient of its parameter's full size, as Horovod's ``sparse_as_dense=True`` does (a
        float32 buffer of the whole table per step, and the compressor's passes over it);
        the parameter's ``.grad`` becomes the mean's rows, sparse again, as Horovod gives
        it back. ``False`` (Horovod's default, a sparse allreduce there) is reduced the same
        way, since hvd_quant compresses dense buffers only, and rank 0 says so once.

    Overlap options (module docstring, "Overlap"):

    bucket_size_mb : float or None
        Fused buffers of at most that many MB of float32 gradient, formed in reverse
        registration order and reduced during backward. Default ``None``: an eighth of
        the model's gradient, at least 1 MB and at most 25 MB (:func:`default_bucket_mb`),
        unless ``num_groups``/``groups`` are given or ``overlap=False`` (then those groups,
        or one buffer, reduced at the step). ``0``: no buckets.
    overlap : bool or None
        Reduce each fused buffer during backward as soon as its gradients are ready
        (``None``: when there are buckets). ``False``: everything at the step.
        ``True`` works with ``num_groups``/``groups`` too; results are bit-identical
        either way.
    pipeline_chunk_mb : float or None
        Cut each buffer of a chunkable compressor (``ef_sign``, ``global_qsgd``) into
        chunks of about this many MB whose collectives overlap the encoding of the next
        chunk (``None``: off).
    backward_passes_per_step : int
        Under overlap, a bucket is launched once every parameter in it has received this
        many gradients; gradients accumulate in ``.grad`` meanwhile. A bucket that is still
        incomplete at ``step()``/``synchronize()`` is reduced then.
        ``set_backward_passes_per_step(n)`` changes it between steps.
    strict : bool or None
        ``True``: ranks whose parameter values differ at the first step raise
        :class:`~hvd_quant.core.runner.RankDisagreement` together. ``False``: they train
        on, as under Horovod, with one warning on rank 0 if the values still differ at the
        second step. ``None`` (default): ``HVD_QUANT_STRICT`` (unset: ``False``).

    Monitoring (``opt.metrics()``, docs/guide/monitoring.md):

    metrics : bool
        Default True: measure each bucket's reduction (bytes, phase times, non-finite
        steps, probes; one sum over the mean per bucket and step). ``False``: only the
        step's own times, no probe, no "does it pay" line and no guard (the benchmark
        ``benchmarks/monitoring_overhead.py`` compares the two).
    probe_every : int
        Every that many steps, each bucket's exact fp32 mean is computed as well, a
        shard on each rank, by one extra fp32 reduce-scatter (and a 6-number
        allgather), for the relative error and cosine of the compressed mean and the
        residual's norm. Default 1000 (:data:`hvd_quant.core.metrics.DEFAULT_PROBE_EVERY`:
        about 1.6% more bytes for a 1-bit method at 2 ranks); ``0``: never. Every rank
        must pass the same value.
    report_after : int
        After that many steps, rank 0 logs one line (INFO, the ``hvd_quant`` logger):
        the method's measured communication and compute per step (the means over the
        second half of those steps), what fp32 would cost here (every rank takes part in
        one fp32 allreduce of each bucket, timed then), and whether the method saves
        time here, or, where part of its reduction runs behind backward, the range the
        figures allow (:func:`hvd_quant.core.metrics.pays`; ``metrics()["saves_s"]``
        after it). Default 100; ``0``: never. Every rank must pass the same value.
    guard : bool, dict or None
        Fall back to fp32 for a bucket whose probe error stays above a bound, and warn
        when the averaged gradient stays non-finite (:mod:`hvd_quant.core.guard`).
        ``True``: the default settings; a dict of
        :class:`~hvd_quant.core.guard.GuardSettings` fields (``error_bound``,
        ``patience``, ``fallback_steps``, ``nonfinite_patience``); ``False``: off;
        ``None`` (default): on for ``Compression.auto``, off otherwise. Every rank must
        pass the same. Its state goes into ``state_dict()``.

    Returns an instance of a subclass of ``type(optimizer)`` with ``synchronize()``,
    ``skip_synchronize()``, ``set_backward_passes_per_step()``, ``bytes_sent``,
    ``bucket_groups``, ``metrics()`` and checkpointable compressor state.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor only applies to op=hvd.Average")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, op,
               groups if groups is not None else num_groups, process_set,
               bucket_size_mb=bucket_size_mb, overlap=overlap,
               pipeline_chunk_mb=pipeline_chunk_mb,
               backward_passes_per_step=backward_passes_per_step, sparse_as_dense=sparse_as_dense,
               strict=strict, gradient_predivide_factor=gradient_predivide_factor,
               probe_every=probe_every, guard=guard, report_after=report_after, metrics=metrics)
