"""The toy zoo written in the second edition plans and configures exactly as the first.

``toyzoo.second_edition`` declares, as typed features, what ``toyzoo.families`` declares
with ``Capabilities`` flags and hooks. For every built-in check at every tier, the suite
plans the same test ids for both, skipped for the same reasons and expected to fail for
the same ones; each feature, read from either, gives the same configs; and only the
first edition is told to respell.
"""

import pytest

from conformance.checks.registry import BUILTIN
from conformance.contract import declared, first_edition_features, layouts, preferred_layout
from conformance.contract.declared import FIRST_EDITION
from conformance.core.roots import Goldens
from conformance.core.sharding import parse_mesh
from conformance.families import AuxLosses, Decode, Dropout, Qwix, Remat
from conformance.pytest_plugin.options import DEFAULT_MESHES
from conformance.pytest_plugin.plan import plan, skip_reason
from conformance.pytest_plugin.session import Settings
from conformance.pytest_plugin.tiers import get_tier
from conformance.runtime.layouts import stacking
from tests.contract.toyzoo import families as first
from tests.contract.toyzoo import second_edition as second

PAIRS = [
    (first.ToyFull(), second.ToyFull()),
    (first.ToyLm(), second.ToyLm()),
    (first.ToyMoe(), second.ToyMoe()),
]
IDS = [one.name for one, _ in PAIRS]


def _planned(family, tier):
    meshes = tuple(parse_mesh(mesh) for mesh in DEFAULT_MESHES)
    run = Settings((family,), meshes, (parse_mesh("4x8x8"),), get_tier(tier), "low", Goldens(None))
    found = {}
    for name, check in sorted(BUILTIN.items()):
        for planned in plan(check, family, run):
            expected = planned.expected()
            reason = None if expected is None else expected.reason
            found[f"{name}/{planned.id}"] = (skip_reason(planned), reason)
    return found


@pytest.mark.parametrize("tier", ["smoke", "default", "full"])
@pytest.mark.parametrize(("old", "new"), PAIRS, ids=IDS)
def test_both_editions_plan_the_same_tests_skips_and_expected_failures(old, new, tier):
    planned = _planned(new, tier)
    assert planned == _planned(old, tier)
    assert any(skip is None for skip, _ in planned.values())


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=IDS)
def test_each_feature_gives_the_same_configs_from_either_edition(old, new):
    config = old.config(old.device_size, scan_layers=preferred_layout(old))
    for kind in FIRST_EDITION:
        assert (declared(old, kind) is None) == (declared(new, kind) is None), kind
    calls = {Remat: (), Dropout: (0.1,)}
    for kind, args in calls.items():
        if declared(old, kind) is not None:
            assert declared(old, kind).config(config, *args) == declared(new, kind).config(
                config, *args
            )
    if (decode := declared(old, Decode)) is not None:
        again = declared(new, Decode)
        assert (decode.style, decode.cache) == (again.style, again.cache)
        assert decode.config is None or decode.config(config) == again.config(config)
    if (qwix := declared(old, Qwix)) is not None:
        assert qwix.modes == declared(new, Qwix).modes
    if (losses := declared(old, AuxLosses)) is not None:
        assert losses == declared(new, AuxLosses)
    if set(layouts(old)) == {False, True}:
        loop, scan = (old.config(old.device_size, scan_layers=s) for s in (False, True))
        assert stacking(old, loop, scan) == stacking(new, loop, scan)
        assert stacking(new, loop, scan).params


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=IDS)
def test_only_the_first_edition_is_told_to_respell(old, new):
    assert first_edition_features(old)
    assert first_edition_features(new) == []
