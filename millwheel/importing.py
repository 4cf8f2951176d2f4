"""Load user code named by ``pkg.module:attribute``."""

from __future__ import annotations

import importlib
from typing import Any

from millwheel.errors import InvalidSpecError


def import_object(path: str, *, what: str = "object") -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidSpecError(f"{what} {path!r}: expected 'pkg.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidSpecError(f"{what} {path!r}: cannot import {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidSpecError(
                f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj
