"""Compressors by name: ``hvd_quant.get("ef_sign")``.

The table itself is :mod:`hvd_quant.core.compressor`'s (:func:`register`, :func:`get`,
:func:`available`); this module registers the built-in methods in it. Importing
``hvd_quant`` imports this module, so every built-in is known by name from then on,
and the cost model knows every method (the 1-bit optimizers' modules and
``compressors.baseline`` register their costs when imported).
"""

from .compressors.auto import AutoCompressor
from .compressors.baseline import FP16Compression, NoCompression
from .compressors.ef_sign import EFSignCompressor
from .compressors.exp_dithering import GlobalQSGDExpCompressor
from .compressors.global_qsgd import GlobalQSGDCompressor
from .compressors.marsit import CascadingSignCompressor, MarsitCompressor
from .compressors.two_sided_sign import OnebitCompressor
from .compressors.qsgd import QSGDCompressor
from .core.compressor import available, get, register  # noqa: F401 (the public names)
from . import optimizers  # noqa: F401 (the 1-bit optimizers register their costs)

for _cls in (NoCompression, FP16Compression, EFSignCompressor, MarsitCompressor,
             CascadingSignCompressor, GlobalQSGDCompressor, GlobalQSGDExpCompressor,
             QSGDCompressor, OnebitCompressor, AutoCompressor):
    register(_cls)
