"""docs/api.md is generated from the proto and must say what the proto says; and the
proto documents every element, since a stranger with only reflection (grpcurl,
Postman) sees nothing else."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def gen_api_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_doc_is_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_api_docs.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_service_rpc_message_and_field_has_a_comment() -> None:
    gen = gen_api_docs()
    assert gen.undocumented(gen.descriptor_set()) == []


def test_comments_with_table_syntax_do_not_break_the_page() -> None:
    """A ``|`` in a field's comment must not end its table cell, nor ``<name>`` vanish
    as an HTML tag."""
    gen = gen_api_docs()
    fds = gen.descriptor_set()
    fdp = fds.file[0]
    msg = fdp.message_type[0]
    loc = fdp.source_code_info.location.add()
    loc.path.extend([4, 0, 2, 0])  # the first field of the first message
    loc.leading_comments = " either a | b, default \"<computation>.x\"\n"
    for old in list(fdp.source_code_info.location)[:-1]:  # only the new comment for that field
        if list(old.path) == [4, 0, 2, 0]:
            old.leading_comments = old.trailing_comments = ""
    page = gen.render(fds)
    row = next(line for line in page.splitlines() if line.startswith(f"| `{msg.field[0].name}` |"))
    assert row.endswith('| either a \\| b, default "&lt;computation>.x" |'), row
    assert row.replace("\\|", "").count("|") == 5  # four cells, no more
