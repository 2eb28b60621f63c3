"""Where the torch adapters keep their buffers and state, and how they order GPU streams.

Placement
---------
An optimizer's fused buffers and state live on its parameters' device: :func:`home_device`.
Parameters on several devices (some on the CPU, some on a GPU, or on two GPUs) are
reduced through the host instead, as before this module existed: the buffers and state
in host memory, each gradient copied over and its mean copied back to its parameter's
device. That works for any placement, at 8 bytes of copying per element and step, and is
said once (a warning) when such an optimizer is made.

Streams (:class:`BucketStreams`)
--------------------------------
``hq.DistributedOptimizer`` reduces its buckets on a worker thread while backward runs
(:mod:`hvd_quant.torch.distributed_optimizer`). On a GPU that thread's work runs on a stream of its
own, ordered by events rather than by the host:

* each gradient hook records an event on the stream that produced the gradient (the
  current stream of the autograd thread: the forward op's stream, a non-default one
  included);
* the worker's stream waits on the events of its bucket's parameters, then reduces;
  ``record_stream`` tells the caching allocator that those gradients are read there;
* an event recorded on the worker's stream after a bucket marks its mean ready; the
  optimizer's step (``synchronize()``) makes the caller's current stream wait on it and
  tells the allocator that the mean, which becomes ``.grad``, is used there.

On the CPU none of this exists: every function here returns at once.
"""

import logging

import torch

log = logging.getLogger("hvd_quant")


#: Device types the adapters run on (the torch backend's kernels: numba, Triton).
DEVICE_TYPES = ("cpu", "cuda")


def home_device(params, where):
    """``(device, mixed)``: the one device of ``params`` (the CPU if there are none), or,
    when they are on several, the CPU and ``True``, with one warning naming them.
    ``ValueError`` for a device other than the CPU and CUDA GPUs (``meta``, ...)."""
    devices = []
    for p in params:
        if p.device.type not in DEVICE_TYPES:
            raise ValueError(
                f"{where} runs on the CPU and on CUDA GPUs; a parameter is on {p.device}. Move "
                "the model to one of those before making the optimizer.")
        if p.device not in devices:
            devices.append(p.device)
    if len(devices) <= 1:
        return (devices[0] if devices else torch.device("cpu")), False
    log.warning(
        "hvd_quant: %s has parameters on %s. Its fused buffers and state are kept in host "
        "memory, and each gradient is copied there and its mean copied back (8 bytes per "
        "element and step); put the parameters on one device to keep everything there.",
        where, ", ".join(str(d) for d in devices))
    return torch.device("cpu"), True


def is_gpu(device):
    return device is not None and torch.device(device).type == "cuda"


class BucketStreams:
    """The worker stream and events of one optimizer's buckets on a CUDA ``device``
    (module docstring); ``None`` from :meth:`make` on other devices."""

    @classmethod
    def make(cls, device, nbuckets):
        return cls(torch.device(device), nbuckets) if is_gpu(device) else None

    def __init__(self, device, nbuckets):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._grad_ready = {}  # parameter -> event, re-recorded at each of its gradients
        self._done = [torch.cuda.Event() for _ in range(nbuckets)]
        self._round = None  # the caller's stream at synchronize(), for buckets it launched

    def gradient_ready(self, p):
        """In a gradient hook: the gradient of ``p`` is complete on the current stream."""
        event = self._grad_ready.get(p)
        if event is None:
            event = self._grad_ready[p] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(p.device))

    def round_point(self):
        """In ``synchronize()``, before the buckets that backward did not complete are
        launched: an event on the caller's stream that those wait on as well."""
        self._round = torch.cuda.Event()
        self._round.record(torch.cuda.current_stream(self.device))

    def run(self, gi, params, by_hooks, reduce):
        """``reduce()`` for bucket ``gi`` on the worker stream, after its gradients; marks
        the bucket done on that stream. ``by_hooks``: backward completed the bucket (its
        hooks' events cover every gradient); else it also waits for the caller's stream at
        ``synchronize()``."""
        stream = self.stream
        with torch.cuda.stream(stream):
            for p in params:
                event = self._grad_ready.get(p)
                if event is not None:
                    stream.wait_event(event)
                if p.grad is not None and p.grad.device == self.device:
                    _record_stream(p.grad, stream)
            if not by_hooks and self._round is not None:
                stream.wait_event(self._round)
            mean = reduce()
            self._done[gi].record(stream)
        return mean

    def hand_over(self, gi, mean):
        """In ``synchronize()``: the caller's current stream waits for bucket ``gi``, whose
        ``mean`` it then uses (as ``.grad``)."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self._done[gi])
        if torch.is_tensor(mean) and mean.device == self.device:
            _record_stream(mean, current)

    def end_round(self):
        self._round = None


def _record_stream(tensor, stream):
    """``tensor.record_stream(stream)``, for a sparse tensor on its indices and values:
    torch has no ``record_stream`` for the SparseCUDA layout (a sparse ``nn.Embedding``'s
    gradient; seen with torch 2.11), and those two dense tensors are what it reads."""
    if tensor.is_sparse:
        tensor._indices().record_stream(stream)
        tensor._values().record_stream(stream)
    else:
        tensor.record_stream(stream)
