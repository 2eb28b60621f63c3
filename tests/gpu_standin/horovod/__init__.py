"""A stand-in for Horovod on a GPU machine that has none, for ``tests/test_cuda.py`` only.

That file simulates its ranks (ThreadWorld) and never calls Horovod's collectives; it
needs ``horovod.torch`` to import, with the reduction ops and the names hvd_quant.torch
reads. Put this folder first on the path there (docs/development.md#a-gpu-check); it is
never on the path of the test suite.
"""
__version__ = "0.28.1"
