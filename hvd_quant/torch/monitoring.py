"""Compression metrics into TensorBoard, for ``hq.DistributedOptimizer``.

>>> from torch.utils.tensorboard import SummaryWriter
>>> from hvd_quant.torch.monitoring import TensorBoardWriter
>>> tb = TensorBoardWriter(opt, SummaryWriter("runs/exp1") if hvd.rank() == 0 else None, every=50)

Every ``every`` steps of the optimizer (after its ``step()``, through torch's step
post-hook), each figure of ``opt.metrics()`` goes to the writer as a scalar tagged
``hvd_quant/<figure>`` (``hvd_quant/bucket0/<figure>`` per bucket), at the optimizer's
step count; figures not measured yet (``None``) are left out. The figures and what they
mean: :mod:`hvd_quant.core.metrics` and docs/guide/monitoring.md. Writing reads no
collective, so a writer on rank 0 only (``None`` elsewhere) is the usual set-up; the
global figures (the probe's) are the same on every rank.
"""

import numbers

#: The prefix of every tag.
TAG = "hvd_quant"


class TensorBoardWriter:
    """Writes ``optimizer.metrics()`` into ``writer`` every ``every`` steps.

    Parameters
    ----------
    optimizer : hq.DistributedOptimizer
        Anything with ``metrics()``, ``metrics_steps`` and torch's
        ``register_step_post_hook``.
    writer : torch.utils.tensorboard.SummaryWriter or None
        ``None``: write nothing (the ranks other than the one that logs).
    every : int
        Steps between writes, >= 1.
    means : bool
        Also write the running means (``<figure>.mean``); default False.
    per_bucket : bool
        Also write each bucket's figures; default True.
    """

    def __init__(self, optimizer, writer, every=100, means=False, per_bucket=True):
        if not (callable(getattr(optimizer, "metrics", None)) and hasattr(optimizer, "metrics_steps")
                and hasattr(optimizer, "register_step_post_hook")):
            raise TypeError("TensorBoardWriter needs an hvd_quant.torch.DistributedOptimizer "
                            f"(with metrics()), got {type(optimizer).__name__}")
        if writer is not None:
            from torch.utils.tensorboard import SummaryWriter
            if not isinstance(writer, SummaryWriter):
                raise TypeError("writer must be a torch.utils.tensorboard.SummaryWriter (or None "
                                f"on the ranks that write nothing), got {type(writer).__name__}")
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"every must be a whole number >= 1, got {every!r}")
        self.optimizer, self.writer, self.every = optimizer, writer, int(every)
        self.means, self.per_bucket = bool(means), bool(per_bucket)
        self._written = 0  # the step count last written (a hook may run twice per step)
        self._hook = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs):
        # torch runs the hook after the wrapped optimizer's step and again after ours:
        # the step count, which ours records, says which step this is.
        step = self.optimizer.metrics_steps
        if self.writer is None or step == self._written or step % self.every:
            return
        self.write(step=step)

    def write(self, figures=None, step=None):
        """Write ``figures`` (default: ``optimizer.metrics()`` now) at ``step`` (default:
        its ``steps``)."""
        if self.writer is None:
            return
        figures = self.optimizer.metrics() if figures is None else figures
        step = figures["steps"] if step is None else int(step)
        for name, value in figures.items():
            if value is None or (name.endswith(".mean") and not self.means):
                continue
            if name.startswith("bucket") and not self.per_bucket:
                continue
            self.writer.add_scalar(f"{TAG}/{name}", float(value), step)
        self._written = step

    def close(self):
        """Stop writing (removes the step hook); the writer stays open."""
        self._hook.remove()


#: The guard's advice when the averaged gradient stays non-finite (hvd_quant.core.guard),
#: for every torch owner: ``hq.DistributedOptimizer`` adds how to reduce before unscaling.
NONFINITE_HINT = (
    "Without a loss scaler, the first such step already wrote inf or NaN into the parameters and every "
    "later step follows: check the data and the loss, and lower the learning rate (or warm it up). With "
    "torch.amp.GradScaler the scale was halved at each of these steps and no step came out finite, so "
    "the scale is not the cause either: the same applies.")
