"""The one multiplication of `kvcache.reference`, and its counter.

Every multiplication in the reference goes through `mul`, so the count it keeps is the exact
number of scalar multiplications a computation did: the lab counts, it does not time. Divisions,
additions, `math.exp` and `math.sqrt` are not multiplications and are not counted.
"""

from __future__ import annotations

_muls = 0


def mul(a: float, b: float) -> float:
    """Return `a * b` and add one to the module's multiplication count."""
    global _muls
    _muls += 1
    return a * b


def muls() -> int:
    """The number of `mul` calls since the last `reset_muls()` (or since import)."""
    return _muls


def reset_muls() -> None:
    """Set the multiplication count back to zero."""
    global _muls
    _muls = 0


class counted:
    """Context manager counting the multiplications done inside its block.

    >>> with counted() as c:
    ...     _ = mul(2.0, 3.0)
    >>> c.muls
    1

    It does not reset the module's count, so blocks can nest.
    """

    def __init__(self) -> None:
        self.muls = 0
        self._start = 0

    def __enter__(self) -> counted:
        self._start = _muls
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.muls = _muls - self._start
