"""Waiting in tests on a condition, never on a fixed sleep (a busy machine only makes it slower)."""

from __future__ import annotations

import time


def wait_for(condition, timeout: float = 15.0) -> bool:
    """Poll `condition()` until true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
