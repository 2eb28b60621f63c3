"""hvd_quant: extreme gradient quantization for Horovod, for PyTorch and TensorFlow.

Layout
------
``hvd_quant.core``
    Framework-agnostic algorithms written against a small tensor-ops backend
    (numpy, torch, TensorFlow); the numpy backend is the test oracle.
``hvd_quant.compressors``
    The compression methods, each a :class:`~hvd_quant.core.compressor.Compressor`.
``hvd_quant.torch`` / ``hvd_quant.tensorflow``
    Thin adapters mirroring Horovod's API: ``Compression.<name>``,
    ``DistributedOptimizer`` / ``DistributedGradientTape``.

The framework adapters are imported explicitly (``import hvd_quant.torch``) so that this
package imports without torch, TensorFlow or Horovod.
"""

from .core.compressor import Compressor
from .kernels.threads import threads_per_rank
from .process_sets import node_process_sets, torus_process_sets
from .registry import available, get, register

__version__ = "0.1.0"
__all__ = ["Compressor", "available", "get", "node_process_sets", "register", "threads_per_rank",
           "torus_process_sets", "__version__"]
