"""A zoo's own checks register through entry points, and a broken one is named, not run."""

import dataclasses
import sys
from importlib.metadata import EntryPoint

from conformance.checks.declare import ZOO_SUITE, Axis, checks_of, declare, declared, unfit
from conformance.checks.registry import BUILTIN, CHECK_ENTRY_POINT_GROUP, Check
from conformance.checks.registry.zoo import zoo_checks
from conformance.checks.structure import check_structure

GOOD = Check("zoo_structure", check_structure, ("family", "size", "scan_layers"), where="none")
UNORDERED = dataclasses.replace(GOOD, name="unordered", axes=("scan_layers", "family"))
UNKNOWN_AXIS = dataclasses.replace(GOOD, name="unknown_axis", axes=("family", "colour"))
CLASH = dataclasses.replace(GOOD, name="forward")
TWICE = dataclasses.replace(GOOD, name="twice", axes=("family", "family"))
NO_FAMILY = dataclasses.replace(GOOD, name="no_family", axes=("size",))
NO_MESH = dataclasses.replace(GOOD, name="no_mesh", where="each")
GIVEN = dataclasses.replace(GOOD, name="given", given=("dtype",))


@declare((Axis.FAMILY, Axis.SIZE, Axis.SCAN_LAYERS), where="none")
@declare((Axis.FAMILY,), name="zoo_twin", where="none", pair=False)
def check_zoo_declared(case):
    """Declared twice: as ``zoo_declared`` and as ``zoo_twin``."""


def _entry(name: str, attribute: str) -> EntryPoint:
    return EntryPoint(name, f"{__name__}:{attribute}", CHECK_ENTRY_POINT_GROUP)


def test_a_zoo_check_registers_under_the_zoo_suite():
    checks, problems = zoo_checks(BUILTIN, [_entry("zoo_structure", "GOOD")])
    assert not problems
    assert checks["zoo_structure"].suite_module == f"test_{ZOO_SUITE}"
    assert checks["zoo_structure"].run is check_structure


def test_each_broken_entry_point_is_one_line_naming_it():
    entries = [
        _entry("not_a_check", "_entry"),
        _entry("renamed", "GOOD"),
        _entry("forward", "CLASH"),
        _entry("unordered", "UNORDERED"),
        _entry("unknown_axis", "UNKNOWN_AXIS"),
        _entry("missing", "NOT_THERE"),
        _entry("twice", "TWICE"),
        _entry("no_family", "NO_FAMILY"),
        _entry("no_mesh", "NO_MESH"),
        _entry("given", "GIVEN"),
    ]
    checks, problems = zoo_checks(BUILTIN, entries)
    assert not checks
    text = "\n".join(problems)
    assert len(problems) == len(entries), text
    assert f"'not_a_check' = '{__name__}:_entry' gave function, not a" in text
    assert "gave the check 'zoo_structure': name the entry point after its check" in text
    assert "a check called 'forward' is already registered" in text
    assert "axes ['scan_layers', 'family'] are not each once in test-id order" in text
    assert "axes ['family', 'family'] are not each once in test-id order" in text
    assert f"'no_family' = '{__name__}:NO_FAMILY': its axes must start with 'family'" in text
    assert "a check run where='each' needs the axis 'mesh'" in text
    assert "given axes ['dtype'] are not among its axes" in text
    assert "unknown axes ['colour']" in text
    assert f"'missing' = '{__name__}:NOT_THERE' fails to load: AttributeError" in text


def test_two_zoos_cannot_register_one_name():
    entries = [_entry("zoo_structure", "GOOD"), _entry("zoo_structure", "GOOD")]
    checks, problems = zoo_checks(BUILTIN, entries)
    assert list(checks) == ["zoo_structure"]
    assert problems == (
        f"check entry point 'zoo_structure' = '{__name__}:GOOD': a check called "
        "'zoo_structure' is already registered",
    )


def test_declare_returns_the_function_and_names_each_check_in_source_order():
    first, second = checks_of(check_zoo_declared)
    assert (first.name, second.name) == ("zoo_declared", "zoo_twin")
    assert first.run is second.run is check_zoo_declared
    assert (first.axes, second.pair) == ((Axis.FAMILY, Axis.SIZE, Axis.SCAN_LAYERS), False)
    assert declared(sys.modules[__name__]) == (first, second)


def test_an_entry_point_names_a_declared_function_by_its_check():
    entries = [_entry("zoo_twin", "check_zoo_declared"), _entry("other", "check_zoo_declared")]
    checks, problems = zoo_checks(BUILTIN, entries)
    assert list(checks) == ["zoo_twin"]
    assert checks["zoo_twin"].pair is False
    assert problems == (
        f"check entry point 'other' = '{__name__}:check_zoo_declared' gave the check "
        "'zoo_declared', 'zoo_twin': name the entry point after its check",
    )


def test_every_built_in_check_is_held_to_the_rules_a_zoo_check_is():
    assert {name: unfit(check) for name, check in BUILTIN.items() if unfit(check)} == {}
