"""The guard: a bucket whose compressed mean stays far from the exact one falls back to fp32.

An owner (an optimizer) that turns the guard on holds one :class:`Guard`, fed by its
metrics (:class:`~hvd_quant.core.metrics.OwnerMetrics`) after each reduction of a bucket.
It acts on three things:

* **the probe's error.** On probe steps (``probe_every``) every rank holds the same
  relative error of the compressed mean against the exact fp32 mean (the probe's gathered
  figures are rank 0's, :mod:`hvd_quant.core.metrics`). When a bucket's error is above
  ``error_bound`` at ``patience`` probes in a row, the bucket is reduced by one fp32
  allreduce instead of the method for its next ``fallback_steps`` reductions, then by the
  method again (its error-feedback state and random streams kept as they were: the
  method resumes where it stopped). Rank 0 logs one warning saying why; the metrics show
  the bucket's ``fallback`` flag and the owner's ``fallbacks`` count.

  The default bound depends on the method (:func:`default_error_bound`). Without error
  feedback it is 1.0, the error of sending nothing (``||0 - g|| / ||g|| = 1``): a mean that
  far off moves the model no nearer the exact step than skipping it would. With error
  feedback one step's mean also carries what earlier steps held back, so its error
  against that step's exact mean is above 1 in healthy training: measured on the tests'
  small model at 2 ranks over 120 steps (SGD, lr 0.1), ``ef_sign`` peaked at 1.7,
  ``marsit`` at 2.6 and ``onebit`` at 3.0 (``global_qsgd``, without, at 0.05). There the
  default is :data:`ERROR_FEEDBACK_BOUND`, 4.0.
* **non-finite steps.** When the averaged gradient holds inf or NaN at ``nonfinite_patience``
  steps in a row (the steps a loss scaler skips), rank 0 logs one warning naming the
  likely cause and the setting to change (the adapter's words, ``hint``). Nothing else
  changes: skipping is the scaler's business.
* **scales that explode.** When the largest scale a bucket's method sent in a step (the
  ``scale_max`` figure) is above ``scale_growth`` times the median of its previous
  :data:`SCALE_WINDOW` steps (from :data:`SCALE_HISTORY` of them on), rank 0 logs one
  warning that training is diverging, with the adapter's advice (``divergence_hint``).
  It comes before the NaN: in a run of 1-bit Adam with DeepSpeed's rule and
  ``freeze_step`` 40 on a 7.4M-parameter language model (2 ranks, lr 1e-3), the momentum round's largest scale went from 0.19
  at step 49 to 1.6 at step 59 and 30,500 at step 69, the gradients turned NaN at step
  71, and the probe's error stayed between 1.1 and 1.6 throughout, under its bound
  (benchmarks/reference/monitoring-2026-12-02/divergence/). Nothing else changes: a
  fallback to fp32 would not stop a divergence that the update rule makes.

Every rank decides together: the error is the probe's shared figure, whether a step
probes depends only on how many times the bucket was reduced, and a fallback counts
reductions, so every rank falls back at the same reduction and issues the same
collectives (the fallback's allreduce is named ``hvd_quant.<owner>.<bucket>.fallback``
on every rank). The non-finite flags are the same on every rank too (every method carries
a non-finite input into every rank's mean), though only a warning rests on them. The
state (:meth:`Guard.state_dict`) goes into the owner's checkpoint; after an elastic reset
every rank starts it afresh (:meth:`Guard.restart`), as ranks that joined have none.
"""

import logging
import math
import numbers
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

log = logging.getLogger("hvd_quant")

#: The default bound for a method without error feedback: the error of sending nothing.
PLAIN_BOUND = 1.0
#: The default bound for a method with error feedback (module docstring: measured peaks
#: of 1.7 to 3.0 in healthy training).
ERROR_FEEDBACK_BOUND = 4.0
#: The advice of the exploding-scale warning for an optimizer that wraps another (torch
#: and Keras ``DistributedOptimizer``, the tapes): the 1-bit optimizers give their own.
DIVERGENCE_HINT = ("Lower the learning rate, or warm it up over the first steps. Under Adam or its kin a "
                   "method with error feedback can do this too, its residual growing step after step "
                   "(residual_ratio): a method without error feedback avoids it (Compression.auto() gives "
                   "adaptive optimizers only those).")
#: Steps of a bucket's largest scale whose median the scale rule compares with.
SCALE_WINDOW = 100
#: Steps of scales a bucket needs before the scale rule compares (the first steps'
#: gradients fall fast, and a median of two says little).
SCALE_HISTORY = 10


def default_error_bound(compressor):
    """The bound for ``compressor`` when the settings give none: its own
    ``guard_error_bound`` where it states one (``auto``, whose buckets may get either
    kind), else :data:`ERROR_FEEDBACK_BOUND` for a method with error feedback and
    :data:`PLAIN_BOUND` for one without."""
    stated = getattr(compressor, "guard_error_bound", None)
    if stated is not None:
        return float(stated)
    return ERROR_FEEDBACK_BOUND if getattr(compressor, "error_feedback", False) else PLAIN_BOUND


@dataclass(frozen=True)
class GuardSettings:
    """What the guard does (module docstring); every rank must pass the same.

    Attributes
    ----------
    error_bound : float or None
        A probe's relative error above this counts against the bucket (> 0; default
        ``None``: by the method, :func:`default_error_bound`).
    patience : int
        Probes in a row above the bound before the bucket falls back (>= 1; default 3).
    fallback_steps : int
        Reductions of the bucket in fp32 once it falls back (>= 1; default 1000).
    nonfinite_patience : int
        Non-finite steps in a row before the warning (>= 1; default 10: a loss scaler
        skips a few steps while its scale comes down from its start, and that is normal).
    scale_growth : float
        A step's largest scale above this many times the median of the bucket's previous
        steps warns that training diverges (> 1; default 100: in the divergence of the
        module docstring the scale grew 8.5 times in 10 steps, then 18,000 times in the
        next 10; ``inf``: never).
    """
    error_bound: float = None
    patience: int = 3
    fallback_steps: int = 1000
    nonfinite_patience: int = 10
    scale_growth: float = 100.0

    def __post_init__(self):
        bound = self.error_bound
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, numbers.Real) or not math.isfinite(bound)
                or bound <= 0):
            raise ValueError(f"guard: error_bound must be a finite number > 0 (a relative error), got {bound!r}")
        growth = self.scale_growth
        if isinstance(growth, bool) or not isinstance(growth, numbers.Real) or math.isnan(growth) or growth <= 1:
            raise ValueError(f"guard: scale_growth must be a number > 1 (a factor; inf: never), got {growth!r}")
        for name in ("patience", "fallback_steps", "nonfinite_patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"guard: {name} must be a whole number >= 1, got {value!r}")


def guard_settings(value, default=False):
    """The :class:`GuardSettings` that ``guard=`` asks for, or ``None`` (off): ``True``
    (the defaults), ``False`` (off), a dict of settings, a :class:`GuardSettings`, or
    ``None`` (``default``: the compressor's own choice, on for ``auto``). Anything else,
    or a bad setting, is a ``ValueError`` naming it."""
    if value is None:
        value = bool(default)
    if isinstance(value, GuardSettings):
        return value
    if value is True:
        return GuardSettings()
    if value is False:
        return None
    if isinstance(value, dict):
        unknown = set(value) - set(GuardSettings.__dataclass_fields__)
        if unknown:
            raise ValueError(f"guard: unknown settings {sorted(unknown)}; known: "
                             f"{', '.join(GuardSettings.__dataclass_fields__)}")
        return GuardSettings(**value)
    raise ValueError("guard must be True, False, None (the compressor's default), a dict of settings "
                     f"or a GuardSettings, got {value!r}")


def make_guard(guard, algorithm, probe_every, hint="", divergence_hint=""):
    """The :class:`Guard` that an owner's ``guard=`` asks for (``None``: ``algorithm``'s
    default, on for ``auto``), or ``None`` when it is off; a ``ValueError`` names a bad
    setting. A guard asked for explicitly needs probes (``probe_every > 0``): it reads
    their error; ``auto``'s default guard without probes keeps only the non-finite check.
    ``algorithm`` is the method the owner's buckets run (for an adaptive optimizer,
    ``compressor.for_adaptive_optimizer()``); ``hint`` and ``divergence_hint``: the
    adapter's words for the non-finite and the exploding-scale warnings."""
    settings = guard_settings(guard, getattr(algorithm, "guard_by_default", False))
    if settings is None:
        return None
    if guard is not None and not probe_every:
        raise ValueError("guard: the guard reads the probe's error, and probe_every=0 turns the probes off; "
                         "pass probe_every > 0, or guard=False")
    return Guard(settings, algorithm, hint, divergence_hint)


def checked_guard(metrics, guard, algorithm, probe_every, hint="", divergence_hint=""):
    """The guard of an owner whose metrics are on or off (``metrics=``): :func:`make_guard`'s,
    or ``None`` with metrics off. A ``ValueError`` for a ``metrics`` that is not a bool, and
    for a guard asked for with metrics off: the guard reads the metrics' probes. Every
    adapter's owners check these two arguments here, so that they refuse them alike."""
    if not isinstance(metrics, bool):
        raise ValueError(f"metrics must be True or False, got {metrics!r}")
    if guard and not metrics:
        raise ValueError("guard: the guard reads the metrics' probes; pass metrics=True with it")
    return make_guard(guard, algorithm, probe_every, hint, divergence_hint) if metrics else None


class _BucketState:
    def __init__(self):
        self.errors = []  # the probe errors above the bound, in a row (the last `patience`)
        self.fallback_left = 0  # reductions still to run in fp32
        self.fallbacks = 0  # times the bucket fell back

    def to_dict(self):
        return {"errors": list(self.errors), "fallback_left": self.fallback_left, "fallbacks": self.fallbacks}

    @classmethod
    def from_dict(cls, d):
        state = cls()
        state.errors = [float(e) for e in d.get("errors", [])]
        state.fallback_left = int(d.get("fallback_left", 0))
        state.fallbacks = int(d.get("fallbacks", 0))
        return state


class Guard:
    """One owner's guard (module docstring): per bucket, the probes above the bound and
    the fallback's remaining reductions; for the owner, the run of non-finite steps.

    ``compressor`` gives the default bound and its name to the warnings; ``hint`` is the
    adapter's advice for non-finite steps (the settings its users change),
    ``divergence_hint`` its advice when the scales explode."""

    def __init__(self, settings, compressor, hint="", divergence_hint=""):
        self.settings = settings
        self.bound = (float(settings.error_bound) if settings.error_bound is not None
                      else default_error_bound(compressor))
        self.method, self.hint, self.divergence_hint = compressor.name, hint, divergence_hint
        self.buckets = {}  # bucket key -> _BucketState
        self._bad_run = 0  # non-finite steps in a row, ending at self._last_bad
        self._last_bad = None
        self._latest = 0  # the latest step whose flag was read
        self._warned_nonfinite = False
        self._scales = {}  # bucket key -> deque of its last SCALE_WINDOW largest scales
        self._warned_scale = False
        self._dropped_fallbacks = 0  # the fallbacks of buckets dropped by forget()

    def _bucket(self, key):
        return self.buckets.setdefault(key, _BucketState())

    def falling_back(self, key):
        """Whether bucket ``key``'s next reduction is an fp32 fallback."""
        state = self.buckets.get(key)
        return state is not None and state.fallback_left > 0

    def reduced(self, key, fell_back, rel_error, rank, describe=""):
        """Bucket ``key`` was reduced: in fp32 (``fell_back``), or by the method with the
        probe's shared relative error ``rel_error`` (``None``: no probe, or a non-finite
        one). Returns ``True`` when this reduction starts a fallback."""
        state = self._bucket(key)
        if fell_back:
            state.fallback_left -= 1
            return False
        if rel_error is None:
            return False
        if not rel_error > self.bound:
            state.errors = []
            return False
        state.errors = (state.errors + [float(rel_error)])[-self.settings.patience:]
        if len(state.errors) < self.settings.patience:
            return False
        errors, state.errors = state.errors, []
        state.fallback_left = self.settings.fallback_steps
        state.fallbacks += 1
        if rank == 0:
            log.warning(self._fallback_message(key, describe, errors))
        return True

    def _fallback_message(self, key, describe, errors):
        s = self.settings
        errors = ", ".join(f"{e:.3g}" for e in errors)
        return (f"hvd_quant guard: bucket {key}{f' ({describe})' if describe else ''} of `{self.method}`: the "
                f"probe's relative error against the exact fp32 mean was above {self.bound:g} at "
                f"{s.patience} probes in a row ({errors}). The bucket is reduced in fp32 for its next {s.fallback_steps} steps, "
                f"then by `{self.method}` again (the `fallback` figure of opt.metrics() shows it). A bucket "
                "whose gradient has no steady direction (noise, a layer that flips sign every step) or "
                "whose error-feedback residual has grown (residual_ratio) does this. To keep the method, "
                "pass guard={'error_bound': ...} higher, or guard=False.")

    def nonfinite(self, step, bad, rank, skipped):
        """The averaged gradient of one bucket at ``step`` (its reduction count) was
        finite or not (flags read in order); warn once when ``nonfinite_patience`` steps
        in a row held inf or NaN. ``skipped``: the owner's count of such steps so far."""
        self._latest = max(self._latest, step)
        if not bad or step == self._last_bad:
            return
        following = self._last_bad is not None and step == self._last_bad + 1
        self._bad_run = self._bad_run + 1 if following else 1
        self._last_bad = step
        n = self.settings.nonfinite_patience
        if self._bad_run >= n and not self._warned_nonfinite:
            self._warned_nonfinite = True
            if rank == 0:
                log.warning(
                    f"hvd_quant guard: the averaged gradient of `{self.method}` held inf or NaN at {n} steps in "
                    f"a row (steps {step - n + 1} to {step}; {skipped} such steps so far), the steps a loss "
                    "scaler skips. hvd_quant's compressors keep their error-feedback state on such steps, "
                    "so the inf or NaN comes from the ranks' own gradients." + (f" {self.hint}" if self.hint else ""))

    def scaled(self, key, step, scale_max, rank, describe=""):
        """Bucket ``key``'s method sent scales at ``step`` (its ``scale_max`` figure, the
        same on every rank; read in order): warn once when it is above ``scale_growth``
        times the median of the bucket's previous steps (module docstring)."""
        history = self._scales.setdefault(key, deque(maxlen=SCALE_WINDOW))
        if not math.isfinite(scale_max):
            return  # a non-finite step: the non-finite rule's business
        if len(history) >= SCALE_HISTORY and not self._warned_scale:
            median = float(np.median(history))
            if scale_max > self.settings.scale_growth * median:
                self._warned_scale = True
                if rank == 0:
                    log.warning(self._scale_message(key, describe, step, scale_max, median, len(history)))
        history.append(float(scale_max))

    def _scale_message(self, key, describe, step, scale_max, median, window):
        return (f"hvd_quant guard: training looks divergent. At step {step} the largest scale that `{self.method}` "
                f"sent for bucket {key}{f' ({describe})' if describe else ''} was {scale_max:.3g}, "
                f"{scale_max / median:.3g} times the median of its previous {window} steps ({median:.3g}; "
                f"the bound is guard scale_growth={self.settings.scale_growth:g}). A method's scale follows the "
                "magnitude of what it averages, so the gradients (or, with error feedback, the residual) are "
                "growing fast; inf or NaN usually follows within steps."
                + (f" {self.divergence_hint}" if self.divergence_hint else ""))

    def restart(self):
        """Start afresh on every rank (after an elastic reset: ranks that joined hold no
        state, so the survivors must drop theirs to decide alike)."""
        self.buckets.clear()
        self._scales.clear()
        self._bad_run, self._last_bad, self._latest = 0, None, 0
        self._dropped_fallbacks = 0

    def forget(self, key):
        """Drop bucket ``key``'s state: its owner no longer reduces it (DDP rebuilt its
        buckets; every rank drops the same buffer at the same step). Its fallbacks still
        count in :meth:`fallbacks`."""
        state = self.buckets.pop(key, None)
        if state is not None:
            self._dropped_fallbacks += state.fallbacks
        self._scales.pop(key, None)

    def fallbacks(self):
        """Times any bucket fell back so far."""
        return self._dropped_fallbacks + sum(state.fallbacks for state in self.buckets.values())

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self):
        """Plain numbers and lists (a torch checkpoint loads them with ``weights_only``):
        the settings, each bucket's state and the current run of non-finite steps."""
        run = self._bad_run if self._last_bad is not None and self._last_bad == self._latest else 0
        return {"settings": asdict(self.settings), "nonfinite_run": run,
                "warned_nonfinite": self._warned_nonfinite, "warned_scale": self._warned_scale,
                "dropped_fallbacks": self._dropped_fallbacks,
                "buckets": {str(k): state.to_dict() for k, state in self.buckets.items()}}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` (before the first step, or between steps). A restored
        owner counts its steps from zero, so a run of non-finite steps continues from its
        first step."""
        self.buckets = {k: _BucketState.from_dict(v) for k, v in dict(state.get("buckets", {})).items()}
        self._bad_run = int(state.get("nonfinite_run", 0))
        self._last_bad = 0 if self._bad_run else None
        self._latest = 0
        self._warned_nonfinite = bool(state.get("warned_nonfinite", False))
        self._warned_scale = bool(state.get("warned_scale", False))
        self._dropped_fallbacks = int(state.get("dropped_fallbacks", 0))
