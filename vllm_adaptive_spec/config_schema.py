"""The config schema's setting: its type, default and rule, and the
constructors the engine, the drafters and the policies declare their
settings with. ``config`` reads the user's speculative config against them
and names the offending key and its rule on any error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Param:
    """A tunable setting: its type, default and the rule a value must obey."""

    kind: type
    default: Any
    rule: str
    check: Callable[[Any], bool]


def fraction(default: float) -> Param:
    return Param(float, default, "a number from 0 to 1", lambda v: 0.0 <= v <= 1.0)


def integer(default: int, low: int, high: int) -> Param:
    return Param(int, default, f"an integer from {low} to {high}", lambda v: low <= v <= high)
