"""Where a built-in operator writes: its ``output`` parameter, else the computation's
first output. One rule for every built-in (each used to spell it out)."""

from __future__ import annotations

from millwheel.errors import InvalidSpecError


def default_output(operator: str, output: str | None, outputs: tuple[str, ...]) -> str:
    """``output`` if given, else the first of ``outputs``; an operator that would write
    nowhere is refused (at registration, where buildable.py builds it)."""
    if output is not None:
        return output
    if not outputs:
        raise InvalidSpecError(f"{operator} needs an output stream")
    return outputs[0]
