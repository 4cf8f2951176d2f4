"""User code that leaves a trace when imported: it writes ``$MILLWHEEL_PROOF_FILE``.

The security tests name it in specs to prove which processes import user code (the
controller never; a worker only when its ``--allow-code`` allows this module)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_proof = os.environ.get("MILLWHEEL_PROOF_FILE")
if _proof:
    Path(_proof).write_text(f"imported by pid {os.getpid()}\n")


class Passthrough:
    """A computation that forwards every record to its first output."""

    output = ""

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        self.output = outputs[0]

    def process_record(self, ctx: Any, record: Any) -> None:
        ctx.produce(self.output, record.key, record.value, record.timestamp)

    def process_timer(self, ctx: Any, timer: Any) -> None:
        pass
