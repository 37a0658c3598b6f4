"""The Family contract: selection by glob, availability, known divergences, validation."""

import dataclasses
import importlib.metadata
import sys
import types
from types import MappingProxyType, SimpleNamespace

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from conformance import families
from conformance.checks import registry
from conformance.contract import discovery, validate
from conformance.core.failure import CheckFailure
from conformance.core.roots import Goldens
from conformance.core.sharding import parse_mesh
from conformance.families import Family
from conformance.pytest_plugin.plan import divergence_problems
from conformance.pytest_plugin.session import Settings
from conformance.pytest_plugin.tiers import get_tier
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.maxtext import config as maxtext_config
from conformance_models.maxtext import releases
from conformance_models.maxtext.family import MaxTextFamily

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


@pytest.fixture(autouse=True)
def _forget_installed():
    """The adapter caches the installed maxtext version; each test installs its own."""
    releases.installed.cache_clear()
    yield
    releases.installed.cache_clear()


@pytest.mark.parametrize(
    ("installed", "reason"),
    [
        (None, "maxtext is not installed (make setup-maxtext MAXTEXT=0.2.5, or MAXTEXT=0.2.4)"),
        ("0.2.6", "maxtext 0.2.6 is installed; the adapter supports 0.2.4, 0.2.5"),
        ("0.2.4", None),
        ("0.2.5", None),
    ],
)
def test_maxtext_families_say_in_one_line_why_they_cannot_run(monkeypatch, installed, reason):
    monkeypatch.setattr(importlib.metadata, "version", _version(installed))
    for name in MAXTEXT:
        family = families.get(name)
        assert isinstance(family, MaxTextFamily)
        assert family.unavailable() == reason


def test_a_named_family_that_cannot_run_is_a_usage_error(pytester, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _version(None))
    pytester.makepyfile("def test_anything(family, scan_layers):\n    pass\n")
    result = pytester.runpytest("--conformance-family", "maxtext-*")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*named families cannot run here*maxtext-deepseek3: maxtext is not installed*"]
    )


def test_an_unavailable_family_skips_with_its_reason_when_not_named(pytester, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _version(None))
    pytester.makepyfile("def test_anything(family):\n    pass\n")
    result = pytester.runpytest("--conformance-tier", "smoke", "-rs")
    result.assert_outcomes(passed=3, skipped=4)
    result.stdout.fnmatch_lines(["*SKIPPED [[]1[]]*maxtext-gpt3: maxtext is not installed*"])


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


class Misspelt(Gpt3Family):
    known_divergences = MappingProxyType(
        {
            "layuot[remat]": "a misspelt check",
            "layout[rematt]": "a fragment no id has",
            "hygiene[loop]": "fine",
            "own_test": "a zoo's own test",
            "tpu_compile[v5p]": "no TPU slice in this run: marks nothing, unchecked",
        }
    )


def test_a_known_divergence_that_marks_no_test_is_a_problem_naming_it():
    run = Settings(
        (Misspelt(),), (parse_mesh("fsdp=8"),), (), get_tier("full"), "low", Goldens(None)
    )
    found = divergence_problems(Misspelt(), run, {"own_test": {"gpt3-loop"}})
    assert found == [
        "family 'gpt3' declares a known divergence 'layuot[remat]' of 'layuot', which is no "
        "check; did you mean 'layout'?",
        "family 'gpt3' declares a known divergence 'layout[rematt]', but no test of layout "
        "has 'rematt' in its id (e.g. 'gpt3-data2-fsdp2-tensor2-remat')",
    ]


def test_a_known_library_failure_must_fail_as_a_check_failure():
    values = {"quant": "ptq_int8", "scan_layers": True}
    found = registry.expected_failure(registry.get("quant_forward"), Gpt3Family(), values, "x")
    assert found is not None
    assert "qwix 0.1.8" in found.reason
    assert found.raises is CheckFailure


class NoAqtHook(Gpt3Family):
    name = "no-aqt-hook"
    aqt_config = Family.aqt_config


class NoStackRules(Gpt3Family):
    name = "no-stack-rules"
    layer_stack_rules = Family.layer_stack_rules


class UnhashableConfig(Gpt3Family):
    name = "unhashable-config"

    def config(self, size, *, scan_layers, dtype=None):
        return {"size": size, "scan_layers": scan_layers}


class UnknownMode(Gpt3Family):
    name = "unknown-mode"
    capabilities = dataclasses.replace(
        Gpt3Family.capabilities, quantization=frozenset({"qat_int4"})
    )


class TokenStyleWithoutConfig(Gpt3Family):
    name = "token-without-config"
    capabilities = dataclasses.replace(Gpt3Family.capabilities, decode_style="token")


class DecodeConfigWithPrefill(Gpt3Family):
    name = "config-with-prefill"

    def decode_config(self, config):
        return config


class CurrentWithPrefill(Gpt3Family):
    name = "current-with-prefill"
    logits_predict = "current"


class UnknownStyle(Gpt3Family):
    name = "unknown-style"
    capabilities = dataclasses.replace(Gpt3Family.capabilities, decode_style="beam")


@pytest.mark.parametrize(
    ("faulty", "message"),
    [
        (
            TokenStyleWithoutConfig(),
            "family 'token-without-config' declares decode_style='token' but does not define "
            "decode_config(config)",
        ),
        (
            DecodeConfigWithPrefill(),
            "family 'config-with-prefill' defines decode_config(config) but declares "
            "decode_style='prefill'",
        ),
        (
            CurrentWithPrefill(),
            "family 'current-with-prefill' predicts the current token and decodes with a "
            "multi-token prefill",
        ),
        (UnknownStyle(), "family 'unknown-style' declares decode_style='beam'; known styles"),
        (
            NoAqtHook(),
            "family 'no-aqt-hook' declares Capabilities(aqt=True) but does not define "
            "aqt_config(config, mode)",
        ),
        (
            NoStackRules(),
            "family 'no-stack-rules' declares Capabilities(scan_layers=(False, True)) but does "
            "not define layer_stack_rules(config)",
        ),
        (
            UnhashableConfig(),
            "family 'unhashable-config': config('tiny', scan_layers=False) is not hashable",
        ),
        (UnknownMode(), "family 'unknown-mode' declares quantization modes ['qat_int4']"),
    ],
    ids=[
        "token-style-without-decode-config",
        "decode-config-with-prefill-style",
        "current-token-with-prefill",
        "unknown-decode-style",
        "capability-without-hook",
        "layouts-without-stack-rules",
        "unhashable",
        "unknown-mode",
    ],
)
def test_a_family_that_contradicts_itself_is_refused_in_one_line(faulty, message):
    with pytest.raises(families.FamilyError) as refused:
        validate(faulty)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_registry_validates_a_family_when_it_loads_it():
    entry = SimpleNamespace(name="no-aqt-hook", value="zoo:NoAqtHook", load=lambda: NoAqtHook)
    with pytest.raises(families.FamilyError, match="does not define aqt_config"):
        discovery._load(entry)


def test_every_registered_family_is_valid():
    for family in families.registry().values():
        assert validate(family) is family


def test_the_version_map_moves_the_scanned_routing_bias_layer_axis(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _version("0.2.5"))
    bias = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"
    unrolled = "decoder/moe_layers_0/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"
    kernel = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel"
    recorded = {bias: np.arange(4.0).reshape(4, 1), unrolled: np.zeros(4), kernel: np.ones((2, 4))}
    upgraded = families.get("maxtext-deepseek3").upgrade_reference(recorded, {"maxtext": "0.2.4"})
    np.testing.assert_array_equal(upgraded[bias], np.arange(4.0).reshape(1, 4))
    assert upgraded[unrolled] is recorded[unrolled]
    assert upgraded[kernel] is recorded[kernel]
    same = families.get("maxtext-gpt3").upgrade_reference(recorded, {"maxtext": "0.2.5"})
    assert same == recorded
    with pytest.raises(
        families.FamilyError, match=r"no version map from maxtext 0\.2\.3 to 0\.2\.5"
    ):
        families.get("maxtext-gpt3").upgrade_reference(recorded, {"maxtext": "0.2.3"})


def test_maxtext_configs_leave_the_persistent_compilation_cache_as_it_was(monkeypatch):
    """MaxText's ``pyconfig.initialize`` switches jax's persistent cache on (base.yml's
    ``jax_cache_dir: ~/jax_cache``) unless ``jax_cache_dir`` is empty: the adapter empties it.
    """

    def initialize(argv, **keys):  # what MaxText 0.2.4 and 0.2.5 do with the key
        if cache_dir := keys.get("jax_cache_dir", "~/jax_cache"):
            compilation_cache.set_cache_dir(cache_dir)
        return SimpleNamespace(**keys)

    pyconfig = types.ModuleType("maxtext.configs.pyconfig")
    pyconfig.initialize = initialize
    monkeypatch.setitem(sys.modules, "maxtext", types.ModuleType("maxtext"))
    monkeypatch.setitem(sys.modules, "maxtext.configs", types.ModuleType("maxtext.configs"))
    monkeypatch.setitem(sys.modules, "maxtext.configs.pyconfig", pyconfig)
    monkeypatch.setattr(importlib.metadata, "version", _version("0.2.5"))
    before = jax.config.jax_compilation_cache_dir
    maxtext_config._initialize.cache_clear()
    try:
        config = maxtext_config.MaxTextConfig.create("gpt3-52k", {}, scan_layers=True)
        maxtext_config.hyperparameters(config, "nnx")
        after = jax.config.jax_compilation_cache_dir
    finally:
        maxtext_config._initialize.cache_clear()
        jax.config.update("jax_compilation_cache_dir", before)
    assert after == before
