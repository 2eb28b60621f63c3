"""Segment layouts as the GPU kernels read them, built once per device and layout.

A fused buffer's segments are given to the primitives as ``bounds``, the numpy int64
offsets of :func:`hvd_quant.core.segments.segment_bounds`. The GPU kernels
(:mod:`hvd_quant.kernels.gpu`) work in *tiles* of :data:`TILE` elements (one program
each) and need, per tile, which segments it touches, and for the per-segment sums where
each segment's partial sums lie. Those tables are computed here with numpy and copied to
the device once per (device, layout); every later call with the same layout finds them in
a bounded LRU cache, so a training step makes no host-to-device copy of them.

Per tile ``t`` (elements ``t * TILE .. (t + 1) * TILE - 1``), four int32:

* ``lo``, ``hi``: the segments of its first and last element (empty segments between
  them are skipped by the kernels' search: the segment of element ``i`` is the last
  ``s`` with ``bounds[s] <= i``);
* ``piece``: where its *pieces* start, one per segment ``lo .. hi``: the partial sums of a
  tile's elements in each segment it touches, in tile order; a segment's pieces are
  consecutive (:data:`Layout.pieces` gives each segment's range);
* ``steps``: the binary-search steps that find an element's segment among ``lo .. hi``
  (``(hi - lo).bit_length()``: 0 where a tile lies inside one segment).
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

#: Elements per program of the segment kernels (512 packed bytes: whole bytes per tile).
TILE = 4096
#: Layouts kept per process (all devices together); the least recently used goes first.
CACHE_SIZE = 256


@dataclass(frozen=True)
class Layout:
    """One layout's tables on one device (torch tensors there) and its sizes."""
    bounds: object   # int64, segments + 1 offsets
    tiles: object    # int32, 4 per tile: lo, hi, piece, steps
    pieces: object   # int32, segments + 1: segment s's pieces are pieces[s] .. pieces[s + 1] - 1
    numel: int
    segments: int
    tiles_count: int
    pieces_count: int


def tables(bounds, tile=TILE):
    """The numpy tables of :class:`Layout` for int64 ``bounds`` (``(tiles, pieces)``)."""
    bounds = np.asarray(bounds, np.int64)
    d = int(bounds[-1])
    starts = np.arange(0, d, tile, dtype=np.int64)
    ends = np.minimum(starts + tile, d)
    lo = np.searchsorted(bounds, starts, side="right") - 1
    hi = np.searchsorted(bounds, ends - 1, side="right") - 1
    count = hi - lo + 1
    piece = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64) if count.size else count
    steps = np.array([int(c).bit_length() for c in (hi - lo)], np.int64)
    tile_table = np.stack([lo, hi, piece, steps], axis=1).astype(np.int32).reshape(-1)
    # The segment of every piece, in piece order (non-decreasing): a segment's pieces are
    # the run of its number; a segment that no tile touches (empty) has none.
    total = int(count.sum())
    first = np.repeat(piece, count)
    segment_of_piece = np.repeat(lo, count) + (np.arange(total) - first)
    pieces = np.searchsorted(segment_of_piece, np.arange(bounds.size), side="left").astype(np.int32)
    return tile_table, pieces


_cache = OrderedDict()
_lock = threading.Lock()  # ranks simulated as threads share the process's cache


def layout(bounds, device):
    """The :class:`Layout` of ``bounds`` on the torch ``device``, from the cache or built
    (and copied there) now."""
    import torch

    bounds = np.ascontiguousarray(bounds, np.int64).reshape(-1)
    if bounds.size < 1 or bounds[0] != 0 or np.any(np.diff(bounds) < 0):
        raise ValueError(f"segment bounds must start at 0 and not decrease, got {bounds[:8]}...")
    key = (str(device), bounds.tobytes())
    with _lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    tile_table, pieces = tables(bounds)
    built = Layout(torch.from_numpy(bounds).to(device), torch.from_numpy(tile_table).to(device),
                   torch.from_numpy(pieces).to(device), int(bounds[-1]), bounds.size - 1,
                   tile_table.size // 4, int(pieces[-1]))
    with _lock:
        _cache[key] = built
        _cache.move_to_end(key)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return built


def cached():
    """How many layouts the cache holds now."""
    with _lock:
        return len(_cache)
