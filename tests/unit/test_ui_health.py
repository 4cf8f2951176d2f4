"""How the console classifies a computation's health (services/ui/snapshot.py), over
time: lagging once the output watermark is stuck behind the input for STUCK_S,
dead-lettering while the dead-letter count rose within the last minute, retrying
while items are being retried; worst first."""

from __future__ import annotations

from typing import Any

from services.ui.snapshot import DEAD_LETTER_WINDOW_S, STUCK_S, Snapshotter


def info(dead: int = 0, retrying: int = 0) -> dict[str, Any]:
    return {"dead_lettered": dead, "retrying": [{}] * retrying, "recent_errors": []}


def test_lagging_when_the_output_watermark_is_stuck_behind_the_input() -> None:
    s = Snapshotter(None)  # type: ignore[arg-type]  # _health reads only its own history
    assert s._health("c", info(), 100, 200, 0.0)[0] == "ok"
    assert s._health("c", info(), 100, 300, STUCK_S - 1)[0] == "ok"
    health, why = s._health("c", info(), 100, 300, STUCK_S + 1)
    assert health == "lagging" and f"{STUCK_S + 1:.0f} s" in why
    assert s._health("c", info(), 150, 300, STUCK_S + 2)[0] == "ok"  # it moved
    assert s._health("c", info(), 300, 300, 3 * STUCK_S)[0] == "ok"  # caught up: nothing waits


def test_dead_lettering_while_the_count_rises_then_ok_again() -> None:
    s = Snapshotter(None)  # type: ignore[arg-type]
    assert s._health("c", info(dead=3), 100, 100, 0.0)[0] == "ok"  # old dead letters, no fresh error
    assert s._health("c", info(dead=4), 100, 100, 10.0)[0] == "dead-lettering"
    assert s._health("c", info(dead=4), 100, 100, 10.0 + DEAD_LETTER_WINDOW_S - 1)[0] == "dead-lettering"
    assert s._health("c", info(dead=4), 100, 100, 10.0 + DEAD_LETTER_WINDOW_S + 1)[0] == "ok"


def test_retrying_ranks_below_dead_lettering_and_above_lagging() -> None:
    s = Snapshotter(None)  # type: ignore[arg-type]
    s._health("c", info(dead=1), 100, 300, 0.0)
    assert s._health("c", info(dead=2, retrying=1), 100, 300, 1.0)[0] == "dead-lettering"
    assert s._health("c", info(dead=2, retrying=1), 100, 300, STUCK_S + DEAD_LETTER_WINDOW_S)[0] == "retrying"
    assert s._health("c", info(dead=2), 100, 300, STUCK_S + DEAD_LETTER_WINDOW_S)[0] == "lagging"


def test_failing_ranges_rank_first_and_say_why() -> None:
    s = Snapshotter(None)  # type: ignore[arg-type]
    s._health("c", info(dead=1), 100, 300, 0.0)
    failing = {**info(dead=2, retrying=1), "failing_ranges": [
        {"stage": "build", "type": "RuntimeError", "message": "cannot connect"}]}
    health, why = s._health("c", failing, 100, 300, 1.0)
    assert health == "failing" and why == "1 key range(s) cannot run (build): RuntimeError: cannot connect"
    assert s._health("c", {**failing, "failing_ranges": []}, 100, 300, 2.0)[0] == "dead-lettering"
