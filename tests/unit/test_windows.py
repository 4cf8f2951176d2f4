import pytest

from millwheel.errors import InvalidSpecError
from millwheel.windows import Windowing


def test_tumbling_windows_assign_one_window() -> None:
    w = Windowing(10)
    assert w.assign(0) == [0]
    assert w.assign(9) == [0]
    assert w.assign(10) == [10]
    assert w.assign(-1) == [-10]


def test_sliding_windows_assign_every_window_containing_the_timestamp() -> None:
    w = Windowing(30, 10)
    assert w.assign(25) == [0, 10, 20]
    assert w.assign(30) == [10, 20, 30]
    assert all(s <= 25 < s + 30 for s in w.assign(25))


@pytest.mark.parametrize("size,period", [(0, None), (-5, None), (10, 0), (10, 11)])
def test_bad_windows_are_rejected_with_the_value(size: int, period: int | None) -> None:
    with pytest.raises(InvalidSpecError, match="window"):
        Windowing(size, period)
