"""grail's adaptive KL controller (grail/algo/kl_control.py)."""

from __future__ import annotations

import math

import pytest

from grail.algo.kl_control import AdaptiveKL


def _controller(value: float = 0.04) -> AdaptiveKL:
    return AdaptiveKL(value=value, target=0.1, rate=1.5, min_value=0.01, max_value=0.08)


def test_the_coefficient_moves_by_the_rate_outside_the_band_and_stays_inside() -> None:
    kl = _controller()
    assert kl.update(0.13) == pytest.approx(0.06)  # above 1.2 x target: times the rate
    assert kl.update(0.119) == pytest.approx(0.06)  # inside [0.8, 1.2] x target: unchanged
    assert kl.update(0.081) == pytest.approx(0.06)
    assert kl.update(0.05) == pytest.approx(0.04)  # below 0.8 x target: divided by the rate


def test_the_coefficient_stays_within_its_bounds() -> None:
    kl = _controller()
    for _ in range(10):
        kl.update(1.0)
    assert kl.value == 0.08
    for _ in range(10):
        kl.update(0.0)
    assert kl.value == 0.01


def test_a_non_finite_measurement_leaves_the_coefficient_alone() -> None:
    kl = _controller()
    assert kl.update(math.nan) == 0.04 and kl.update(math.inf) == 0.04


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rate": 1.0}, "rate must be > 1"),
        ({"target": 0.0}, "target must be"),
        ({"min_value": 0.1, "max_value": 0.05}, "min_value .* exceeds max_value"),
    ],
)
def test_impossible_settings_are_refused_by_name(changes: dict, match: str) -> None:
    settings = {"value": 0.04, "target": 0.1, "rate": 1.5, "min_value": 0.01, "max_value": 0.08}
    with pytest.raises(ValueError, match=match):
        AdaptiveKL(**{**settings, **changes})
