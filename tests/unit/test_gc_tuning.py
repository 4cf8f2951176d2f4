"""The local runner relaxes CPython's young-generation collections, never tightens them,
and leaves a disabled collector (threshold 0) alone."""

import gc

from millwheel.runtime.local_runner import YOUNG_GC_THRESHOLD, relax_young_gc


def test_relax_young_gc_only_raises_the_threshold() -> None:
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        relax_young_gc()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, 10, 10)
        gc.set_threshold(10 * YOUNG_GC_THRESHOLD, 3, 4)
        relax_young_gc()
        assert gc.get_threshold() == (10 * YOUNG_GC_THRESHOLD, 3, 4)
        gc.set_threshold(0)
        relax_young_gc()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*saved)
