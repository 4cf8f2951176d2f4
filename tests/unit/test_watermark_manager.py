from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Topology
from millwheel.watermark_manager import WatermarkManager


def chain() -> Topology:
    code = CodeRef("map", {"key": "key"})
    return Topology(
        computations=(
            ComputationSpec("b", (InputSpec("s2"),), ("s3",), code),
            ComputationSpec("a", (InputSpec("s1"), InputSpec("side")), ("s2",), code),
        ),
        injectors=(InjectorSpec("main", "s1"), InjectorSpec("side", "side")),
    )


def test_input_watermark_is_min_of_upstream_and_output_is_held_by_pending_work() -> None:
    wm = WatermarkManager(chain())
    out = wm.update({"injector:main": 100, "injector:side": 70}, holds={})
    assert wm.input_watermark("a") == 70
    assert out["a"] == 70 and out["b"] == 70
    out = wm.update({"injector:main": 100, "injector:side": 200}, holds={"a": 90})
    assert wm.input_watermark("a") == 100
    assert out["a"] == 90  # pending work of a holds its output
    assert wm.input_watermark("b") == 90 and out["b"] == 90


def test_injector_pending_sends_hold_its_watermark() -> None:
    wm = WatermarkManager(chain())
    out = wm.update({"injector:main": 500, "injector:side": 500}, holds={"injector:main": 120})
    assert out["injector:main"] == 120
    assert wm.input_watermark("a") == 120


def test_watermarks_never_go_backwards() -> None:
    wm = WatermarkManager(chain())
    wm.update({"injector:main": 100, "injector:side": 100}, holds={})
    out = wm.update({"injector:main": 50, "injector:side": 100}, holds={"b": 10})
    assert out["injector:main"] == 100
    assert out["a"] == 100 and wm.input_watermark("b") == 100
    assert out["b"] == 100


def test_unknown_sources_hold_everything_back_and_finished_sources_release_it() -> None:
    wm = WatermarkManager(chain())
    out = wm.update({}, holds={})
    assert out["b"] == MIN_TIMESTAMP
    out = wm.update({"injector:main": MAX_TIMESTAMP, "injector:side": MAX_TIMESTAMP}, holds={})
    assert out["b"] == MAX_TIMESTAMP


def test_restored_watermarks_are_the_floor_after_restart() -> None:
    wm = WatermarkManager(chain(), restored={"a": 400, "b": 300})
    out = wm.update({"injector:main": 100, "injector:side": 100}, holds={"b": 50})
    assert out["a"] == 400 and out["b"] == 300


def test_order_is_upstream_first() -> None:
    order = WatermarkManager(chain()).order
    assert order.index("a") < order.index("b")
    assert order.index("injector:main") < order.index("a")
