"""A real store whose ``report_watermark`` of one key range blocks until released: a
Redis shard that is away, as the controller's lock tests inject it (the store
underneath is real, only the block is added)."""

from __future__ import annotations

import threading
from typing import Any


class BlockingStore:
    """The real store; ``report_watermark`` of ``blocked`` waits for ``release``."""

    def __init__(self, store: Any, blocked: tuple[str, int]) -> None:
        self._store = store
        self.blocked = blocked
        self.entered = threading.Event()
        self.release = threading.Event()

    def report_watermark(self, node: str, range_id: int, token: int, watermark: int) -> int:
        if (node, range_id) == self.blocked:
            self.entered.set()
            self.release.wait(60)
        return int(self._store.report_watermark(node, range_id, token, watermark))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
