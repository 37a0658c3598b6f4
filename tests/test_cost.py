"""The budget every compiled-cost comparison holds NNX to (``cost``, ``tpu_compile``)."""

from conformance.core.cost import COLLECTIVE_FLOOR, Cost, over_budget


def _cost(**collectives):
    return Cost(1.0, 1.0, 1, 1, 1, 0, dict(collectives))


def test_collectives_may_differ_by_what_moves_under_the_floor():
    linen = _cost(**{"all-gather": (3, 10_000)})
    assert over_budget("forward", linen, _cost(**{"all-gather": (4, 10_064)}), scanned=False) == []
    extra = 10_000 + COLLECTIVE_FLOOR + 1
    problems = over_budget("forward", linen, _cost(**{"all-gather": (4, extra)}), scanned=False)
    assert problems == [
        f"forward: all-gather Linen 3 op(s) of 10,000 bytes, NNX 4 op(s) of {extra:,} bytes"
    ]
    new_kind = _cost(**{"all-gather": (3, 10_000), "all-to-all": (1, 4096)})
    assert over_budget("forward", linen, new_kind, scanned=False) == [
        "forward: all-to-all Linen 0 op(s) of 0 bytes, NNX 1 op(s) of 4,096 bytes"
    ]
