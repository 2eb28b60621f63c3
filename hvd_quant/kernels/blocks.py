"""Where a piece of a buffer lies among the buffer's blocks (a scale per block).

``global_qsgd(block=K)`` and ``qsgd(block=K)`` give every block of ``K`` consecutive
elements of the fused buffer a scale of its own. Their fused kernels (CPU and GPU twins)
take a *piece*: the whole buffer, or a chunk of it (:mod:`hvd_quant.core.pipeline`) that
starts at element ``first``, perhaps inside a block, and one value per block the piece
touches, from the block of its first element on. Element ``i`` of the piece is then in
the piece's block ``(first % K + i) // K``.
"""


def piece_blocks(n, block, first, *table_sizes):
    """``(block, lead, count)`` for a piece of ``n`` elements starting at element ``first``:
    the block size, the piece's start within its first block, and how many blocks it
    touches (one for an empty piece). ``ValueError`` for a block below 1, a negative
    ``first``, or a table of values per block (``table_sizes``: their lengths) shorter
    than ``count``: the kernels do not check bounds, and a short table would be read past
    its end."""
    block, first = int(block), int(first)
    if block < 1 or first < 0:
        raise ValueError(f"block must be >= 1 and first >= 0, got block={block}, first={first}")
    lead = first % block
    count = max(1, (lead + int(n) + block - 1) // block)
    for size in table_sizes:
        if int(size) < count:
            raise ValueError(f"a piece of {n} elements from element {first} touches {count} blocks of "
                             f"{block}: {count} values per block needed, got {size}")
    return block, lead, count


def check_lanes(width, block, lead):
    """``ValueError`` unless the blocks fill whole words of ``32 // width`` lanes (the lane
    kernels give each word one block's scale)."""
    lanes = 32 // int(width)
    if block % lanes or lead % lanes:
        raise ValueError(f"blocks of {block} elements, the piece {lead} into its first, do not fill "
                         f"whole words of {lanes} lanes")
