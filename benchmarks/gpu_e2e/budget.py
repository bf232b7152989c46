"""The global time guard. No jax import: the package imports this first, so the clock
starts before jax (the imports count against the budget)."""

from __future__ import annotations

import time

_T0 = time.monotonic()  # the time guard counts from here (imports included)


class Budget:
    """Wall-clock guard: ``allows(estimate)`` is False once the estimate would overrun."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @staticmethod
    def elapsed() -> float:
        return time.monotonic() - _T0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, estimate_s: float) -> bool:
        return self.left() > estimate_s

    def skip_reason(self, estimate_s: float) -> str:
        """The ``error`` of a row skipped because ``estimate_s`` would overrun."""
        return f"time budget ({self.left():.0f}s left, ~{estimate_s:.0f}s needed)"
