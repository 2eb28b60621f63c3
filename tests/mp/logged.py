"""What hvd_quant logged inside a block: the workers' check of its warnings."""

import contextlib
import logging

from hvd_quant.core import runner


@contextlib.contextmanager
def captured_warnings():
    """The messages of the hvd_quant warnings logged inside the block, as a list filled
    in as they come. The value warning, once per process, is re-armed first, so that each
    block of a worker sees its own."""
    runner._warned_values[0] = False
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    log = logging.getLogger("hvd_quant")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
