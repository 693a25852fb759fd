"""Run bad-input calls on a worker and record what each raised, for comparison across ranks."""

from __future__ import annotations

from collections.abc import Callable, Mapping


def error_outcomes(calls: Mapping[str, Callable[[], object]]) -> dict[str, tuple[str, str]]:
    """``{name: (exception type name, first line of its message)}``, or ``("no error", "")``."""
    outcome: dict[str, tuple[str, str]] = {}
    for name, call in calls.items():
        try:
            call()
            outcome[name] = ("no error", "")
        except (ValueError, TypeError) as error:
            outcome[name] = (type(error).__name__, str(error).split("\n")[0])
    return outcome
