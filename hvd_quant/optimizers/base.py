"""The optimizer layer: update rules that own their communication, written once.

A compressor (:mod:`hvd_quant.compressors`) averages gradients and leaves the update to
any optimizer. The methods here cannot work that way: 1-bit Adam compresses the
*momentum*, 0/1 Adam skips communication on local steps and compresses accumulated
*updates*, BinSGDM communicates a randomized sign of an Adam-like ratio. So the update
rule and its collectives live together in a :class:`Rule`, written against
:class:`~hvd_quant.core.backend.Backend` like everything else, and thin adapters make a
rule a ``torch.optim.Optimizer`` (:mod:`hvd_quant.torch.onebit_optimizers`) or a Keras 3
optimizer (:mod:`hvd_quant.tensorflow.onebit_optimizers`); :mod:`hvd_quant.optimizers.oracle`
runs it on numpy arrays for the tests.

One rule instance serves one optimizer; it sees one *parameter group* at a time as two
flat float32 tensors (the parameters ``x`` and this rank's gradient ``g``, concatenated in
a fixed order), plus the group's flat state in a :class:`GroupState`, and the sizes of
the tensors in it (``StepContext.counts``). DeepSpeed's 1-bit optimizers compress each
tensor of a group with its own scale (``step()`` loops over them), unless its fp16
optimizer has flattened the group into one tensor; the 1-bit Adam family here does either
(``scales="tensor"``, the default, or ``"group"``), with one set of collectives per group.

Non-finite gradients: a step whose averaged (or, on a local step, local) values are not
finite changes nothing. Rules compute new values first and store them with one
:meth:`GroupState.commit` guarded by a finiteness flag that every rank shares: it comes
with the round's own collective (the fp32 average, the compressed allreduce's scale
gather), so it costs nothing extra. Local steps have no collective; their flag is the
rank's own, and only that rank's values stay put (counters advance on every rank, so
the schedule stays in step: :meth:`GroupState.advance`).

One verdict per optimizer step, not per group: DeepSpeed's optimizers have one schedule
for all their parameter groups, and a loss scaler must learn of an overflow in any of
them. :func:`step_groups` runs every group's rule (every group issues its collectives,
whatever another group's verdict), and the step is kept only if every group's flag says
so; otherwise no group changes (parameters, slots, counters), and the groups' counters
stay equal. The flags are those the groups' collectives already carry, so a shared
verdict costs no collective; on a local step each rank combines its own groups' flags.
Until the verdict is known a group's values are held back (:attr:`GroupState.deferred`):
its commits wait, and nothing is written in place (the new parameters, 0/1 Adam's local
moment and accumulator, and the 1-bit allreduce's error buffers go to buffers of their
own, see :meth:`StepContext.into_x` and :meth:`StepContext.writable_slot`). Only the last
group to run, once every group before it has kept the step, decides the verdict alone
and takes the in-place path; the largest group runs last, so with one group (and with
the usual large group plus small groups of biases and norms) the extra memory is small.

A parameter without a gradient on a step (``p.grad is None`` in torch, a ``None``
gradient in Keras) counts as zeros on that rank. DeepSpeed's per-tensor ``step()``
(``runtime/fp16/onebit/adam.py`` and ``zoadam.py``, ``if p.grad is None ...: continue``)
skips such a tensor instead: no moment update, no step count, no compressed allreduce
for it. Here a group goes through one set of collectives, and a rank cannot skip part of
it unless every rank does: skipping on one rank would change that rank's buffer layout
(or, per tensor, its number of collectives) and wreck or hang the round. Zeros keep the
layout, the schedule and the counters identical on every rank; the average then counts
that rank's gradient as zero (the other ranks' sum divided by all ranks). A parameter
that never gets a gradient anywhere still moves under zeros (its momentum decays, weight
decay applies, and a 1-bit round cannot represent zero: it gets plus or minus the
scale): freeze it (``requires_grad=False``, ``trainable=False``), leave it out of the
optimizer, or mask it with ``exp_avg_mask``.

Control flow that depends on the schedule (which step is a full-precision round, a local
step, a sync) is written with ``B.cond``: a Python ``if`` eagerly, ``tf.cond`` inside a
TensorFlow graph (counters are then ``tf.Variable`` s). The schedule depends only on
counters every rank holds identically, so every rank takes the same branch and issues the
same collectives in the same order, which is what lets collectives sit inside a branch.
"""

from ..core.backend import truth

#: What a step did on the wire: DeepSpeed's initialisation step, a full-precision
#: allreduce, a 1-bit compressed allreduce, or nothing (a local step).
KINDS = ("init", "full", "onebit", "local")


class GroupState:
    """The persistent state of one parameter group, held by an adapter.

    Slots are flat tensors (float32 unless declared otherwise); scalars are counters and
    sums (Python numbers eagerly, ``tf.Variable`` s under TensorFlow). Rules read with
    :meth:`slot` / :meth:`scalar` and write with :meth:`set_slot` / :meth:`set_scalar`;
    writes may happen inside a ``B.cond`` branch.

    Attributes
    ----------
    deferred : bool
        True while this group's step waits for the verdict of the other groups of the
        optimizer (:func:`step_groups`): commits are held back, and the rule must not
        write the state or the parameters in place. Always False with one group.
    """

    deferred = False

    def slot(self, name):
        raise NotImplementedError

    def set_slot(self, name, value):
        raise NotImplementedError

    def scalar(self, name):
        raise NotImplementedError

    def set_scalar(self, name, value):
        raise NotImplementedError

    def commit(self, ok, slots=None, scalars=None):
        """Store ``slots`` and ``scalars`` (dicts of new values) if ``ok`` holds, else keep
        the old ones and count a skipped step. ``ok`` is False when a gradient or an
        averaged value was not finite: the step then leaves no trace in the state."""
        raise NotImplementedError

    def advance(self, scalars):
        """Store ``scalars`` whether or not the step is kept: 0/1 Adam's local steps
        advance the schedule and Γ on every rank, finite or not, so that all ranks sync
        on the same step."""
        raise NotImplementedError

    def count(self, kind, nbytes):
        """Record that this step was a ``kind`` step sending ``nbytes`` bytes (per group:
        the adapter keeps totals per optimizer)."""
        raise NotImplementedError


class StepContext:
    """What one :meth:`Rule.step` of one group may use.

    Attributes
    ----------
    B : Backend
    comm : Communicator
    state : GroupState
    g : float32 tensor
        This rank's gradient of the group, flat (zeros for parameters without one).
    x : float32 tensor
        The group's parameters, flat.
    lr : float or scalar tensor
        The group's learning rate for this step (schedulers may change it every step).
    hp : dict
        The group's other hyper-parameters (``betas``, ``eps``, ``weight_decay``...).
    mask : float32 tensor or None
        DeepSpeed's ``exp_avg_mask`` for this group, flat, or None.
    name : str
        Prefix of this group's collective names, identical on every rank.
    rng : generator
        This rank's random stream (``B.generator``), for randomized rules.
    counts : list of int
        Sizes of the group's tensors, in the order they are concatenated in ``x`` and
        ``g`` (default: one tensor).
    x_writable : bool
        True when the rule may write the new parameters into ``x`` itself (the torch
        optimizer's flat view of a parameter) instead of a fresh buffer, on a step that
        updates them: :meth:`into_x` says where. The rule must still return them.
    scratch : callable or None
        ``scratch(name, zero, numel=None) -> tensor``: a float32 buffer of ``numel``
        elements (default: the group's size) that the adapter keeps from step to step
        for the temporary called ``name`` (zeros, never to be written, when ``zero``).
        See :meth:`buffer`.
    metrics : OwnerMetrics or None
        The optimizer's metrics (:mod:`hvd_quant.core.metrics`) where the adapter
        measures its rounds (eagerly: torch), else None. See :meth:`measured`.
    """

    def __init__(self, B, comm, state, g, x, lr, hp, name, rng=None, mask=None, counts=None,
                 x_writable=False, scratch=None, metrics=None):
        self.B, self.comm, self.state = B, comm, state
        self.g, self.x, self.lr, self.hp = g, x, lr, hp
        self.name, self.rng, self.mask = name, rng, mask
        self.counts = [B.numel(x)] if counts is None else [int(c) for c in counts]
        self.x_writable = bool(x_writable)
        self._scratch = scratch
        self.metrics = metrics

    def measured(self, phase, value, reduce, residual=None, probe=True, finite=None):
        """``reduce(comm)``: a round that averages ``value`` over the ranks, run on
        ``comm`` (or the metrics' timing wrapper of it) and recorded in :attr:`metrics`
        as the buffer ``<name>.<phase>`` when the adapter measures: bytes, phase times,
        and on probe steps (``probe``) the error against an exact fp32 mean of ``value``,
        with ``residual()`` (this rank's error buffer after the round) for the residual's
        norm. The round's result must be the mean of ``value``; ``finite()``, where given,
        is the round's verdict on whether every rank's input was finite (else the result's)."""
        if self.metrics is None:
            return reduce(self.comm)
        return self.metrics.measure(_Round(self.B, residual), value, self.comm, f"{self.name}.{phase}",
                                    [(phase, self.B.numel(value))], reduce, probing=probe, finite=finite)

    def buffer(self, name, numel=None):
        """Where a fused kernel may write the step's temporary ``name`` (one full-size
        value: a new moment, a preconditioned update...), or None (a fresh tensor).

        A fresh 100 MB tensor per temporary costs more than the arithmetic that fills it
        (page faults, and huge-page compaction on a busy machine); the torch adapter
        therefore keeps one buffer per name and group. Its contents live until the next
        step: values to keep must be committed (which copies them into the state)."""
        return self._scratch(name, False, numel) if self._scratch is not None else None

    def zeros(self):
        """Zeros of the group's size (to commit as a reset slot): a kept buffer that is
        never written where the adapter has one, else a fresh tensor."""
        if self._scratch is not None:
            return self._scratch("zeros", True)
        return self.B.zeros(self.B.numel(self.x))

    def into_x(self, ok):
        """Where a step whose verdict is ``ok`` may write its new parameters in place:
        ``x`` when it is writable, the step is kept and the verdict is this group's alone
        (not :attr:`GroupState.deferred`: a skip in another group must leave ``x`` as it
        was), else None (a fresh buffer, see :meth:`x_buffer`)."""
        return self.x if self._writes_in_place(ok) else None

    def into_slot(self, name, ok):
        """Where a step whose verdict is ``ok`` may write the new value of slot ``name``
        in place (0/1 Adam's momentum after a sync): the slot itself on the same terms as
        :meth:`into_x` (the adapter lets kernels write its memory, the step is kept and
        the verdict is this group's alone), else None. Its commit then copies nothing."""
        return self.state.slot(name) if self._writes_in_place(ok) else None

    def _writes_in_place(self, ok):
        # x_writable first: in a graph (TensorFlow) it is False and ``ok`` is a tensor.
        return self.x_writable and not self.state.deferred and truth(ok)

    def x_buffer(self):
        """Where new parameters go when not into ``x``: while the verdict is open (several
        groups), a kept buffer (the step's result is copied into ``x`` once every group
        kept it), else None (a fresh tensor: one group's skipped step, or no scratch)."""
        return self.buffer("x") if self.state.deferred else None

    def writable_slot(self, name):
        """The slot ``name`` to hand a kernel that updates it in place (the 1-bit
        allreduce's error buffers); the rule still stores the result with ``commit``.

        The slot itself when the verdict is this group's own (the allreduce leaves it
        untouched on a non-finite round, and its flag is the round's verdict). While the
        verdict is open (:attr:`GroupState.deferred`), a copy (into a kept buffer where
        the adapter has one): another group's skip must leave this one's slot as it was.
        """
        value = self.state.slot(name)
        if not self.state.deferred:
            return value
        return copy_tensor(value, self.buffer(f"{name}.copy", self.B.numel(value)))

    def collective_name(self, phase):
        return f"hvd_quant.{self.name}.{phase}"


class _Round:
    """What :meth:`~hvd_quant.core.metrics.OwnerMetrics.measure` reads of its owner, for a
    rule's round (:meth:`StepContext.measured`): the round's key names its collectives."""

    def __init__(self, backend, residual):
        self.backend, self._residual = backend, residual

    def collective_prefix(self, group):
        return group

    def residual(self, group, segments, comm):
        return self._residual() if self._residual is not None else None


class Rule:
    """An update rule with its own communication. Subclasses define the class attributes
    and :meth:`step`.

    Attributes
    ----------
    name : str
        Short name (``"zero_one_adam"``), also the first field of the agreement check.
    param_slots : tuple of str
        Slots with one float32 element per parameter element (moments, accumulators).
    per_rank_slots : tuple of str
        Slots whose values differ between ranks by design (error-feedback buffers,
        moments of local gradients). Never broadcast them from one rank; checkpoint
        them per rank.
    non_freeze_refusal : str or None
        Why the rule refuses DeepSpeed's ``non_freeze`` param groups (see
        :func:`non_freeze_flag`), or None when it supports them (``ctx.hp["non_freeze"]``).
    zero_if_missing : tuple of str
        Slots that a checkpoint of an earlier version may lack and that then start from
        zeros with the same result (the 1-bit allreduce's server scales: a server error
        saved as a residual is the compensated state with zero scales).
    """

    name = "abstract"
    #: Steps after which the rule's rounds are those it keeps from then on (after a warm-up
    #: or a variance freeze): the "does it pay" line (core.metrics.PaysReport) measures
    #: its window after them. 0: from the first step.
    steady_after = 0
    param_slots = ()
    per_rank_slots = ()
    zero_if_missing = ()
    non_freeze_refusal = "it has no freeze for a param group to opt out of"

    def __init__(self, **options):
        self._options = dict(options)

    def options(self):
        """Options that every rank must share (checked on the first step)."""
        return dict(self._options)

    def extra_slots(self, counts, world_size):
        """``{name: size}`` of flat float32 slots whose size is not the group's
        (DeepSpeed's padded error buffers). ``counts``: the group's tensor sizes (a list),
        or its size (an int: one tensor)."""
        return {}

    def scalars(self):
        """``{name: initial value}`` of the group's counters (ints) and sums (floats)."""
        return {}

    def validate(self, world_size):
        """Raise ``ValueError`` when the options cannot work with ``world_size`` ranks."""

    def check_scale(self, comm, numel):
        """Once per rule (per optimizer): warn on rank 0 when this rule's 1-bit steps send
        more than half an fp32 ring allreduce's bytes per rank at ``comm.size`` ranks for
        ``numel`` parameters (:mod:`hvd_quant.core.scale_check`). The adapters call it at
        set-up, after :meth:`validate`."""
        from ..core import scale_check
        return scale_check.warn_once(self, self.name, comm, numel, ranks_per_node=self.layout_hint())

    def layout_hint(self):
        """Ranks per node this rule's collectives follow (``None``: flat), for the cost
        model."""
        return getattr(self, "ranks_per_node", None)

    def step(self, ctx):
        """Update the group: return the new flat parameters (float32)."""
        raise NotImplementedError

    def wire_bytes(self, kind, numel, world_size):
        """Bytes one rank sends in a ``kind`` step of a group of ``numel`` elements (an
        int, or the list of the group's tensor sizes)."""
        raise NotImplementedError

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options().items()))
        return f"{type(self).__name__}({opts})"


def non_freeze_flag(rule, value, where="a param group"):
    """The checked ``non_freeze`` flag of one param group (``value``; None: not given).

    DeepSpeed's ``OnebitAdam.step`` (``runtime/fp16/onebit/adam.py``) reads
    ``group['non_freeze'] is True`` and gives such a group full-precision Adam after the
    freeze; its other 1-bit optimizers never read the flag. A flag the rule cannot honour
    raises ``ValueError`` (at construction) instead of being silently dropped.
    """
    if value is None or value is False:
        return False
    if value is not True:
        raise ValueError(f"non_freeze of {where} must be True or False, got {value!r}")
    if rule.non_freeze_refusal is not None:
        raise ValueError(f"{type(rule).__name__.removesuffix('Rule')} does not support non_freeze "
                         f"param groups ({where}): {rule.non_freeze_refusal}")
    return True


def adam_hyperparameters(betas, eps, weight_decay):
    """Checked ``{"betas", "eps", "weight_decay"}`` of the Adam-family rules."""
    betas = tuple(float(b) for b in betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not eps >= 0.0 or not weight_decay >= 0.0:
        raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
    return {"betas": betas, "eps": float(eps), "weight_decay": float(weight_decay)}


#: ``scales`` of the 1-bit Adam family: one RMS scale (and error buffer) per tensor, as
#: DeepSpeed's ``step()`` loops over a group's tensors; or one per group, as under
#: DeepSpeed's fp16 optimizer, which flattens each group into one tensor.
SCALES = ("tensor", "group")


def scales_option(value):
    if value not in SCALES:
        raise ValueError(f"scales must be one of {SCALES}, got {value!r}")
    return value


def tensor_sizes(counts):
    """A group's tensor sizes as a list (``counts`` an int: one tensor)."""
    return [int(counts)] if isinstance(counts, (int,)) or hasattr(counts, "__index__") else [int(c) for c in counts]


def compressed_counts(scales, counts):
    """The tensor sizes the compressed allreduce keeps apart under ``scales``."""
    counts = tensor_sizes(counts)
    return counts if scales == "tensor" else [sum(counts)]


def same_memory(a, b):
    """True when the torch tensors ``a`` and ``b`` are views of the same elements (an
    in-place kernel returns a new tensor object over its output's memory): copying one
    onto the other would move 2 bytes per byte for nothing."""
    ptr = getattr(a, "data_ptr", None)
    return (ptr is not None and hasattr(b, "data_ptr") and a.data_ptr() == b.data_ptr()
            and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride())


def copy_tensor(value, into=None):
    """A copy of the eager (numpy or torch) tensor ``value``, written into ``into`` when
    given (a kept buffer of the same size)."""
    if into is None:
        return value.clone() if hasattr(value, "clone") else value.copy()
    if hasattr(into, "copy_"):
        into.copy_(value)
    else:
        into[...] = value
    return into


def keep_if(B, ok, new, old):
    """``new`` if ``ok`` else ``old`` (a tensor; eagerly a Python branch)."""
    return B.cond(ok, lambda: new, lambda: old)


def full_precision_mean(B, comm, g, name):
    """fp32 average of ``g`` over ranks, bit-identical on every rank.

    A ring allreduce whose allgather phase copies the reduced chunks (see
    :mod:`hvd_quant.core.ring`), so every rank ends with the same bits; Horovod's own
    float allreduce over Gloo was seen to round differently on different ranks, which
    would let the ranks' parameters drift apart. Same bytes as Horovod's allreduce.

    At 2 ranks, the transport's own allreduce instead, for speed: every allreduce
    algorithm adds the same two floats once, in either order, so both ranks get the ring's
    bits. The 2-rank ring exchanges half the gradient with the one peer in each of its two
    hops, by Horovod's ``alltoall`` (Gloo's alltoallv), which posts its send before its
    receive; Gloo sends data only after the peer's ready-to-receive notice, which travels
    on the same connection as data. When rank A's notice reaches rank B before B has posted
    its send, B's data leaves at once and B's own notice waits behind it: A's data leaves
    only after B's has arrived, and the hop takes twice as long.
    Measured on 2 emulated hosts at 100 Mbit/s (1-bit Adam's warm-up on the
    time-to-quality LM, 29.5 MB): 4 of 46 hops took 2,460 ms instead of 1,230 (19 of 46
    when waiting by sleeping), and the warm-up step took 3,383 ms against Horovod fp32's
    2,863; with the allreduce, 2,993
    (``benchmarks/reference/ttq-fp32-round-2026-12-03/``). At 3 ranks or more a rank sends
    to one peer and receives from another, over two connections, and the ring stays.
    """
    from ..core.ring import FloatSum, ring_allreduce

    if comm.size == 1:
        return g

    def mean(B, comm, g):
        if comm.size == 2:
            return comm.allreduce(g, "sum", name) * 0.5
        return ring_allreduce(B, comm, g, FloatSum(), name, None) * (1.0 / comm.size)
    # A communicator that stages a GPU's tensors through host memory runs the whole ring
    # there: one copy over and one back, where staging each of its 2 (n - 1) hops would
    # copy the gradient 2 (n - 1) / n times each way (hvd_quant.torch.staging).
    on_host = getattr(comm, "on_host", None)
    return on_host(mean, g) if on_host is not None else mean(B, comm, g)


def full_precision_bytes(numel, world_size):
    """Bytes one rank sends in :func:`full_precision_mean`."""
    return 2.0 * (world_size - 1) / world_size * 4 * numel if world_size > 1 else 0.0


def initial_state(rule, counts, world_size):
    """``(slots, scalars)`` of a new group of tensors of sizes ``counts`` (or one of
    ``counts`` elements): float32 numpy zeros for every slot, and the rule's initial
    counters. Adapters copy these into their own tensors/variables."""
    import numpy as np

    sizes = {name: sum(tensor_sizes(counts)) for name in rule.param_slots}
    sizes.update(rule.extra_slots(tensor_sizes(counts), world_size))
    return {name: np.zeros(size, np.float32) for name, size in sizes.items()}, dict(rule.scalars())


class EagerGroupState(GroupState):
    """A :class:`GroupState` over plain dicts, for eager backends (numpy, torch).

    ``slots`` maps names to tensors; writes copy in place when ``in_place`` (torch: the
    optimizer's per-parameter state tensors are views into these flat buffers; the
    oracle's ``in_place`` mode), else rebind. ``kinds``, ``bytes_sent`` and ``skipped``
    record what each step did.

    Within :func:`step_groups`, :meth:`begin_step` and :meth:`end_step` frame each step:
    ``vote`` is then the group's verdict so far, and a ``deferred`` group holds its
    commits until :meth:`end_step` learns the verdict of all groups.
    """

    def __init__(self, slots, scalars, in_place=False):
        self.slots, self.scalars = slots, scalars
        self.in_place = in_place
        self.kinds, self.bytes_sent, self.skipped = [], 0.0, 0
        self.deferred, self.vote = False, True
        self._held = []  # (always, slots, scalars) of a deferred step, in commit order

    def slot(self, name):
        return self.slots[name]

    def set_slot(self, name, value):
        current = self.slots[name]
        if self.in_place:
            if value is not current and not same_memory(value, current):
                copy_tensor(value, current)
        else:
            self.slots[name] = value

    def scalar(self, name):
        return self.scalars[name]

    def set_scalar(self, name, value):
        self.scalars[name] = value.item() if hasattr(value, "item") else value

    def commit(self, ok, slots=None, scalars=None):
        ok = truth(ok)  # a GPU verdict is read from the device once per step
        self.vote = self.vote and ok
        if self.deferred:
            if ok:  # a False one makes the whole step's verdict False
                self._held.append((False, slots, scalars))
        elif ok:
            self._store(slots, scalars)
        else:
            self.skipped += 1

    def advance(self, scalars):
        if self.deferred:
            self._held.append((True, None, scalars))
        else:
            self._store(None, scalars)

    def count(self, kind, nbytes):
        self.kinds.append(kind)
        self.bytes_sent += float(nbytes)

    def begin_step(self, deferred):
        """Start a step; ``deferred``: hold commits until :meth:`end_step`."""
        self.deferred, self.vote, self._held = bool(deferred), True, []

    def end_step(self, kept):
        """Close the step. A deferred group stores what it held if ``kept`` (the verdict of
        every group), else counts one skipped step; :meth:`advance` values are stored
        either way. (A group that was not deferred stored or skipped as it went.)"""
        held, deferred = self._held, self.deferred
        self.deferred, self._held = False, []
        if not deferred:
            return
        if not kept:
            self.skipped += 1
        for always, slots, scalars in held:
            if always or kept:
                self._store(slots, scalars)

    def abandon_step(self):
        """Drop a deferred step's held values (the step raised)."""
        self.deferred, self._held = False, []

    def _store(self, slots, scalars):
        for name, value in (slots or {}).items():
            self.set_slot(name, value)
        for name, value in (scalars or {}).items():
            self.set_scalar(name, value)


def step_groups(rule, context_of, sizes):
    """One optimizer step of ``rule`` over every parameter group, kept or skipped as a
    whole (eager: :class:`EagerGroupState` groups; see the module docstring).

    Every group runs its rule, so every rank issues every group's collectives whatever
    the verdicts. The step is kept when every group's verdict is (each one shared by all
    ranks on a collective step, this rank's own on a 0/1 Adam local step); otherwise no
    group's parameters, slots or counters change (except what :meth:`GroupState.advance`
    stores on a local step), and every group counts one skipped step.

    Groups run from the smallest to the largest (the same order on every rank: the sizes
    are). All but the last are ``deferred``: their commits wait for the verdict and their
    results go to buffers of their own (:meth:`StepContext.into_x`,
    :meth:`StepContext.writable_slot`). The last group, when every group before it kept
    the step, settles the verdict itself and runs as a lone group does, in place. With
    one group this is exactly that group's own step.

    Parameters
    ----------
    rule : Rule
    context_of : callable
        ``context_of(i)``: the :class:`StepContext` of group ``i``, called once per group
        when its turn comes (so that only one group's flat gradient exists at a time).
    sizes : list of int
        The groups' numbers of elements (identical on every rank).

    Returns
    -------
    new_xs : list
        Each group's new flat parameters (in group order; meaningful when kept).
    kept : bool
    """
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    new_xs, held, kept = [None] * len(sizes), [], True
    try:
        for position, i in enumerate(order):
            ctx = context_of(i)
            st = ctx.state
            st.begin_step(deferred=not (kept and position == len(order) - 1))
            if st.deferred:
                held.append(st)
            new_xs[i] = rule.step(ctx)
            kept = kept and st.vote
    except BaseException:
        for st in held:
            st.abandon_step()
        raise
    for st in held:
        st.end_step(kept)
    return new_xs, kept
