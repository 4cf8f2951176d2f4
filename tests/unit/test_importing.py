"""The code allow-list is checked on the object a path resolves to, not only on the
module named in the path: an allowed module also holds everything it imported."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from millwheel.errors import PermissionDeniedError
from millwheel.importing import AllowList, import_object
from millwheel.keys import KeyExtractor
from millwheel.operators import build_computation
from millwheel.spec import computation_from_dict

MOD = "tests.support.misbehaving_code"
ALLOW = AllowList.parse(MOD)


@pytest.mark.parametrize("attr,problem", [
    ("subprocess.Popen", "the class is defined in module 'subprocess', not in the allow-list"),
    ("os.system", "the function is defined in module 'posix', not in the allow-list"),
    ("system", "the function is defined in module 'posix', not in the allow-list"),  # re-exported
    ("Computation", "the class is defined in module 'millwheel.computation', not in the allow-list"),
    ("os", "it is a module, not a class or function"),
    ("os.environ", "it is a _Environ, not a class or function"),
])
def test_what_an_allowed_module_merely_imported_is_refused(attr: str, problem: str) -> None:
    path = f"{MOD}:{attr}"
    with pytest.raises(PermissionDeniedError, match=rf"^thing '{path}': {problem}: only classes and "
                                                    rf"functions defined in an allowed module may run"):
        import_object(path, what="thing", allow=ALLOW)


def test_classes_and_functions_defined_in_an_allowed_module_load() -> None:
    from tests.support import misbehaving_code as m

    assert import_object(f"{MOD}:PassThrough", allow=ALLOW) is m.PassThrough
    assert import_object(f"{MOD}:first_char_key", allow=ALLOW) is m.first_char_key
    assert import_object(f"{MOD}:PassThrough.process_record", allow=ALLOW) is m.PassThrough.process_record
    # Without an allow-list (`millwheel run`: the user's own machine) nothing is refused.
    assert import_object(f"{MOD}:os.system") is os.system


def test_builtins_and_other_callables_are_refused_even_under_star() -> None:
    star = AllowList.parse("*")
    with pytest.raises(PermissionDeniedError, match="the function is a Python builtin"):
        star.check_object(len, "x:len", "code")
    with pytest.raises(PermissionDeniedError, match="it is a partial, not a class or function"):
        star.check_object(functools.partial(os.system, "true"), "x:p", "code")
    with pytest.raises(PermissionDeniedError, match="the function names no defining module"):
        star.check_object("".join, "x:j", "code")
    star.check_object(os.system, "x:s", "code")  # '*' allows every module, posix too


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "marker"


def spec(code: str, params: dict[str, object], key: str = "key") -> object:
    return computation_from_dict({"name": "c", "inputs": [{"stream": "in", "key": key}], "outputs": ["out"],
                                  "code": {"name": code, "params": params}})


def test_a_worker_refuses_before_anything_is_called(marker: Path) -> None:
    """What a worker builds: code, a filter or map function and a key extractor."""
    cases = [spec(f"{MOD}:subprocess.Popen", {"args": ["touch", str(marker)]}),
             spec("filter", {"function": f"{MOD}:system"}),
             spec("map", {"function": f"{MOD}:os.system"}),
             spec(f"{MOD}:PassThrough", {"output": "out"}, key=f"import:{MOD}:os.getcwd")]
    for s in cases:
        with pytest.raises(PermissionDeniedError, match="not in the allow-list"):
            build_computation(s, ALLOW)  # type: ignore[arg-type]
    with pytest.raises(PermissionDeniedError, match="'posix', not in the allow-list"):
        KeyExtractor(f"import:{MOD}:os.getcwd").compile(ALLOW)
    assert not marker.exists()
    build_computation(spec(f"{MOD}:PassThrough", {"output": "out"},  # type: ignore[arg-type]
                           key=f"import:{MOD}:first_char_key"), ALLOW)
    assert "subprocess" in sys.modules  # imported (the module is allowed), never called
