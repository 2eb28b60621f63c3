"""``hvd_quant.torch.DistributedOptimizer``: Horovod's signature, fused compressed reduction.

At ``step()`` (or an explicit ``synchronize()``) every gradient is flattened into one
float32 buffer per group (one group by default), the compressor averages that buffer over
ranks with whatever collectives it needs, and the result is written back into ``.grad``.
Fusing gives one scale/allgather/ring per step instead of one per tensor, which is what
makes 1-bit methods pay off on small tensors.

Differences from ``horovod.torch.DistributedOptimizer`` (same arguments):

* gradients are reduced at ``step()``/``synchronize()``, not overlapped with backward;
  ``backward_passes_per_step`` therefore needs no bookkeeping (gradients accumulate in
  ``.grad`` until the step) and is accepted for compatibility;
* ``op`` may be ``hvd.Average`` (default) or ``hvd.Sum``; ``hvd.Adasum`` is refused;
* on the first step all ranks check that they use the same compressor and options, the
  same parameter names/shapes/dtypes and the same parameter values, and raise
  :class:`~hvd_quant.core.runner.RankDisagreement` together if not;
* ``state_dict()`` carries this rank's compressor state (error feedback, random-stream
  positions) under the key ``"hvd_quant"``, keyed by parameter name;
  ``load_state_dict()`` restores it;
* the compression object is configuration: each optimizer keeps its own state, so one
  object may serve several optimizers (a GAN's generator and discriminator);
* fp16 and bf16 parameters and gradients are reduced in fp32 and written back in the
  parameter's dtype. With ``torch.amp.GradScaler``, reduce before unscaling, as with
  Horovod: ``opt.synchronize(); scaler.unscale_(opt); with opt.skip_synchronize():
  scaler.step(opt)``. A non-finite gradient on any rank makes the reduced gradient
  non-finite on every rank, so every rank's scaler skips the same step.
"""

import hashlib
from contextlib import contextmanager

import torch
import horovod.torch as hvd

from ..core.runner import digest63
from .comm import HorovodTorchComm
from .compression import Compression, TorchCompressor


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, op, groups, process_set):
        super(self.__class__, self).__init__(params)
        if not isinstance(compression, TorchCompressor):
            raise TypeError(
                "hvd_quant.torch.DistributedOptimizer needs an hvd_quant compressor "
                "(hvd_quant.torch.Compression.<name>), got "
                f"{compression!r}; Horovod's own Compression.none/fp16 are "
                "hvd_quant.torch.Compression.none/fp16 here")
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvd_quant.torch.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
        self._compression = compression
        self._runner = compression.make_runner()  # this optimizer's own state
        self._op = op
        self._comm = HorovodTorchComm(process_set)

        all_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
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
        param_name = {p: names.get(p, f"param.{i}") for i, p in enumerate(all_params)}
        self._groups = _split_groups(all_params, groups)
        # (parameter name, numel) per fused buffer: fixed for the optimizer's lifetime.
        self._segments = [[(param_name[p], p.numel()) for p in group] for group in self._groups]
        self._should_sync = True

    # --- communication --------------------------------------------------------------------
    def synchronize(self):
        """Average every gradient over ranks now (``step()`` does this unless skipped)."""
        for gi, (group, segments) in enumerate(zip(self._groups, self._segments)):
            key = f"fused{gi}"
            self._runner.check_once(self._comm, key, lambda: (_structure_digest(segments, group),
                                                              _value_digest(group)))
            grads = []
            for p in group:
                g = p.grad
                if g is None:
                    g = torch.zeros_like(p)
                elif g.is_sparse:
                    g = g.to_dense()
                grads.append(g.reshape(-1).to(torch.float32))
            flat = torch.cat(grads) if grads else torch.zeros(0)
            mean = self._runner.reduce(flat, self._comm, key, segments)
            if self._op == hvd.Sum:
                mean = mean * self._comm.size
            offset = 0
            for p in group:
                n = p.numel()
                value = mean[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += n
        self._should_sync = False

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
        return super(self.__class__, self).step(closure)

    # --- monitoring and checkpoints ---------------------------------------------------------
    @property
    def bytes_sent(self):
        """Bytes this rank has sent for gradient reduction (cost model of WireMeter)."""
        return self._comm.meter.bytes_sent

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        # torch tensors, not numpy arrays, so torch.load(weights_only=True) accepts it.
        state["hvd_quant"] = {"compressor": repr(self._compression),
                              "state": {k: torch.from_numpy(v) for k, v in self._runner.state_dict().items()},
                              "rng": {int(r): int(c) for r, c in self._runner.rng_state().items()}}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvd_quant", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            self._runner.load_state_dict(ours["state"])
            self._runner.load_rng_state(ours.get("rng", {}))


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


def _structure_digest(segments, params):
    return digest63(*(f"{n}:{tuple(p.shape)}:{p.dtype}" for (n, _), p in zip(segments, params)))


def _value_digest(params):
    h = hashlib.sha256()
    for p in params:
        # The raw bytes (numpy has no bfloat16).
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest63(h.digest())


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=hvd.Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=hvd.global_process_set):
    """Wrap ``optimizer`` so that ``step()`` first averages gradients with ``compression``.

    Parameters mirror ``horovod.torch.DistributedOptimizer``. ``compression`` is an
    ``hvd_quant.torch.Compression.<name>`` object. ``num_groups``/``groups`` split the
    parameters into that many fused buffers (default: one). ``backward_passes_per_step``,
    ``gradient_predivide_factor`` and ``sparse_as_dense`` are accepted for compatibility
    (sparse gradients are always densified; averaging is exact).

    Returns an instance of a subclass of ``type(optimizer)`` with ``synchronize()``,
    ``skip_synchronize()``, ``bytes_sent`` and checkpointable compressor state.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor only applies to op=hvd.Average")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, op,
               groups if groups is not None else num_groups, process_set)
