"""The Family contract: selection by glob, availability, known divergences."""

import importlib.metadata
from types import MappingProxyType

import pytest

from conformance import families
from conformance.checks import registry
from conformance.core.failure import CheckFailure
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.maxtext.family import MAXTEXT_VERSION, MaxTextFamily

MAXTEXT = ["maxtext-deepseek3", "maxtext-gemma2", "maxtext-gpt3", "maxtext-llama2"]


def test_a_glob_selects_every_matching_family_once_in_order():
    chosen = families.select(["maxtext-*", "gpt3", "maxtext-gpt3"])
    assert [f.name for f in chosen] == [*MAXTEXT, "gpt3"]


def test_a_glob_matching_nothing_lists_the_known_families():
    with pytest.raises(families.FamilyError, match=r"no family matches 'mistral-\*'; known.*gpt3"):
        families.select(["mistral-*"])


def test_no_pattern_selects_every_family():
    assert [f.name for f in families.select([])] == list(families.registry())


def _version(found):
    """``importlib.metadata.version`` answering ``found`` for maxtext (None: not installed)."""
    real = importlib.metadata.version

    def version(name):
        if name != "maxtext":
            return real(name)
        if found is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found

    return version


@pytest.mark.parametrize(
    ("installed", "reason"),
    [
        (None, "maxtext is not installed (pip install -e '.[maxtext]')"),
        ("0.2.5", f"maxtext 0.2.5 is installed; the adapter needs {MAXTEXT_VERSION}"),
        (MAXTEXT_VERSION, None),
    ],
)
def test_maxtext_families_say_in_one_line_why_they_cannot_run(monkeypatch, installed, reason):
    monkeypatch.setattr(importlib.metadata, "version", _version(installed))
    for name in MAXTEXT:
        family = families.get(name)
        assert isinstance(family, MaxTextFamily)
        assert family.unavailable() == reason


def test_an_unavailable_family_skips_every_test_with_its_reason(pytester, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _version(None))
    pytester.makepyfile("def test_anything(family, scan_layers):\n    raise AssertionError\n")
    result = pytester.runpytest("--conformance-family", "maxtext-gpt3", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*SKIPPED [[]2[]]*maxtext-gpt3: maxtext is not installed*"])


class Diverging(Gpt3Family):
    known_divergences = MappingProxyType(
        {"layout[remat]": "remat changes rounding", "hygiene": "keeps a counter"}
    )


@pytest.mark.parametrize(
    ("check", "case", "expected"),
    [
        ("layout", "gpt3-fsdp8-remat", "gpt3 known divergence: remat changes rounding"),
        ("layout", "gpt3-fsdp8-scan_layers", None),
        ("hygiene", "gpt3-fsdp8-loop", "gpt3 known divergence: keeps a counter"),
        ("train_step", "gpt3-fsdp8-loop", None),
    ],
)
def test_a_known_divergence_names_a_check_and_optionally_a_case(check, case, expected):
    found = registry.expected_failure(registry.get(check), Diverging(), {}, case)
    assert (found and found.reason) == expected
    assert found is None or found.raises is None, "a family's finding may fail any way"


def test_a_known_library_failure_must_fail_as_a_check_failure():
    values = {"quant": "ptq_int8", "scan_layers": True}
    found = registry.expected_failure(registry.get("quant_forward"), Gpt3Family(), values, "x")
    assert found is not None
    assert "qwix 0.1.8" in found.reason
    assert found.raises is CheckFailure
