"""``torch.optim.Optimizer`` s that own their communication: 1-bit Adam, 0/1 Adam, BinSGDM.

Thin adapters around the rules of :mod:`hvd_quant.optimizers` (written once, shared with
the Keras optimizers). Use them instead of ``torch.optim.Adam`` *and without* a
``DistributedOptimizer`` wrapper: ``step()`` communicates what the method sends (fp32
averages, 1-bit rounds, nothing on local steps)::

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd_quant.torch.ZeroOneAdam(model.parameters(), lr=1e-3,
                                      named_parameters=model.named_parameters(),
                                      var_freeze_step=1000, local_step_scaler=1000)
    ...
    loss.backward()
    opt.step()

Each parameter group is one flat float32 buffer (DeepSpeed's fp16 optimizer flattens
each group the same way), in the group's parameter order. Parameters without a gradient
count as zeros on that rank (DeepSpeed skips them; see :mod:`hvd_quant.optimizers.base`
for why we do not). Parameters that are not float32 (``half``, ``bfloat16``) are updated
through a float32 master copy kept in the state.

Devices: the state (moments, error buffers, accumulators, master weights) and the flat
buffers live on the parameters' device, a GPU included, and each step runs there; with a
Horovod built without GPU operations only the packed bytes and scales of the collectives
cross to the host (:mod:`hvd_quant.torch.staging`; ``host_bytes`` counts them). Parameters
on several devices are stepped through the host instead (state in host memory, one
warning at construction); a param group added later on another device than the
optimizer's is refused with a ``ValueError``. ``state_dict()`` gives the flat state in
host memory, and ``load_state_dict()`` moves it to the optimizer's device: a checkpoint
saved on a GPU resumes on the CPU and the reverse, with no ``map_location``.

DeepSpeed's constructor arguments that have no meaning here (``deepspeed``,
``eps_inside_sqrt``, ``max_grad_norm``, ``cuda_aware``, ``comm_backend_name``) are
accepted, so that DeepSpeed code ports unchanged, and ignored; a value other than
DeepSpeed's default gives a ``UserWarning`` that says why. DeepSpeed itself never reads
``eps_inside_sqrt`` or ``max_grad_norm`` in ``step()`` (clipping is its engine's job:
call ``torch.nn.utils.clip_grad_norm_`` before ``step()``); the communication is
Horovod's (Gloo, MPI or NCCL, as ``horovodrun`` chose), not DeepSpeed's backends.

``exp_avg_mask`` (DeepSpeed's, on :class:`OnebitAdam` and :class:`ZeroOneAdam`): a param
group may carry a tensor with the group's number of elements; the 1-bit results are
multiplied by it. As in DeepSpeed's ``load_state_dict``, the mask in effect is always the
one the training script set on the optimizer, never the checkpoint's (a run may change
it between stages, e.g. BERT's sequence length 128 then 512): a checkpoint's mask is
replaced by the optimizer's, or dropped when the optimizer has none.

Param groups: each group has its own learning rate and hyper-parameters, but a step is
kept or skipped as a whole: if any group's values are not finite (on any rank, or, on a
0/1 Adam local step, on this rank), no group changes and ``last_step_skipped`` is True,
so the groups keep one schedule, as DeepSpeed's optimizers have one
(:func:`hvd_quant.optimizers.base.step_groups`; no extra collective). The price, with
several groups, is memory for every group but the largest: see ``reuse_buffers``.
DeepSpeed's ``non_freeze`` group flag is honoured by :class:`OnebitAdam` (fp32 Adam for
that group throughout, as in DeepSpeed's ``onebit/adam.py``) and refused with a
``ValueError`` by :class:`ZeroOneAdam` and :class:`BinSGDM` (DeepSpeed's ``zoadam.py``
never reads it), at construction and in ``add_param_group``.

State: ``state_dict()["state"]`` holds one entry per group, ``"hvd_quant.group{i}"``:
flat tensors (moments, error buffers, master weights) and the counters, all of this
rank's own (error buffers and, on local steps, moments differ between ranks): save one
file per rank. A run restored from it continues bit-identically. (DeepSpeed's
``load_state_dict`` drops the error buffers, and 0/1 Adam's accumulator with its
schedule counters; see :mod:`hvd_quant.optimizers.onebit_adam` and
:mod:`hvd_quant.optimizers.zero_one_adam` for exactly what.)

Sparse gradients (``nn.Embedding(sparse=True)``) are made dense (``sparse_as_dense=True``,
the default; :mod:`hvd_quant.torch.sparse`): a float32 buffer of the table's size per step;
rows a batch does not touch get a zero gradient (their moments decay, and a 1-bit round
gives them plus or minus the scale: mask them with ``exp_avg_mask`` where that matters).
``sparse_as_dense=False`` raises on a sparse gradient, as these optimizers always did.

Agreement between ranks: at the first step every rank checks that all use the same
method, options, hyper-parameters and parameter structure (else
:class:`~hvd_quant.core.runner.RankDisagreement` on every rank together). Parameter values
that differ between ranks are not refused (each rank applies the same update to its own
values); if they still differ at the second step, rank 0 warns once. ``strict=True`` (or
``HVD_QUANT_STRICT=1``) makes differing values at the first step an error instead. The
optimizers take ``process_set`` but must be built on its ranks only (a ``ValueError``
otherwise): they communicate in every step.

Without Horovod: ``process_group=`` (a ``torch.distributed`` process group, or ``True``
for the world) runs the same rules over :class:`~hvd_quant.torch.dist_comm.DistComm`
(Gloo on CPUs, NCCL on GPUs), as under ``torchrun``; the same gradients give the same
bits as on Horovod. ``opt.broadcast_state(root)`` then broadcasts over the group.

``bytes_sent``, ``comm_rounds``, ``step_kinds`` (``"init"``, ``"full"``, ``"onebit"``,
``"local"`` per step) and ``skipped_steps`` (steps left out because some rank's values
were not finite) show what each step did.

Loss scaling: the optimizers accept ``torch.amp.GradScaler`` (``scaler.step(opt)``): they
unscale the gradients themselves and skip a step whose gradients overflowed on any rank,
in any param group, on every rank at once. The stock GradScaler's ``update()`` sees only
this rank's overflow, so the ranks' loss scales drift apart after such a step;
:class:`GradScaler` (a drop-in subclass) hands ``update()`` the optimizer's global
verdict instead and keeps the scales identical on every rank.
"""

import time

import torch
import torch.distributed as dist

try:
    import horovod.torch as hvd
except ImportError:  # torch.distributed only (process_group=); the Horovod path says what to install
    hvd = None

from ..core.guard import make_guard
from ..core.metrics import DEFAULT_PROBE_EVERY, DEFAULT_REPORT_AFTER, OwnerMetrics, PaysReport
from ..core.runner import (RankDisagreement, ValueAgreement, check_agreement, digest63,
                           disagreeing_groups, values_digest63)
from ..optimizers import BinSGDMRule, OnebitAdamRule, ZeroOneAdamRule
from ..optimizers.base import (EagerGroupState, StepContext, adam_hyperparameters, initial_state,
                               non_freeze_flag, same_memory, step_groups)
from ..optimizers.binsgdm import DEFAULT_BETA, single_beta
from ..optimizers.compressed_rounds import DEFAULT_VARIANCE_FLOOR, DIVERGENCE_HINT, short_warm_up_warning
from ..process_sets import includes_this_rank
from .backend import TorchBackend, prepare_kernels
from .devices import home_device
from .sparse import dense, fill_flat, kept_flat
from .staging import host_bytes, make_comm

_STATE_KEY = "hvd_quant.group{}"
_CHECK_KEY = "optimizer"  # the agreement check's key (ValueAgreement)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that keeps the loss scale identical on every rank when it
    drives one of hvd_quant's 1-bit optimizers (with any other optimizer it is the stock
    class).

    The 1-bit optimizers skip a step on every rank when any rank's gradients overflowed
    (the non-finite flag rides on the step's own collective). The stock ``update()`` only
    knows whether *this* rank's gradients overflowed, so it would halve the scale on the
    overflowing rank alone and the ranks' loss scales would drift apart (harmless for the
    weights, which the optimizer unscales per rank, but a later overflow then hits ranks
    at different scales). After ``step()`` this class writes the optimizer's global verdict
    (``last_step_skipped``) into the overflow flags ``update()`` reads, so every rank backs
    off and grows its scale together.

    Examples
    --------
    >>> scaler = hq.GradScaler("cpu")                      # doctest: +SKIP
    >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()   # doctest: +SKIP
    """

    def step(self, optimizer, *args, **kwargs):
        out = super().step(optimizer, *args, **kwargs)
        if isinstance(optimizer, RuleOptimizer) and self.is_enabled():
            # GradScaler's per-optimizer state (private, unchanged since torch 1.6): the
            # per-device overflow flags that update() sums.
            for flag in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                flag.fill_(1.0 if optimizer.last_step_skipped else 0.0)
        return out


class RuleOptimizer(torch.optim.Optimizer):
    """Base of the optimizers below: runs a :class:`~hvd_quant.optimizers.base.Rule` on
    every parameter group. Not for direct use; see :class:`ZeroOneAdam` and friends."""

    # GradScaler hands us grad_scale and found_inf instead of skipping step() itself:
    # skipping must be decided on every rank together (see the module docstring).
    _step_supports_amp_scaling = True

    #: Keep the rule's full-size temporaries (a new moment, 0/1 Adam's preconditioned
    #: update and sync results...) from one step to the next instead of allocating them
    #: every step: a fresh 100 MB tensor costs more than the arithmetic that fills it
    #: (page faults; huge-page compaction on a busy machine). The price is memory: float32
    #: buffers the size of each param group, held between steps (0/1 Adam up to eight:
    #: moments, local step and accumulator, the sync's three results, zeros; 1-bit Adam
    #: two, BinSGDM two), plus one for the group's flat gradient; a group's float32
    #: parameters are moved into one flat buffer they become views of, which costs no
    #: memory (see ``_group_params``). With several param groups, each group but the largest (which
    #: runs last and writes in place, unless an earlier group already voted to skip)
    #: computes its step before the step's shared verdict is known (see ``step``), so
    #: nothing of it may be written in place: it keeps, besides, a buffer for its new
    #: parameters (1-bit Adam and BinSGDM; 0/1 Adam has one already) and, for the 1-bit
    #: Adam family, copies of its two error buffers (``1 + 1/n`` times the group, padded,
    #: for ``n`` ranks): about ``2 + 1/n`` group sizes more for 1-bit Adam, ``1 + 1/n``
    #: for 0/1 Adam, one for BinSGDM. Set ``opt.reuse_buffers = False`` to allocate per
    #: step instead. Results are the same bits either way.
    reuse_buffers = True

    def __init__(self, params, rule, defaults, named_parameters=None, process_set=None, seed=0,
                 sparse_as_dense=True, strict=None, process_group=None, probe_every=DEFAULT_PROBE_EVERY,
                 guard=False, report_after=DEFAULT_REPORT_AFTER):
        super().__init__(params, defaults)
        # What the rounds do (opt.metrics(); hvd_quant.core.metrics): each group's rounds
        # are buffers "opt.g<i>.<phase>", a compressed one probed every probe_every, and
        # guarded (hvd_quant.core.guard) when guard= asks for it.
        self._metrics = OwnerMetrics(probe_every, ranges=torch.profiler.record_function,
                                     guard=make_guard(guard, rule, probe_every, _NONFINITE_HINT, DIVERGENCE_HINT))
        # "Does it pay here?" after the warm-up (rule.steady_after) and report_after steps
        # more: the rounds against an fp32 allreduce of each group, timed then.
        self._report = PaysReport(report_after, _INSTEAD, start=rule.steady_after)
        # State and buffers on the parameters' device (the host when they are on several).
        self._device, self._mixed = home_device([p for g in self.param_groups for p in g["params"]],
                                                f"hvd_quant.torch.{type(self).__name__}")
        self._rule = rule
        self.sparse_as_dense = bool(sparse_as_dense)
        for gi, group in enumerate(self.param_groups):
            _hyper(group, rule, gi)  # refuse what the rule cannot do (non_freeze)
        self._comm, self._broadcast = _transport(type(self).__name__, process_set, process_group, self._device)
        self._values = ValueAgreement(strict)
        self._rule.validate(self._comm.size)
        self._rule.check_scale(self._comm, sum(p.numel() for g in self.param_groups for p in g["params"]))
        self._B = TorchBackend(self._device)
        prepare_kernels()  # loaded at set-up, not in the first step
        self._seed = int(seed)
        self._names = _parameter_names(self.param_groups, named_parameters)
        self._groups = {}
        self._checked = False
        self._restored = False
        self.step_kinds, self.bytes_sent, self.comm_rounds, self.skipped_steps = [], 0.0, 0, 0
        self.last_step_skipped = False  # the verdict of every rank together (see GradScaler)
        self._scratch = {}  # (group, name) -> kept temporary (reuse_buffers)
        self._flat_params = {}  # group -> the flat buffer its parameters are views of
        self._flat_grads = {}   # group -> kept buffer of its flat gradient
        self._masks = {}        # group -> (mask, its version, the flat float32 copy used)

    def _scratch_of(self, gi, group_numel):
        """``StepContext``'s scratch provider for group ``gi`` (see ``reuse_buffers``)."""
        if not self.reuse_buffers:
            self._scratch.clear()
            return None

        def get(name, zero, numel=None):
            numel = group_numel if numel is None else numel
            buf = self._scratch.get((gi, name))
            if buf is None or buf.numel() != numel:
                make = torch.zeros if zero else torch.empty
                buf = make(numel, device=self._device)
                self._scratch[(gi, name)] = buf
            return buf
        return get

    # --- state ------------------------------------------------------------------------
    def _group_state(self, gi, group):
        """The EagerGroupState of group ``gi`` (flat tensors in ``self.state``)."""
        if gi in self._groups:
            return self._groups[gi]
        key = _STATE_KEY.format(gi)
        params = group["params"]
        counts = [p.numel() for p in params]
        saved = self.state.get(key)
        if saved is None:
            slots, scalars = initial_state(self._rule, counts, self._comm.size)
            slots = {k: torch.from_numpy(v).to(self._device) for k, v in slots.items()}
            if any(p.dtype != torch.float32 for p in params):
                slots["master"] = _flat(params, self._device).clone()
            self.state[key] = saved = {"slots": slots, "scalars": scalars}
        _check_saved_group(saved, self._rule, counts, self._comm.size, gi, self._device)
        self._groups[gi] = EagerGroupState(saved["slots"], saved["scalars"], in_place=True)
        return self._groups[gi]

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if hasattr(self, "_rule"):  # else __init__ checks, once the rule is set
            _refuse_other_device(self.param_groups[-1]["params"], self._device, self._mixed,
                                 type(self).__name__)
            _hyper(self.param_groups[-1], self._rule, len(self.param_groups) - 1)

    def state_dict(self):
        """torch's optimizer state, with this optimizer's flat state (``"hvd_quant.group{i}"``)
        in host memory: copies when it lives on a GPU, so that a checkpoint loads on a
        machine without one (``load_state_dict`` moves it back to the optimizer's device)."""
        state = super().state_dict()
        if self._metrics.guard is not None:  # plain numbers: torch.load(weights_only=True) takes them
            state["hvd_quant"] = {"guard": self._metrics.guard.state_dict()}
        if self._device.type != "cpu":
            state["state"] = {key: ({"slots": {k: v.detach().cpu() for k, v in value["slots"].items()},
                                     "scalars": dict(value["scalars"])}
                                    if isinstance(key, str) and key.startswith("hvd_quant.group") else value)
                              for key, value in state["state"].items()}
        return state

    @property
    def host_bytes(self):
        """Bytes copied between the GPU and host memory for the collectives since the
        optimizer was made (:func:`hvd_quant.torch.staging.host_bytes`)."""
        return host_bytes(self._comm)

    def load_state_dict(self, state_dict):
        # DeepSpeed's OnebitAdam/ZeroOneAdam.load_state_dict: exp_avg_mask is the training
        # script's, not the checkpoint's (it may change between stages of a run). Copies:
        # the caller's dict is left as it was.
        groups = [dict(g) for g in state_dict["param_groups"]]
        for mine, saved in zip(self.param_groups, groups):
            if "exp_avg_mask" in mine:
                saved["exp_avg_mask"] = mine["exp_avg_mask"]
            else:
                saved.pop("exp_avg_mask", None)
            # bias_correction is this optimizer's (its rule's), whatever the checkpoint's
            # groups say: earlier versions saved True there and ran DeepSpeed's rule. The
            # state needs nothing new: before the freeze the moments are raw averages either
            # way, after it the variance is used as it was frozen.
            if "bias_correction" in mine:
                saved["bias_correction"] = mine["bias_correction"]
        super().load_state_dict(dict(state_dict, param_groups=groups))
        guard = dict(state_dict.get("hvd_quant", {})).get("guard")
        if self._metrics.guard is not None and guard is not None:
            self._metrics.guard.load_state_dict(guard)
        self._groups = {}  # rebuilt from the loaded flat tensors on the next step
        # A restored run may hold per-rank parameters legitimately (0/1 Adam between
        # syncs): the first-step check then compares everything but the values.
        self._restored = True
        for key, value in list(self.state.items()):
            if isinstance(key, str) and key.startswith("hvd_quant.group"):
                # onto this optimizer's device, wherever the checkpoint was saved
                value["slots"] = {k: v.detach().to(device=self._device, dtype=torch.float32).clone()
                                  for k, v in value["slots"].items()}

    # --- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step of every param group, kept or skipped as a whole.

        Every group runs its rule (and its collectives); the step is kept only if every
        group's values were finite (:func:`~hvd_quant.optimizers.base.step_groups`), else
        no group changes, on every rank (on 0/1 Adam's local steps, on the ranks whose own
        gradients were not finite), and ``last_step_skipped`` says so (GradScaler reads
        it). The groups thus keep one schedule, as DeepSpeed's optimizers have.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._checked:
            self._check_ranks()
        elif self._values.pending(_CHECK_KEY):
            self._values.recheck(self._comm, self._B, _CHECK_KEY, self._values_digest(),
                                 "the model's parameters", self._comm.rank)
        inv_scale = self._inv_scale()
        groups = self.param_groups
        started, rounds_before = time.perf_counter(), self._metrics.reduction_seconds()
        states = [self._group_state(gi, group) for gi, group in enumerate(groups)]
        before = [(len(st.kinds), st.bytes_sent) for st in states]
        new_xs, kept = step_groups(self._rule, lambda gi: self._step_context(gi, inv_scale),
                                   [sum(p.numel() for p in group["params"]) for group in groups])
        if kept:
            for st, group, new_x in zip(states, groups, new_xs):
                if "master" in st.slots:
                    st.set_slot("master", new_x)
                _write_back(group["params"], new_x)
        kinds = [st.kinds[-1] if len(st.kinds) > n else "local" for st, (n, _) in zip(states, before)]
        self.step_kinds.append(_step_kind(kinds, groups))
        self.bytes_sent += sum(st.bytes_sent - sent for st, (_, sent) in zip(states, before))
        self.comm_rounds += int(any(kind != "local" for kind in kinds))
        self.last_step_skipped = not kept  # the verdict of every rank together (see GradScaler)
        self.skipped_steps += int(not kept)
        self._metrics.rule_step_ended(started, rounds_before)
        self._report.step_ended(self._metrics, self._rule.name, self._B, self._comm,
                                fp32_buckets=self._group_sizes)
        return loss

    def _group_sizes(self):
        """Elements per param group: what fp32 would reduce, one allreduce a group."""
        return [sum(p.numel() for p in g["params"]) for g in self.param_groups]

    def metrics(self):
        """What the rounds did, as ``hq.DistributedOptimizer.metrics()`` gives it (a dict of
        plain numbers, ``None`` where not measured yet). Each group's rounds are buffers of
        their own, named by kind: bucket ``i`` is the ``i``-th kind of round seen
        (``opt.g<i>.grad``, the fp32 rounds; ``.momentum``, 1-bit Adam's; 0/1 Adam's
        compressed rounds; BinSGDM's ``.signs``). ``sync_s`` is the step's time in rounds,
        ``update_s`` the rest of ``step()``. Probes (``probe_every``) compare a 1-bit
        round's mean with the exact fp32 mean of what it averaged (the momentum for 1-bit
        Adam), and report the worker error buffer as the residual; the fp32 rounds and
        BinSGDM's are never probed (the first is exact, the second sums signs).
        Details: docs/guide/monitoring.md."""
        return self._metrics.snapshot()

    @property
    def metrics_steps(self):
        """Steps taken so far: ``metrics()["steps"]`` without building the snapshot."""
        return self._metrics.steps

    def _inv_scale(self):
        """``1 / grad_scale`` (set by ``torch.amp.GradScaler``), or None: a Python float,
        or on a GPU a float32 tensor there, computed as the float is (in float64, then
        rounded), so that reading the scale does not make the host wait."""
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return None
        if torch.is_tensor(scale) and scale.device.type != "cpu" and scale.device == self._device:
            return (1.0 / scale.detach().double()).float().reshape(())
        return 1.0 / float(scale)

    def _step_context(self, gi, inv_scale):
        """Group ``gi``'s ``StepContext`` for this step (made when the group's turn comes)."""
        group = self.param_groups[gi]
        st = self._group_state(gi, group)
        g = self._group_grads(gi, group["params"], inv_scale)
        x = st.slots["master"] if "master" in st.slots else self._group_params(gi, group["params"])
        # x is the parameters' own memory (one float32 tensor, or the flat buffer they are
        # views of), the master copy, or a concatenation of ours: the rule may write a kept
        # step's result into it (unless the group waits for the other groups' verdict:
        # StepContext.into_x).
        return StepContext(self._B, self._comm, st, g, x, group["lr"], _hyper(group, self._rule, gi),
                           f"opt.g{gi}", mask=self._group_mask(gi, group),
                           counts=[p.numel() for p in group["params"]], x_writable=True,
                           scratch=self._scratch_of(gi, x.numel()), metrics=self._metrics)

    def _group_params(self, gi, params):
        """Group ``gi``'s parameters as one flat float32 tensor the rule may write into.

        With ``reuse_buffers``, a group of several float32 CPU parameters is moved, once,
        into one flat buffer of which the parameters become views (``p.data``; the
        Parameter objects, and so the model, the optimizer state and checkpoints, stay the
        same): the rule then reads and writes the parameters in place, where a fresh
        concatenation and a copy back cost 60 ms per step for 127 MB. It is re-made if
        something replaced a parameter's memory (``p.data = ...``)."""
        if (len(params) == 1 or not self.reuse_buffers
                or not all(_flat_viewable(p, self._device) for p in params)):
            return _flat(params, self._device)
        flat = self._flat_params.get(gi)
        if flat is None or not _views_of(flat, params):
            flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=self._device)
            offset = 0
            for p in params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = flat[offset:offset + n].view_as(p)
                offset += n
            self._flat_params[gi] = flat
        return flat

    def _group_grads(self, gi, params, inv_scale):
        """Group ``gi``'s gradients as one flat float32 tensor (unscaled by ``inv_scale``):
        copied into a buffer kept from step to step with ``reuse_buffers`` (a fresh
        concatenation of 127 MB cost 48 ms per step, a copy into kept memory a third)."""
        if len(params) == 1 or not self.reuse_buffers:
            return _flat_grads(params, [self._dense_grad(p) for p in params], inv_scale, self._device)
        flat = fill_flat(kept_flat(self._flat_grads, gi, sum(p.numel() for p in params), self._device),
                         params, self.sparse_as_dense, lambda p: self._names.get(p, "a parameter"),
                         type(self).__name__)
        return flat.mul_(inv_scale) if inv_scale is not None else flat

    def _group_mask(self, gi, group):
        """The group's ``exp_avg_mask`` as a flat float32 tensor on the optimizer's device
        (None without one). A mask elsewhere is copied once, and again only when it
        changes (a copy per step would make the host wait for the GPU every step)."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return None
        kept = self._masks.get(gi)
        if kept is not None and kept[0] is mask and kept[1] == mask._version:
            return kept[2]
        flat = _group_mask(group, gi, self._device)
        self._masks[gi] = (mask, mask._version, flat)
        return flat

    def _dense_grad(self, p):
        return dense(p.grad, self._names.get(p, "a parameter"), p.numel(), self.sparse_as_dense,
                     type(self).__name__)

    def _check_ranks(self):
        """First step: every rank must use the same method, options, hyper-parameters and
        parameter structure (one small allgather; :class:`RankDisagreement` on every rank
        together if not). Parameter values that differ are compared once more at the next
        step and warned about if they still differ, or refused when strict
        (:class:`~hvd_quant.core.runner.ValueAgreement`)."""
        import numpy as np

        hyper = [{k: v for k, v in g.items() if k not in ("params", "exp_avg_mask")}
                 for g in self.param_groups]
        fingerprint = digest63(repr(self._rule), repr(sorted(self._rule.options().items())),
                               repr([sorted(h.items()) for h in hyper]))
        structure = digest63(*(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in self._named_params()))
        values = 0 if self._restored else self._values_digest()
        row = torch.tensor([fingerprint, structure, values], dtype=torch.int64)
        gathered = np.asarray(self._comm.allgather(row, "hvd_quant.optimizer.check").numpy())
        gathered = gathered.reshape(self._comm.size, 3)
        check_agreement(
            gathered[:, :2],
            ["the optimizer, its options or its hyper-parameters (learning rates included)",
             "the model's parameter names/shapes/dtypes"],
            [f"This rank uses {self._rule!r} with {hyper}; construct the optimizer the same "
             "way on every rank.", "Build the same model on every rank."])
        self._values.first(_CHECK_KEY, disagreeing_groups(gathered[:, 2]), "the model's parameter values")
        self._checked = True

    def _values_digest(self):
        return values_digest63(p.detach().cpu().contiguous().numpy() for _, p in self._named_params())

    def _named_params(self):
        return [(self._names[p], p) for g in self.param_groups for p in g["params"]]

    # --- Horovod Elastic (see hvd_quant.torch.elastic) ----------------------------------
    def _world_slots(self, counts, world_size):
        """Names of the slots whose size or meaning depends on the world (the padded
        error buffers of the compressed allreduce: worker and server error)."""
        return sorted(set(self._rule.extra_slots(counts, world_size)) & set(self._rule.per_rank_slots))

    def elastic_reset(self):
        """Adapt to the world after Horovod was initialised again (an elastic reset).

        Re-reads rank and size, re-validates the method for the new size (``ValueError``
        if, e.g., BinSGDM's ``ranks_per_node`` no longer divides it; an automatic
        ``ranks_per_node`` is recomputed), restarts from zero the error buffers whose size
        or chunk depends on the world when this rank's ``(rank, size)`` changed, and makes
        the first-step agreement check run again. Every other slot and counter is kept
        (:meth:`broadcast_state` then makes them identical from the root)."""
        old = (self._comm.rank, self._comm.size)
        self._comm.refresh()
        new = (self._comm.rank, self._comm.size)
        if getattr(self, "_auto_ranks_per_node", False):
            self._rule = BinSGDMRule(ranks_per_node=self._comm.ranks_per_node(), seed=self._seed)
        self._rule.validate(new[1])
        self._groups = {}
        self._checked = False
        self._metrics.restart()  # ranks that joined count towards probes from zero
        for gi, group in enumerate(self.param_groups):
            saved = self.state.get(_STATE_KEY.format(gi))
            if saved is None:
                continue
            counts = [p.numel() for p in group["params"]]
            sizes = self._rule.extra_slots(counts, new[1])
            for name in self._world_slots(counts, new[1]):
                have = saved["slots"].get(name)
                if old != new or have is None or have.numel() != sizes[name]:
                    saved["slots"][name] = torch.zeros(sizes[name], dtype=torch.float32,
                                                       device=self._device)

    def broadcast_state(self, root_rank=0):
        """Make the optimizer state identical to ``root_rank``'s; every rank calls it, and
        no rank steps. ``hvd.broadcast_optimizer_state(opt, root_rank)`` calls it (see
        :mod:`hvd_quant.torch.functions`), and so does Horovod Elastic's sync, after
        :meth:`elastic_reset`. Hyper-parameters, counters and every slot (moments,
        accumulators, master weights) are broadcast from the root, as the model is; the
        world-dependent error buffers stay this rank's own. A rank without state (a fresh
        optimizer, while the root resumed from a checkpoint) creates it first. Ranks get
        the root's schedule, so every rank takes the same branch, and the root's word on
        whether the state was restored from a checkpoint, so that the next step's
        agreement check compares the same things on every rank."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        hyper, restored = self._broadcast.object((hyper, self._restored), root_rank, "hvd_quant.elastic.hyper")
        self._restored = restored
        for group, h in zip(self.param_groups, hyper):
            group.update(h)
        for gi, group in enumerate(self.param_groups):
            st = self._group_state(gi, group)  # created here on a rank that joined
            skip = set(self._world_slots([p.numel() for p in group["params"]], self._comm.size))
            scalars = self._broadcast.object(dict(st.scalars), root_rank, f"hvd_quant.elastic.g{gi}.scalars")
            st.scalars.update(scalars)
            for name in sorted(st.slots):
                if name not in skip:
                    self._broadcast.tensor_(st.slots[name], root_rank, f"hvd_quant.elastic.g{gi}.{name}")
        self._checked = False

    def __repr__(self):
        return f"hvd_quant.torch.{type(self).__name__}({self._rule!r}, lr={self.defaults['lr']})"


class OnebitAdam(RuleOptimizer):
    """1-bit Adam (DeepSpeed's ``OnebitAdam``): Adam for ``freeze_step`` steps with fp32
    averaging, then the momentum through the 1-bit compressed allreduce with a frozen
    variance. See :mod:`hvd_quant.optimizers.onebit_adam` for the exact rule.

    ``scales="tensor"`` (default) compresses each parameter tensor with its own scale and
    error buffers, as DeepSpeed's ``step()`` does; ``"group"`` flattens each param group
    into one, as DeepSpeed's fp16 optimizer does. Either way a group is one set of
    collectives.

    ``bias_correction=True`` (the default, as DeepSpeed's argument) applies Adam's bias
    correction (Kingma & Ba, ICLR 2015) during the warm-up and freezes the corrected
    variance; ``False`` is DeepSpeed's code exactly, which never reads the argument and
    has no correction. Without it the variance frozen after ``freeze_step - 1`` updates is
    ``1 - beta2**(freeze_step - 1)`` warm and every later step is ``1/sqrt`` of that times
    Adam's: frozen at step 80 (``beta2=0.999``), 3.6x, which diverged to NaN on a
    5.8M-parameter language model where Adam converged (docs/guide/optimizers.md, "Why the
    default differs from DeepSpeed"). ``False`` with a warm-up shorter than ``2 / (1 -
    beta2)`` steps warns at construction. The setting applies to every param group (a
    group's own ``bias_correction`` key is refused if it differs); a checkpoint loaded
    keeps this optimizer's setting.

    ``variance_floor=0.01`` (ours; ``0`` is DeepSpeed's rule): the frozen variance of each
    element is at least that fraction of its tensor's mean. An element with no gradient
    during the warm-up (the embedding row of a word not yet seen) has a frozen variance
    of 0 and, when its word turns up, steps by ``m / eps``: on a 16,384-word language
    model 1-bit Adam diverged 20 steps after its freeze even on one rank, with nothing
    compressed (docs/guide/optimizers.md, "Large embeddings").
    ``bias_correction=False, variance_floor=0`` is DeepSpeed's code exactly."""

    def __init__(self, params, lr=1e-3, named_parameters=None, freeze_step=100000,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
                 process_set=None, amsgrad=False, scales="tensor", deepspeed=None,
                 eps_inside_sqrt=False, max_grad_norm=0.0, cuda_aware=False, comm_backend_name="nccl",
                 sparse_as_dense=True, strict=None, process_group=None,
                 variance_floor=DEFAULT_VARIANCE_FLOOR, probe_every=DEFAULT_PROBE_EVERY,
                 guard=False, report_after=DEFAULT_REPORT_AFTER):
        _deepspeed_arguments("OnebitAdam", "1-bit Adam", amsgrad, deepspeed, eps_inside_sqrt, max_grad_norm, cuda_aware,
                             comm_backend_name)
        rule = OnebitAdamRule(freeze_step=freeze_step, scales=scales, bias_correction=bias_correction,
                              variance_floor=variance_floor)
        _warn_short_warm_up("OnebitAdam", rule, betas)
        super().__init__(params, rule, _defaults(lr, betas, eps, weight_decay, bias_correction),
                         named_parameters, process_set, sparse_as_dense=sparse_as_dense, strict=strict,
                         process_group=process_group, probe_every=probe_every, guard=guard,
                         report_after=report_after)


class ZeroOneAdam(RuleOptimizer):
    """0/1 Adam (DeepSpeed's ``ZeroOneAdam``): variance updates at exponentially sparser
    fp32 rounds with 1-bit rounds between, until ``var_freeze_step``; then local steps and
    a 1-bit sync of the accumulated update every H steps, H doubling every
    ``local_step_scaler`` steps up to ``local_step_clipper``. See
    :mod:`hvd_quant.optimizers.zero_one_adam` for the exact rule.

    A param group may carry ``exp_avg_mask`` (a tensor with the group's number of
    elements, in parameter order): the 1-bit results are multiplied by it, as in
    DeepSpeed. 1-bit compression cannot represent exact zeros, so parameters whose
    momentum is always zero (e.g. embedding rows that never occur) would otherwise
    accumulate compression error; mask them with 0.

    ``exact_sync=True`` (ours, off by default) keeps the parameters of the last sync so
    that every sync leaves all ranks bit-identical; DeepSpeed's ``x - u`` agrees only to
    rounding (see :class:`~hvd_quant.optimizers.zero_one_adam.ZeroOneAdamRule`). Between
    syncs the ranks' parameters differ by design (local steps): end training with
    :meth:`final_sync` to get one model.

    ``bias_correction``: as in :class:`OnebitAdam`, for Phase A, whose variance is updated
    only on its full-precision rounds (``k`` of them before the freeze: 40 by step 80 with
    DeepSpeed's ``var_update_scaler=16``; 201 by its default ``var_freeze_step=100000``). With
    ``False`` (DeepSpeed's code) each Phase-B step is ``1 / sqrt(1 - beta2**k)`` times
    Adam's: 5x at ``var_freeze_step=80``, which diverged on a 5.8M-parameter language model.

    ``variance_floor``: as in :class:`OnebitAdam`, applied to the variance of each full
    round, which is held until the next one (Phase A) and then for good.

    ``scales``: as in :class:`OnebitAdam`. Per tensor (the default) matters most here:
    Phase A compresses raw gradients, whose scale differs by orders of magnitude between
    a LayerNorm's and an embedding's.

    ``var_update_scaler=64`` (ours; DeepSpeed's is 16, pass it for DeepSpeed's schedule):
    Phase A's first 64 steps are full rounds and its interval doubles every 64 full rounds,
    so 1-bit rounds of raw gradients start at step 67, not step 19, when the variance has
    seen enough steps. With 16, a 2.5M-parameter language model (400 steps, freeze at 80)
    ended 74% above Adam; with 64, 0.5% (docs/guide/optimizers.md). A long run pays about
    670 full rounds before ``var_freeze_step=100000`` instead of 201.

    Short runs: DeepSpeed's schedule defaults were set for BERT runs of tens of thousands
    of steps. With a Phase A of a few hundred steps, also cap the local steps lower
    (``local_step_clipper=4``):
    on the 600-step language model of docs/benchmarks/convergence.md this took 0/1 Adam from 7-8% above Adam's
    loss to within 1%, still with 29% fewer bytes and 37% fewer rounds than 1-bit Adam.
    """

    def __init__(self, params, lr=1e-3, named_parameters=None, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, var_freeze_step=100000, var_update_scaler=64,
                 local_step_scaler=32678, local_step_clipper=16, bias_correction=True,
                 process_set=None, amsgrad=False, exact_sync=False, scales="tensor", deepspeed=None,
                 eps_inside_sqrt=False, max_grad_norm=0.0, cuda_aware=False, comm_backend_name="nccl",
                 sparse_as_dense=True, strict=None, process_group=None,
                 variance_floor=DEFAULT_VARIANCE_FLOOR, probe_every=DEFAULT_PROBE_EVERY,
                 guard=False, report_after=DEFAULT_REPORT_AFTER):
        _deepspeed_arguments("ZeroOneAdam", "0/1 Adam", amsgrad, deepspeed, eps_inside_sqrt, max_grad_norm, cuda_aware,
                             comm_backend_name)
        rule = ZeroOneAdamRule(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                               local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper,
                               exact_sync=exact_sync, scales=scales, bias_correction=bias_correction,
                               variance_floor=variance_floor)
        _warn_short_warm_up("ZeroOneAdam", rule, betas)
        super().__init__(params, rule, _defaults(lr, betas, eps, weight_decay, bias_correction),
                         named_parameters, process_set, sparse_as_dense=sparse_as_dense, strict=strict,
                         process_group=process_group, probe_every=probe_every, guard=guard,
                         report_after=report_after)


    @torch.no_grad()
    def final_sync(self):
        """Synchronise what the local steps since the last sync left on each rank, so that
        training ends with one model (ours; DeepSpeed has none, and its ranks keep
        different parameters when a run stops between syncs).

        Call it on every rank at the same point, after the last ``step()`` (and before
        evaluating or saving the final model). Per group, it runs the sync of
        :meth:`~hvd_quant.optimizers.zero_one_adam.ZeroOneAdamRule.final_sync` when there
        were local steps since the last sync, and does nothing otherwise (no collective).
        With ``exact_sync=True`` every rank then holds bit-identical parameters. Step
        counters and the schedule are untouched, so training may continue afterwards.
        ``bytes_sent`` and ``comm_rounds`` count it; ``step_kinds`` does not (not a step).

        Returns
        -------
        bool
            True when some group synced (the same on every rank).
        """
        synced = False
        for gi, group in enumerate(self.param_groups):
            if _STATE_KEY.format(gi) not in self.state:
                continue  # never stepped: nothing to sync
            st = self._group_state(gi, group)
            if not bool(self._rule.sync_pending(self._B, st)):
                continue
            counts = [p.numel() for p in group["params"]]
            x = st.slots["master"] if "master" in st.slots else _flat(group["params"], self._device)
            ctx = StepContext(self._B, self._comm, st, None, x, group["lr"],
                              _hyper(group, self._rule, gi), f"opt.g{gi}", mask=self._group_mask(gi, group),
                              counts=counts)
            new_x = self._rule.final_sync(ctx)
            if "master" in st.slots:
                st.set_slot("master", new_x)
            _write_back(group["params"], new_x)
            if self._comm.size > 1:
                self.bytes_sent += self._rule.wire_bytes("onebit", counts, self._comm.size)
            synced = True
        self.comm_rounds += int(synced and self._comm.size > 1)
        return synced


class BinSGDM(RuleOptimizer):
    """BinSGDM / Birder: a 1-bit adaptive optimizer with no warm-up; every rank sends
    +-1 per element (a randomized sign of ``m / b``) through the hierarchical 1-bit
    allreduce. See :mod:`hvd_quant.optimizers.binsgdm` (a reconstruction).

    ``beta`` (or ``betas=(beta,)``): the one beta of the momentum and of the average of
    ``|g|``; 0.8 by default since 2026-12-06 (0.9 before; why: ``DEFAULT_BETA`` of that
    module). Pass ``beta=0.9`` for the earlier default and the figures measured with it.

    ``ranks_per_node``: ranks per node of the hierarchy; ``None`` takes Horovod's local
    size when the global process set is used and ranks are laid out node by node (``rank =
    cross_rank * local_size + local_rank``, every node alike), else the flat 1-bit allgather
    (another ``process_set`` may hold any ranks of any nodes). For the intra- and inter-node groups to
    run over Horovod process sets, register them at start-up:
    ``hvd.init(process_sets=hvd_quant.node_process_sets(ranks_per_node, size))``.
    """

    def __init__(self, params, lr=1e-3, named_parameters=None, betas=(DEFAULT_BETA,), beta=None,
                 weight_decay=0.0, ranks_per_node=None, seed=0, process_set=None, sparse_as_dense=True,
                 strict=None, process_group=None, probe_every=DEFAULT_PROBE_EVERY, guard=False,
                 report_after=DEFAULT_REPORT_AFTER):
        beta = single_beta(betas, beta)
        auto = ranks_per_node is None
        if auto:  # the layout of the ranks this optimizer reduces over, not of the world
            ranks_per_node = _ranks_per_node(process_set, process_group)
        super().__init__(params, BinSGDMRule(ranks_per_node=ranks_per_node, seed=seed),
                         dict(lr=lr, betas=(beta,), eps=0.0, weight_decay=weight_decay),
                         named_parameters, process_set, seed=seed, sparse_as_dense=sparse_as_dense,
                         strict=strict, process_group=process_group, probe_every=probe_every, guard=guard,
                         report_after=report_after)
        self._auto_ranks_per_node = auto  # recomputed after an elastic reset


#: The "does it pay" line's advice when the 1-bit rounds do not pay (PaysReport).
_INSTEAD = ("Use Adam with hq.DistributedOptimizer here (compression=hq.Compression.none for fp32), or "
            "hq.Compression.auto(), which measures the link and chooses per bucket.")

#: The guard's advice when a 1-bit optimizer's averaged rounds stay non-finite
#: (hvd_quant.core.guard): the divergence of issue 51's runs, and the loss scaler's case.
_NONFINITE_HINT = (
    "Under torch.amp.GradScaler (hq.GradScaler) the scale was halved at each of these steps and no step came "
    "out finite. Without one, the first such step already made the parameters or the moments inf or NaN. "
    + DIVERGENCE_HINT)


# --- helpers ---------------------------------------------------------------------------------

def _ranks_per_node(process_set, process_group):
    """BinSGDM's hierarchy: ranks per host of the ranks it reduces over."""
    if process_group is not None:
        from .dist_comm import DistComm

        return DistComm(_group(process_group)).ranks_per_node()
    from .comm import HorovodTorchComm

    return HorovodTorchComm(process_set).ranks_per_node()


def _refuse_other_device(params, device, mixed, cls_name):
    """A param group added after construction must be on the optimizer's device (its
    state and buffers are there); an optimizer over several devices (stepped through
    the host) takes any."""
    if mixed:
        return
    for p in params:
        if p.device != device:
            raise ValueError(
                f"hvd_quant.torch.{cls_name}: a parameter of the new param group is on "
                f"{p.device}, the optimizer's state and buffers are on {device} (its parameters' "
                "device). Add groups on the same device, or make the optimizer with every "
                "param group at once (parameters on several devices are then stepped through "
                "the host).")


def _group(process_group):
    """The torch.distributed group ``process_group=`` names (``True``: the world, ``None``)."""
    return None if process_group is True else process_group


def _transport(cls_name, process_set, process_group, device):
    """``(communicator, broadcaster)`` of an optimizer: over Horovod (``process_set``, the
    default) or over a ``torch.distributed`` process group (``process_group``; Horovod is
    then neither needed nor used). The algorithms are the same code on either."""
    if process_group is not None:
        if process_set is not None:
            raise ValueError(f"hvd_quant.torch.{cls_name}: give process_set (Horovod) or process_group "
                             "(torch.distributed), not both")
        from .dist_comm import DistComm  # raises the clear error when torch.distributed is not set up

        group = _group(process_group)
        return DistComm(group), _GroupBroadcast(group)
    if hvd is None:
        from .._requirements import check

        raise ImportError(f"{check('torch', horovod_optional=True)}\n(hvd_quant.torch.{cls_name} without "
                          "Horovod: pass process_group=, a torch.distributed process group)")
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not includes_this_rank(process_set):
        raise ValueError(
            f"hvd_quant.torch.{cls_name}: this rank ({hvd.rank()}) is not in the "
            f"process set {process_set!r}. The 1-bit optimizers communicate in every step; "
            "build this optimizer only on the ranks of its process set, and a local "
            "optimizer (e.g. torch.optim.Adam) on the others.")
    return make_comm(process_set, device), _HorovodBroadcast(process_set)


class _HorovodBroadcast:
    """Root-to-every-rank copies of the state over Horovod (:meth:`RuleOptimizer.broadcast_state`)."""

    def __init__(self, process_set):
        self.process_set = process_set

    def object(self, obj, root_rank, name):
        return hvd.broadcast_object(obj, root_rank, name=name, process_set=self.process_set)

    def tensor_(self, slot, root_rank, name):
        """In place. A GPU slot goes through host memory: a Horovod without GPU operations
        would copy it without waiting for the stream that wrote it."""
        if slot.device.type == "cpu":
            hvd.broadcast_(slot, root_rank, name=name, process_set=self.process_set)
            return
        host = slot.cpu()
        hvd.broadcast_(host, root_rank, name=name, process_set=self.process_set)
        slot.copy_(host)


class _GroupBroadcast:
    """The same over a ``torch.distributed`` process group (``None``: the world); ``root_rank``
    is a rank of the group. Matched by order, as every collective there (names unused)."""

    def __init__(self, group):
        self.group = group

    def _src(self, root_rank):
        return root_rank if self.group is None else dist.get_global_rank(self.group, root_rank)

    def object(self, obj, root_rank, name):
        box = [obj]
        dist.broadcast_object_list(box, src=self._src(root_rank), group=self.group)
        return box[0]

    def tensor_(self, slot, root_rank, name):
        """In place; Gloo takes host tensors, NCCL device ones."""
        on_host = slot.device.type != "cpu" and dist.get_backend(self.group) != "nccl"
        buf = slot.cpu() if on_host else slot
        dist.broadcast(buf, src=self._src(root_rank), group=self.group)
        if on_host:
            slot.copy_(buf)


_DEEPSPEED_ONLY = {
    "deepspeed": (None, "hvd_quant's optimizers communicate through Horovod by themselves; "
                        "no DeepSpeed engine is used"),
    "eps_inside_sqrt": (False, "DeepSpeed accepts it but never reads it in step(): eps is "
                               "added outside the square root, here as there"),
    "max_grad_norm": (0.0, "DeepSpeed stores it but never reads it in step() (its engine "
                           "clips); call torch.nn.utils.clip_grad_norm_ before step()"),
    "cuda_aware": (False, "the collectives are Horovod's, not DeepSpeed's MPI backend"),
    "comm_backend_name": ("nccl", "the collectives are Horovod's (Gloo, MPI or NCCL, as "
                                  "horovodrun chose), not DeepSpeed's backends"),
}


def _deepspeed_arguments(cls_name, label, amsgrad, *values):
    """Refuse AMSGrad (as DeepSpeed does), and accept DeepSpeed's constructor arguments that
    mean nothing here (so that DeepSpeed code ports unchanged); warn, saying why, when one
    is not at DeepSpeed's default."""
    import warnings

    if amsgrad:
        raise ValueError(f"{label} does not support the AMSGrad variant (as in DeepSpeed)")
    for (name, (default, why)), value in zip(_DEEPSPEED_ONLY.items(), values):
        if value is not default and value != default:
            warnings.warn(f"hvd_quant.torch.{cls_name}: {name}={value!r} is ignored: {why}",
                          UserWarning, stacklevel=3)


def _warn_short_warm_up(cls_name, rule, betas):
    """Warn at construction when DeepSpeed's rule (``bias_correction=False``) will freeze a
    variance that is far from warm (:func:`~hvd_quant.optimizers.compressed_rounds.
    short_warm_up_warning`); every rank, as the other construction warnings."""
    import warnings

    message = short_warm_up_warning(rule, tuple(betas))
    if message is not None:
        warnings.warn(f"hvd_quant.torch.{cls_name}: {message}", UserWarning, stacklevel=3)


def _group_mask(group, gi, device="cpu"):
    """The group's ``exp_avg_mask`` as a flat float32 tensor on ``device`` (None without one)."""
    mask = group.get("exp_avg_mask")
    if mask is None:
        return None
    numel = sum(p.numel() for p in group["params"])
    if mask.numel() != numel:
        raise ValueError(f"exp_avg_mask of param group {gi} has {mask.numel()} elements, the group "
                         f"has {numel} (one mask value per parameter element, in parameter order)")
    return mask.detach().reshape(-1).to(device=device, dtype=torch.float32)


def _defaults(lr, betas, eps, weight_decay, bias_correction):
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) and not torch.is_tensor(lr):
        raise TypeError(f"lr must be a number, got {type(lr).__name__} (DeepSpeed's second "
                        "positional argument is its engine, ours is lr: pass lr= by keyword)")
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate: {lr}")
    # bias_correction: DeepSpeed's argument, kept in the param groups as there; the rule
    # holds the value in force (one for all groups, see _hyper).
    return dict(lr=lr, bias_correction=bool(bias_correction), **adam_hyperparameters(betas, eps, weight_decay))


def _hyper(group, rule, gi):
    """The rule's hyper-parameters of param group ``gi``; DeepSpeed's ``non_freeze`` flag
    is checked against the rule (``ValueError`` where it is not supported), and so is a
    group's own ``bias_correction``: the rule's applies to every group."""
    mine = getattr(rule, "bias_correction", None)
    if mine is not None and bool(group.get("bias_correction", mine)) != mine:
        raise ValueError(f"param group {gi} sets bias_correction={group['bias_correction']!r}, the "
                         f"optimizer was made with bias_correction={mine}: it applies to every "
                         "param group; make one optimizer per setting")
    return {"betas": tuple(group["betas"]), "eps": group.get("eps", 0.0),
            "weight_decay": group.get("weight_decay", 0.0),
            "non_freeze": non_freeze_flag(rule, group.get("non_freeze"), f"param group {gi}")}


def _step_kind(kinds, groups):
    """The kind of a step from its groups' kinds: the first group's that follows the
    schedule (a 1-bit Adam ``non_freeze`` group has fp32 rounds throughout), else the
    first group's."""
    scheduled = [kind for kind, group in zip(kinds, groups) if group.get("non_freeze") is not True]
    return (scheduled or kinds or ["local"])[0]


def _parameter_names(groups, named_parameters):
    params = [p for g in groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    names = {p: n for n, p in named}
    missing = [i for i, p in enumerate(params) if p not in names]
    if missing:
        raise ValueError(f"named_parameters does not name {len(missing)} parameter(s) the "
                         "optimizer updates; pass model.named_parameters()")
    return names


def _flat(params, device="cpu"):
    # One float32 parameter: a flat view, not a copy (rules only read x). A 100 MB
    # torch.cat costs about twice a copy into existing memory (fresh pages).
    parts = [p.detach().reshape(-1).to(device=device, dtype=torch.float32) for p in params]
    return parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.zeros(0, device=device)


def _flat_viewable(p, device):
    return p.dtype == torch.float32 and p.device == device and p.is_contiguous()


def _views_of(flat, params):
    """True when ``params`` are, in order, contiguous views covering ``flat``."""
    base, offset = flat.data_ptr(), 0
    for p in params:
        if p.data_ptr() != base + 4 * offset or not p.is_contiguous():
            return False
        offset += p.numel()
    return offset == flat.numel()


def _flat_grads(params, grads, inv_scale, device="cpu"):
    """``grads`` (dense, or None: zeros) of ``params`` as one flat float32 tensor on ``device``."""
    parts = []
    for p, g in zip(params, grads):
        if g is None:
            parts.append(torch.zeros(p.numel(), dtype=torch.float32, device=device))
            continue
        parts.append(g.detach().reshape(-1).to(device=device, dtype=torch.float32))
    flat = (parts[0] if len(parts) == 1 else torch.cat(parts) if parts
            else torch.zeros(0, device=device))  # see _flat
    return flat * inv_scale if inv_scale is not None else flat


def _write_back(params, flat):
    offset = 0
    for p in params:
        n = p.numel()
        value = flat[offset:offset + n].view_as(p)
        if not same_memory(value, p):  # else the rule already wrote the parameter itself
            p.copy_(value)
        offset += n


def _check_saved_group(saved, rule, counts, world_size, gi, device="cpu"):
    slots, _ = initial_state(rule, counts, world_size)
    for name in rule.zero_if_missing:  # a checkpoint of an earlier version
        if name in slots and name not in saved["slots"]:
            saved["slots"][name] = torch.from_numpy(slots[name].copy()).to(device)
    for name, zeros in slots.items():
        have = saved["slots"].get(name)
        if have is None or have.numel() != zeros.size:
            raise ValueError(
                f"optimizer state of group {gi} does not fit: slot {name!r} has "
                f"{None if have is None else have.numel()} elements, expected {zeros.size} "
                f"({sum(counts)} parameters, {world_size} ranks). Checkpoints are per rank and "
                "per world size.")


__all__ = ["BinSGDM", "OnebitAdam", "RankDisagreement", "RuleOptimizer", "ZeroOneAdam"]
