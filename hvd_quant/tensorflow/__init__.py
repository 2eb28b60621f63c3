"""TensorFlow adapter: ``Compression`` and ``DistributedGradientTape`` mirroring
``horovod.tensorflow``. Works with Keras 3 (TF 2.21's default) and with tf-keras.

>>> import hvd_quant.tensorflow as hq                                    # doctest: +SKIP
>>> with tf.GradientTape() as tape:                                      # doctest: +SKIP
...     loss = loss_fn(y, model(x))
>>> tape = hq.DistributedGradientTape(tape, compression=hq.Compression.ef_sign)
>>> grads = tape.gradient(loss, model.trainable_variables)               # doctest: +SKIP
"""

from .backend import TFBackend
from .comm import HorovodTFComm
from .compression import Compression, TFCompressor
from .tape import DistributedGradientTape, broadcast_variables

__all__ = ["Compression", "DistributedGradientTape", "HorovodTFComm", "TFBackend", "TFCompressor",
           "broadcast_variables"]
