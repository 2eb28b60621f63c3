"""The compressors, each a framework-agnostic :class:`~hvd_quant.core.compressor.Compressor`."""
