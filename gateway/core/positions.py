"""Ranges of absolute token positions in a session's timeline (what a spec reports at)."""

from __future__ import annotations

from dataclasses import dataclass

from prismgate.core.errors import invalid


@dataclass(frozen=True, slots=True)
class PositionRange:
    """Absolute token positions ``[start, end)`` in a session's timeline."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < 0:
            raise invalid(f"position range [{self.start}, {self.end}) has a negative bound")
        if self.end < self.start:
            raise invalid(f"position range [{self.start}, {self.end}) ends before it starts")

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and self.start <= position < self.end
