"""How large a broadcast intermediate any blocked kernel may build at once.

Kernels never materialise a ``batch x out x in`` intermediate: the blocked fallbacks (max-plus
products, dense Jacobian contractions, interpolation taps) split their work so that each block
broadcasts at most ``BLOCK_ELEMENTS`` entries.
"""

#: Largest number of elements a blocked fallback may broadcast at once (32 MiB of float32).
BLOCK_ELEMENTS = 1 << 23
