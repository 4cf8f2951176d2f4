"""Records' JSON values parsed by orjson, with exactly ``json.loads``'s answers.

Parsing JSON is a large share of a record's cost in local mode (Nexmark q0: the source's
lines and the map's values, ~20% of its samples); orjson parses the same text several
times faster. It is stricter than the standard library in a few places (``NaN`` and
``Infinity``, integers over 64 bits, lone surrogate escapes, encodings other than
UTF-8), and whatever it refuses is handed to ``json.loads``. It also reads an integer
of more than 64 bits as a float where Python keeps it exact: a result holding a float of
2**63 or more in magnitude (such an integer, or a float literal that large) is parsed
again by ``json.loads``. So the result, and the error for text that is not JSON at all,
are the standard library's in every case.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_FAST = orjson.loads
_FAST_ERROR = orjson.JSONDecodeError
_SLOW = json.loads


#: The smallest magnitude orjson may have turned an integer into a float at (past 64 bits).
_BIG = 2.0 ** 63


def _may_hold_a_big_integer(values: tuple[Any, ...]) -> bool:
    """True when a float among ``values`` (in their lists and dicts too) is at least
    2**63 in magnitude: maybe an integer orjson read as a float (a float literal that
    large is re-read too, to the same)."""
    stack: list[Any] = [values]
    while stack:
        v = stack.pop()
        items = v.values() if type(v) is dict else v
        for x in items:
            t = type(x)
            if t is float:
                if not -_BIG < x < _BIG:
                    return True
            elif t is dict or t is list:
                stack.append(x)
    return False


#: What :func:`fast` returns for text it leaves to the standard library.
NOT_FAST: Any = object()


def fast(raw: bytes | bytearray | str) -> Any:
    """``raw`` parsed by orjson where that is ``json.loads``'s answer, else NOT_FAST."""
    try:
        value = _FAST(raw)
    except _FAST_ERROR:
        return NOT_FAST
    return NOT_FAST if _may_hold_a_big_integer((value,)) else value


def loads(raw: bytes | bytearray | str) -> Any:
    """``json.loads(raw)``, faster."""
    value = fast(raw)
    return _SLOW(raw) if value is NOT_FAST else value
