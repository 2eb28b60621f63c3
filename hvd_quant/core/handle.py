"""What the framework adapters share: a compressor handle and the ``Compression`` namespace.

``hvd_quant.torch.Compression.<name>`` and ``hvd_quant.tensorflow.Compression.<name>`` are
:class:`CompressorHandle` subclasses: a registered compressor plus this rank's runner
(state, randomness, agreement checks). The subclasses add only Horovod's
``compress``/``decompress`` pair and the framework's backend.
"""

from .. import registry
from .runner import CompressorRunner


class CompressorHandle:
    """A configured compressor as users pass it to ``compression=``.

    Calling the handle returns a new, independently-stateful handle with updated options:
    ``Compression.ef_sign()`` or ``Compression.global_qsgd(norm="l2")``.
    """

    #: Set by subclasses: ``"torch"`` or ``"tensorflow"`` (for messages).
    framework = None

    def __init__(self, name, seed=0, **options):
        self.core = registry.get(name, **options)
        self.name = name
        self.seed = seed
        self._options = dict(options)
        self._runner = None
        self._comm = None           # created by the stock-Horovod path on first use
        self._horovod_bytes = 0.0   # bytes Horovod's own allreduce sent for plain casts

    def make_backend(self):
        raise NotImplementedError

    def __call__(self, **options):
        seed = options.pop("seed", self.seed)
        return type(self)(self.name, seed=seed, **{**self._options, **options})

    def __repr__(self):
        return (f"hvd_quant.{self.framework}.Compression.{self.name}"
                f"{repr(self.core)[len(type(self.core).__name__):]}")

    def runner(self):
        if self._runner is None:
            self._runner = CompressorRunner(self.core, self.make_backend(), seed=self.seed)
        return self._runner

    def load_state_dict(self, state):
        self.runner().load_state_dict(state)

    @property
    def bytes_sent(self):
        """Bytes this rank sent through this compressor in Horovod's stock optimizer or tape
        (cost model of :class:`~hvd_quant.core.comm.WireMeter`; under ``tf.function``
        counted when the reduction is traced)."""
        return self._horovod_bytes + (self._comm.meter.bytes_sent if self._comm else 0.0)

    def _count_horovod_cast(self, nbytes, world_size):
        self._horovod_bytes += 2.0 * (world_size - 1) / world_size * nbytes


class CompressionNamespace:
    """Mirrors Horovod's ``Compression``: ``Compression.none``, ``.fp16`` and one attribute
    per registered compressor, each access a fresh handle; ``Compression.get(name, **options)``."""

    def __init__(self, handle_cls):
        self._handle_cls = handle_cls

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self.get(name)
        except ValueError as exc:
            raise AttributeError(str(exc)) from None

    def __dir__(self):
        return registry.available() + ["get"]

    def get(self, name, **options):
        return self._handle_cls(name, **options)
