"""services/memory.py: freed heap memory goes back to the system; the settings are
checked. (What the trimming does for a worker's RSS over a long run is measured by
bench/cases/soak.py, never asserted here.)"""

from __future__ import annotations

import ctypes
import sys

import pytest

from services import memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim, /proc")
def test_malloc_trim_gives_back_what_malloc_keeps_after_free() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4000) for _ in range(20_000)]  # ~80 MB of heap, below mmap's threshold
    for b in blocks:
        ctypes.memset(b, 1, 4000)
    for i, b in enumerate(blocks):
        if i % 50:  # every 50th stays: the heap cannot shrink from its top
            libc.free(b)
    kept = memory.rss_mb()["RssAnon"]
    assert memory.malloc_trim()
    after = memory.rss_mb()["RssAnon"]
    for b in blocks[::50]:
        libc.free(b)
    assert kept - after > 50, (kept, after)  # ~76 MB of free pages given back


def test_trim_and_trace_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ENV_TRIM, raising=False)
    assert memory._seconds(memory.ENV_TRIM, memory.TRIM_S) == 60.0
    monkeypatch.setenv(memory.ENV_TRIM, "0")
    assert memory._seconds(memory.ENV_TRIM, memory.TRIM_S) == 0.0
    assert memory.start_trimmer(0.0) is None  # 0: off, no thread
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv(memory.ENV_TRIM, bad)
        with pytest.raises(ValueError, match=memory.ENV_TRIM):
            memory._seconds(memory.ENV_TRIM, memory.TRIM_S)
    monkeypatch.setenv(memory.ENV_EVERY, "60")
    monkeypatch.setenv(memory.ENV_ROLES, "controller")
    assert memory.start_tracing("worker") is None  # another role traces; this one does not
