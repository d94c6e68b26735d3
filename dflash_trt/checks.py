"""The one value check every boundary shares before it raises a typed error."""

from __future__ import annotations

import numbers


def is_int(value: object, numpy: bool = False) -> bool:
    """An int that is not a bool (``True`` is an ``int`` to Python, but never a count, id or size here).

    ``numpy``: numpy integers count too (token ids read from arrays; the caller
    converts with ``int()``). Off where the value ends up in JSON or a shape.
    """
    kinds = numbers.Integral if numpy else int
    return isinstance(value, kinds) and not isinstance(value, bool)
