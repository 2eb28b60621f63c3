"""TensorFlow adapter: ``Compression``, the Keras 3 ``DistributedOptimizer`` and
``callbacks`` for ``model.fit``, ``DistributedGradientTape`` for custom loops and
``elastic`` for Horovod Elastic, mirroring ``horovod.tensorflow``. Works with Keras 3
(TF 2.21's default); under tf-keras use Horovod's own ``hvd.keras.DistributedOptimizer``
or tape with our ``Compression``.

>>> import hvd_quant.tensorflow as hq                                    # doctest: +SKIP
>>> opt = hq.DistributedOptimizer(keras.optimizers.Adam(1e-3),           # doctest: +SKIP
...                               compression=hq.Compression.ef_sign)
>>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")  # doctest: +SKIP
>>> model.fit(x, y, callbacks=[hq.callbacks.BroadcastGlobalVariablesCallback(0)])  # doctest: +SKIP
"""

from .._requirements import check as _check_requirements

_check_requirements("tensorflow")  # versions and Horovod's tensorflow ops: one clear ImportError

from .backend import TFBackend
from .comm import HorovodTFComm
from .compression import Compression, TFCompressor
from .tape import DistributedGradientTape, PartialDistributedGradientTape, broadcast_variables
from .keras import DistributedOptimizer, PartialDistributedOptimizer
from . import callbacks
from .onebit_optimizers import BinSGDM, OnebitAdam, StepKindRecorder, ZeroOneAdam
from . import elastic

__all__ = ["BinSGDM", "Compression", "DistributedGradientTape", "DistributedOptimizer", "HorovodTFComm",
           "OnebitAdam", "PartialDistributedGradientTape", "PartialDistributedOptimizer",
           "StepKindRecorder", "TFBackend", "TFCompressor", "ZeroOneAdam", "broadcast_variables",
           "callbacks", "elastic"]
