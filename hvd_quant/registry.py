"""Compressors by name: ``hvd_quant.get("ef_sign")``."""

import difflib

from .compressors.auto import AutoCompressor
from .compressors.baseline import FP16Compression, NoCompression
from .compressors.ef_sign import EFSignCompressor
from .compressors.exp_dithering import GlobalQSGDExpCompressor
from .compressors.global_qsgd import GlobalQSGDCompressor
from .compressors.marsit import CascadingSignCompressor, MarsitCompressor
from .compressors.onebit import OnebitCompressor

_REGISTRY = {}


def register(cls):
    """Add a :class:`~hvd_quant.core.compressor.Compressor` subclass under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a compressor named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available():
    """Sorted names of every registered compressor."""
    return sorted(_REGISTRY)


def get(name, **options):
    """A new compressor instance for ``name``, configured with ``options``.

    Raises
    ------
    ValueError
        For an unknown name (the message lists the available ones) or bad options.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        hint = difflib.get_close_matches(str(name), _REGISTRY, n=1)
        hint = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"unknown compressor {name!r}.{hint} Available: {', '.join(available())}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options for compressor {name!r}: {exc}") from None


for _cls in (NoCompression, FP16Compression, EFSignCompressor, MarsitCompressor,
             CascadingSignCompressor, GlobalQSGDCompressor, GlobalQSGDExpCompressor,
             OnebitCompressor, AutoCompressor):
    register(_cls)
