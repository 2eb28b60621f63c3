"""One warning at construction when a compressor with error feedback feeds an adaptive
optimizer (Adam and its kin).

Sign compressors with error feedback (``ef_sign``, ``marsit``, ``onebit``,
``cascading_sign`` with compensation) send every element of a tensor with one magnitude,
the tensor's scale, and carry what the sign threw away into the next step. Adam's
per-element second moment then sees the same magnitude across the whole tensor, and error
feedback makes the time average of the sent values equal the gradient: Adam degrades to
momentum SGD normalised once per tensor, and elements with small but steady gradients
(the rare words' rows of an embedding) crawl. Tang et al. (1-bit Adam, ICML 2021, arXiv
2102.02888, section 3) make the same point: Adam's variance is non-linear in the gradient,
so error compensation before it does not work; they freeze the variance and compress the
momentum after it, as :class:`hvd_quant.torch.OnebitAdam` does.

Measured (``benchmarks/time_to_quality.py``, a 7.37M-parameter word-level GPT-2-style LM
on the standard library's source, 2 ranks, Adam at a constant 1e-3, 400 steps; see
docs/benchmarks/time-to-quality.md): validation loss 5.094 with ``ef_sign`` and 5.037 with
``marsit`` against 3.597 for fp32 Adam (+42% and +40%). The diagnosis runs are in
``benchmarks/reference/ttq-gap-2026-12-01/``. At the benchmark's rate, 5e-4, and the
defaults of 2026-12-07 (the message quotes these): +74% and +55% at 2 ranks after 400
steps, +52% and +67% at 8 ranks after 200.

The adapters decide what is adaptive (they know the framework's classes); this module
says it once per process and compressor, on rank 0, through the ``hvd_quant`` logger
(silence it as the scale warning: ``logging.getLogger("hvd_quant")``). Nothing else
changes: the method runs as asked.
"""

import logging

log = logging.getLogger("hvd_quant")

_warned = set()


def message(method, optimizer_name):
    return (f"hvd_quant: {method} keeps error feedback and feeds {optimizer_name}, an adaptive "
            f"optimizer: every element it sends has its tensor's scale as magnitude, so "
            f"{optimizer_name}'s per-element second moment goes flat across each tensor and it "
            f"trains like momentum SGD normalised per tensor. On a 7.37M-parameter language model "
            f"(2 ranks, 400 steps, Adam at 5e-4) ef_sign and marsit ended 74% and 55% above fp32 "
            f"Adam's validation loss (52% and 67% at 8 ranks after 200 steps). "
            f"With Adam, prefer hvd_quant's 1-bit optimizers (OnebitAdam, BinSGDM), which "
            f"compress after Adam's normalisation, or an unbiased compressor without error "
            f"feedback (global_qsgd); with SGD and momentum this does not apply. See "
            f"docs/methods/ef_sign.md, 'With Adam'.")


def warn_once(compressor, optimizer_name, adaptive, rank):
    """Log the warning on rank 0, once per (method, optimizer class), when ``adaptive`` and
    ``compressor.error_feedback``. Returns the message when one was logged, else ``None``."""
    if not adaptive or not getattr(compressor, "error_feedback", False) or rank != 0:
        return None
    key = (compressor.name, optimizer_name)
    if key in _warned:
        return None
    _warned.add(key)
    text = message(compressor.name, optimizer_name)
    log.warning(text)
    return text
