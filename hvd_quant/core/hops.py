"""Per-hop combine operators for multi-hop (ring / torus) allreduce.

A multi-hop allreduce moves *wire-format* chunks from rank to rank. At every hop of the
reduce phase the receiving rank folds its own contribution into what arrived, **without
leaving the wire format** (no decompress / recompress). A :class:`HopOperator` says how.

Counts
    ``received_count`` is how many ranks' contributions the received chunk already
    stands for; ``own_count`` how many the local chunk stands for (1 in a plain ring; in
    the column phase of a 2D torus a row-reduced chunk stands for a whole row). Unbiased
    random operators (Marsit's bit selection, exponential dithering's stochastic sum) need
    these weights; exact sums ignore them.

Units
    The ring splits a wire tensor only at multiples of :attr:`HopOperator.unit` elements
    of the wire tensor (1 for most formats). Operators work element-wise on whole units,
    so any split is valid.
"""


class HopOperator:
    """Combine two wire-format chunks. Subclasses implement :meth:`combine`."""

    #: Registry-style name used in options, logs and benchmarks.
    name = "abstract"
    #: Ring chunks are cut at multiples of this many wire elements.
    unit = 1

    def combine(self, B, own, own_count, received, received_count, rng):
        """Return the wire chunk standing for ``own_count + received_count`` ranks.

        Parameters
        ----------
        B : Backend
        own, received : tensor
            Same length, same dtype (the wire dtype).
        own_count, received_count : int
        rng : generator from ``B.generator``; used only by randomised operators.
        """
        raise NotImplementedError
