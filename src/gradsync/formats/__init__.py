"""Wire formats: ``encode(…) -> uint8 tensor`` and ``decode(buf) -> SparseGrad``.

Every decoder validates its input: a truncated, corrupted or hostile buffer raises
``ValueError``; it never crashes, loops, or allocates more than the buffer can describe.
"""
