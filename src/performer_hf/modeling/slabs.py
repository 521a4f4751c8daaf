"""Long inputs are processed slab by slab: the largest temporary of one slab stays about cache-sized, so
memory stays linear in the sequence length (hybrid attention's query blocks, routing scores and the
polynomial far-field state)."""

# Upper bound on the elements of the largest temporary of one slab of query blocks (or of positions).
SLAB_ELEMENTS = 1 << 24
# The polynomial far field's (rows, d, dv + 1) temporaries: smaller, so that they stay in cache.
FAR_SLAB_ELEMENTS = 1 << 20


def slabs(length: int, per_row: int, far: bool = False) -> list[slice]:
    """Slices of ``range(length)`` with about SLAB_ELEMENTS (FAR_SLAB_ELEMENTS with ``far``) / per_row rows each."""
    rows = max(1, (FAR_SLAB_ELEMENTS if far else SLAB_ELEMENTS) // max(1, per_row))
    return [slice(start, min(length, start + rows)) for start in range(0, length, rows)]
