"""A declared divergence held to its words: a failure without them is a failure, not it."""

import dataclasses
import re
from types import MappingProxyType

import pytest

from conformance.checks import registry
from conformance.contract import problems
from conformance.core.failure import CheckFailure, KnownFailure
from conformance.core.roots import Goldens
from conformance.core.sharding import parse_mesh
from conformance.families import Divergence
from conformance.pytest_plugin.divergences import divergence_problems
from conformance.pytest_plugin.plan import plan
from conformance.pytest_plugin.session import Settings
from conformance.pytest_plugin.tiers import get_tier
from conformance_models.gpt3.family import Gpt3Family

OWN_TESTS = """
def test_shown(family):
    raise TypeError("the head's gradient is replicated")


def test_other_words(family):
    raise TypeError("'NoneType' object has no attribute 'path'")


def test_any_words(family):
    raise KeyError("anything")
"""


class Worded(Gpt3Family):
    known_divergences = (
        Divergence("shown", "the finding", shows=r"gradient is replicated"),
        Divergence("other_words", "the finding", shows=r"gradient is replicated"),
        Divergence("any_words", "a finding declared without its words"),
    )


def test_an_expected_failure_with_its_words_is_the_finding_and_otherwise_says_why():
    expected = registry.ExpectedFailure("gpt3 known divergence: x", shows=r"replicated \[")
    assert expected.unshown("CheckFailure: head replicated [None, None]") is None
    assert expected.unshown("TypeError: no") == (
        "expected to fail (gpt3 known divergence: x) with a message showing 'replicated \\\\[', "
        "it failed otherwise: TypeError: no"
    )
    assert registry.ExpectedFailure("any").unshown("TypeError: no") is None


def test_a_divergence_carries_its_words_to_the_tests_it_marks():
    class Costly(Gpt3Family):
        known_divergences = (Divergence("hygiene", "keeps a counter", shows="counter"),)

    found = registry.expected_failure(registry.get("hygiene"), Costly(), {}, "gpt3-fsdp8-loop")
    assert found is not None
    assert found.shows == "counter"
    assert found.reason == "gpt3 known divergence: keeps a counter"


def test_words_that_are_no_regular_expression_fail_at_load():
    class Unbalanced(Gpt3Family):
        known_divergences = (Divergence("hygiene", "why", shows="replicated ["),)

    class NotWords(Gpt3Family):
        known_divergences = (Divergence("hygiene", "why", shows=3),)  # type: ignore[arg-type]

    assert problems(Unbalanced()) == [
        "family 'gpt3' declares a known divergence of hygiene that shows 'replicated [', which "
        "is no regular expression: unterminated character set at position 11"
    ]
    assert problems(NotWords()) == [
        "family 'gpt3' declares known_divergences with entries that are not Divergence(check: "
        "str, reason: str, where: Mapping, shows: str | None): "
        "[Divergence(check='hygiene', reason='why', where=mappingproxy({}), shows=3)]"
    ]


def test_a_test_failing_without_its_divergences_words_fails_saying_so(pytester, monkeypatch):
    monkeypatch.setattr(Gpt3Family, "known_divergences", Worded.known_divergences)
    pytester.makepyfile(OWN_TESTS)
    result = pytester.runpytest(
        "--conformance-family", "gpt3", "--conformance-tier", "default", "-rx"
    )
    result.assert_outcomes(xfailed=2, failed=1)
    result.stdout.fnmatch_lines_random(
        [
            "*expected to fail (gpt3 known divergence: the finding) with a message showing "
            "'gradient is replicated', it failed otherwise: TypeError: 'NoneType' object has "
            "no attribute 'path'",
            "XFAIL *test_shown* - gpt3 known divergence: the finding (failed: TypeError: the "
            "head's gradient is replicated)",
            "XFAIL *test_any_words* - gpt3 known divergence: a finding declared without its "
            "words (failed: KeyError: 'anything')",
        ]
    )


@pytest.mark.parametrize("shows", [r"gradient is replicated", r"TypeError: the head's"])
def test_words_match_anywhere_in_the_type_and_message(pytester, monkeypatch, shows):
    worded = (Divergence("shown", "the finding", shows=shows),)
    monkeypatch.setattr(Gpt3Family, "known_divergences", worded)
    pytester.makepyfile(OWN_TESTS.split("\n\n\ndef test_other_words")[0])
    result = pytester.runpytest("--conformance-family", "gpt3", "--conformance-tier", "default")
    result.assert_outcomes(xfailed=1)


def _on_both_meshes(family: Gpt3Family) -> Settings:
    meshes = (parse_mesh("fsdp=8"), parse_mesh("data=2,fsdp=2,tensor=2"))
    return Settings((family,), meshes, (), get_tier("full"), "low", Goldens(None))


class Shadowing(Gpt3Family):
    known_divergences = (
        Divergence("sharding_invariance", "scanned layers", {"scan_layers": True}),
        Divergence(
            "sharding_invariance",
            "scanned layers on three axes",
            {"scan_layers": True, "mesh": "data2-fsdp2-tensor2"},
        ),
        Divergence("layout", "remat on fsdp8", {"variant": "remat", "mesh": "fsdp8"}),
        Divergence("layout", "remat", {"variant": "remat"}),
    )


def test_a_divergence_each_of_whose_tests_an_earlier_one_marks_is_a_problem():
    """Planted: the second divergence can never mark a test, so it never holds its words."""
    found = divergence_problems(Shadowing(), _on_both_meshes(Shadowing()))
    assert found == [
        "family 'gpt3' declares a known divergence of sharding_invariance (scanned layers on "
        "three axes) that marks no test: each of the 2 it selects (e.g. "
        "'gpt3-data2-fsdp2-tensor2-scan-linen') is marked first by an earlier one (scanned "
        "layers); narrow or drop one of them"
    ]


class SharedOut(Gpt3Family):
    known_divergences = (
        Divergence("layout", "remat", {"variant": "remat"}),
        Divergence("layout", "the layer scan", {"variant": "scan_layers"}),
        Divergence("layout", "on fsdp8", {"mesh": "fsdp8"}),
    )


def test_a_divergence_whose_tests_earlier_ones_share_out_is_a_problem_naming_them():
    """Planted: two earlier divergences mark all the third's tests between them."""
    assert divergence_problems(SharedOut(), _on_both_meshes(SharedOut())) == [
        "family 'gpt3' declares a known divergence of layout (on fsdp8) that marks no test: "
        "each of the 2 it selects (e.g. 'gpt3-fsdp8-remat') is marked first by earlier ones "
        "(remat; the layer scan); narrow or drop one of them"
    ]


def test_divergences_that_overlap_but_each_mark_a_test_are_no_problem():
    """Benign: the wider one after the narrower one still marks the tests left to it."""
    assert [
        p.id
        for p in plan(registry.get("layout"), Shadowing(), _on_both_meshes(Shadowing()))
        if (expected := p.expected()) is not None and expected.reason.endswith(": remat")
    ] == ["gpt3-data2-fsdp2-tensor2-remat"]


class ShadowingFirstEdition(Gpt3Family):
    known_divergences = MappingProxyType(
        {
            "layout[remat]": "remat",
            "layout[fsdp8-remat]": "remat on fsdp8",
            "hygiene[fsdp8]": "on fsdp8",
            "hygiene": "anywhere",
        }
    )


def test_a_first_edition_key_each_of_whose_tests_an_earlier_key_marks_is_a_problem():
    """Planted: the narrower key after the wider one marks nothing, in the first edition too."""
    family = ShadowingFirstEdition()
    assert divergence_problems(family, _on_both_meshes(family)) == [
        "family 'gpt3' declares a known divergence 'layout[fsdp8-remat]' that marks no test: "
        "each of the 1 it matches (e.g. 'gpt3-fsdp8-remat') is marked first by "
        "'layout[remat]'; narrow or drop one of them"
    ]


def test_a_wider_first_edition_key_after_a_narrower_one_still_marks_the_rest():
    """Benign: ``hygiene`` after ``hygiene[fsdp8]`` marks the tests on the other mesh."""
    family = ShadowingFirstEdition()
    reasons = {
        p.id: expected.reason
        for p in plan(registry.get("hygiene"), family, _on_both_meshes(family))
        if (expected := p.expected()) is not None
    }
    assert sorted(set(reasons.values())) == [
        "gpt3 known divergence: anywhere",
        "gpt3 known divergence: on fsdp8",
    ]


def test_a_known_library_failure_holds_the_check_to_its_words():
    scanned = {"family": Gpt3Family(), "scan_layers": True}
    found = registry.expected_failure(registry.get("aqt_layout"), Gpt3Family(), scanned, "")
    assert found is not None
    assert found.raises is CheckFailure
    assert found.reason.startswith("flax 0.12.12 + aqtp 0.9.0: nnx.vmap's transform_metadata")
    other = "CheckFailure: gpt3 aqt_layout: frozen kernels: 1 difference(s)"
    assert found.unshown(other) is not None
    unnamed = "CheckFailure: gpt3 aqt_layout: frozen leaves whose sharding cannot be resolved"
    assert found.unshown(f"{unnamed}\n  NNX a/qvalue: logical names ...") is None


def test_a_family_finding_comes_before_the_library_failure_on_the_same_test():
    class Static(Gpt3Family):
        known_divergences = (Divergence("aqt_layout", "static AQT state", shows="static"),)

    scanned = {"family": Static(), "scan_layers": True}
    found = registry.expected_failure(registry.get("aqt_layout"), Static(), scanned, "")
    reason = "gpt3 known divergence: static AQT state"
    assert found == registry.ExpectedFailure(reason, None, "static")


def test_a_checks_known_failure_given_as_a_reason_alone_takes_any_check_failure():
    check = dataclasses.replace(registry.get("hygiene"), known_failure=lambda values: "why")
    found = registry.expected_failure(check, Gpt3Family(), {}, "")
    assert found == registry.ExpectedFailure("why", CheckFailure)


def test_a_known_failure_whose_words_are_no_regular_expression_is_refused_where_declared():
    with pytest.raises(re.error, match="unterminated character set"):
        KnownFailure("why", "replicated [")
