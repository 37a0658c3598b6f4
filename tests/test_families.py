"""The Family contract: selection by glob, availability, known divergences, validation."""

import dataclasses
import importlib.metadata
import sys
import types
from types import MappingProxyType, SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from conformance import families
from conformance.checks import registry
from conformance.checks.declare import Axis, Check
from conformance.contract import (
    Backend,
    accepted_precision,
    aux_losses,
    declared,
    discovery,
    first_edition_features,
    persistent_types,
    problems,
    production_topologies,
    quantization_scope,
    release,
    required,
    supports,
    validate,
    vocab_tiles,
)
from conformance.core.failure import CheckFailure
from conformance.core.roots import Goldens
from conformance.core.sharding import explicit, parse_mesh
from conformance.families import (
    Aqt,
    AuxLosses,
    Bridges,
    Capabilities,
    Decode,
    Divergence,
    Dropout,
    Family,
    FamilyError,
    FirstEditionWarning,
    Fp8,
    Layouts,
    PersistentState,
    Precision,
    PrecisionChange,
    Qwix,
    Recorded,
    Release,
    Remat,
    Topologies,
    VocabTiling,
    with_features,
)
from conformance.pytest_plugin.divergences import divergence_problems, first_edition_spellings
from conformance.pytest_plugin.plan import Planned, plan
from conformance.pytest_plugin.session import Settings
from conformance.pytest_plugin.suite import _refuse_unknown_divergences, _warn_first_edition
from conformance.pytest_plugin.tiers import get_tier
from conformance.runtime.layouts import stacking
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.maxtext import config as maxtext_config
from conformance_models.maxtext import releases
from conformance_models.maxtext.family import MaxTextFamily
from conformance_models.moe.family import MoeFamily
from tests.contract.toyzoo.families import ToyLm
from tests.faults.quantization import QuantizesOnlyFirstNnxBlock

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
    own = Check(name="own_test", run=None, axes=(Axis.FAMILY,))
    tests = [Planned(own, Misspelt(), "gpt3", {"family": Misspelt()}, {})]
    found = divergence_problems(Misspelt(), run, {"own_test": tests})
    assert found == [
        "family 'gpt3' declares a known divergence 'layuot[remat]' of 'layuot', which is no "
        "check; did you mean 'layout'?",
        "family 'gpt3' declares a known divergence 'layout[rematt]', but no test of layout "
        "has 'rematt' in its id (e.g. 'gpt3-data2-fsdp2-tensor2-remat')",
    ]


class Typed(Gpt3Family):
    known_divergences = (
        Divergence("layout", "remat changes rounding", {"variant": "remat"}),
        Divergence("hygiene", "keeps a counter"),
        Divergence(
            "sharding_invariance",
            "partitioned",
            {"mesh": "data2-fsdp2-tensor2", "scan_layers": True, "backend": Backend.NNX},
        ),
        Divergence("quant_params", "Linen kernels stay float", {"quant": ("ptq_int8", "ptq_fp8")}),
    )


def _run(family: Family) -> Settings:
    meshes = (parse_mesh("fsdp=8"), parse_mesh("data=2,fsdp=2,tensor=2"))
    return Settings((family,), meshes, (), get_tier("full"), "low", Goldens(None))


def _marked(family: Family, check: str) -> list[str]:
    return [
        p.id
        for p in plan(registry.get(check), family, _run(family))
        if (found := p.expected()) is not None and "known divergence" in found.reason
    ]


def test_a_typed_known_divergence_marks_the_tests_its_axes_and_parameters_select():
    assert _marked(Typed(), "layout") == ["gpt3-fsdp8-remat", "gpt3-data2-fsdp2-tensor2-remat"]
    every = plan(registry.get("hygiene"), Typed(), _run(Typed()))
    assert _marked(Typed(), "hygiene") == [p.id for p in every]
    assert _marked(Typed(), "sharding_invariance") == ["gpt3-data2-fsdp2-tensor2-scan-nnx"]
    assert {i.rsplit("-", 1)[1] for i in _marked(Typed(), "quant_params")} == {
        "ptq_int8",
        "ptq_fp8",
    }
    assert len(_marked(Typed(), "quant_params")) == 8  # 2 meshes x 2 layouts x 2 modes
    assert _marked(Typed(), "train_step") == []
    assert divergence_problems(Typed(), _run(Typed())) == []


class TypedTypos(Gpt3Family):
    known_divergences = (
        Divergence("layuot", "a misspelt check"),
        Divergence("layout", "a misspelt axis", {"varaint": "remat"}),
        Divergence("layout", "a value no test has", {"variant": "rematt"}),
        Divergence("sharding_invariance", "no such layout", {"scan_layers": "none"}),
        Divergence("layout", "one option no test has", {"variant": ("remat", "x")}),
    )


def test_a_typed_known_divergence_that_selects_no_test_is_a_one_line_problem():
    found = divergence_problems(TypedTypos(), _run(TypedTypos()))
    assert found == [
        "family 'gpt3' declares a known divergence of 'layuot', which is no check; did you "
        "mean 'layout'?",
        "family 'gpt3' declares a known divergence of layout narrowed by 'varaint', no axis "
        "or parameter of it (family, mesh, variant)",
        "family 'gpt3' declares a known divergence of layout where variant is 'rematt', but no "
        "test of it on gpt3 is (its variant: remat, scan_layers)",
        "family 'gpt3' declares a known divergence of sharding_invariance where scan_layers is "
        "'none', but no test of it on gpt3 is (its scan_layers: loop, scan)",
        "family 'gpt3' declares a known divergence of layout where variant is 'x', but no test "
        "of it on gpt3 is (its variant: remat, scan_layers)",
    ], found
    assert all("\n" not in line for line in found)


def test_a_first_edition_key_is_shown_in_the_second_spelling():
    legacy = Diverging()
    assert first_edition_spellings(legacy, _run(legacy)) == [
        "'layout[remat]' -> Divergence('layout', reason, {'variant': 'remat'})",
        "'hygiene' -> Divergence('hygiene', reason)",
    ]
    assert first_edition_spellings(Typed(), _run(Typed())) == []


class PtqFragment(Gpt3Family):
    known_divergences = MappingProxyType(
        {"quant_forward[ptq]": "Linen kernels stay float", "layout[fsdp8-r]": "cuts a part"}
    )


def test_a_fragment_inside_id_parts_is_spelt_as_the_parts_it_marks():
    assert first_edition_spellings(PtqFragment(), _run(PtqFragment())) == [
        "'quant_forward[ptq]' -> Divergence('quant_forward', reason, "
        "{'quant': ('ptq_fp8', 'ptq_int8')})",
        "'layout[fsdp8-r]' -> Divergence('layout', reason, {...}  # name the axes 'fsdp8-r' cuts)",
    ]


def test_a_first_edition_family_warns_once_with_the_new_spelling_and_still_works():
    with pytest.warns(FirstEditionWarning, match=r"'layout\[remat\]' -> Divergence") as caught:
        _refuse_unknown_divergences(_run(Diverging()), [])
    assert len(caught) == 1
    found = registry.expected_failure(registry.get("hygiene"), Diverging(), {}, "gpt3-fsdp8-loop")
    assert found is not None
    assert found.reason == "gpt3 known divergence: keeps a counter"


class StringsNotDivergences(Gpt3Family):
    known_divergences = ("layout[remat]",)


def test_known_divergences_that_are_no_divergence_values_fail_at_load():
    assert problems(StringsNotDivergences()) == [
        "family 'gpt3' declares known_divergences with entries that are not "
        "Divergence(check: str, reason: str, where: Mapping, shows: str | None): "
        "['layout[remat]']"
    ]
    assert problems(Typed()) == []


def test_a_known_library_failure_must_fail_as_a_check_failure():
    values = {"quant": "ptq_int8", "scan_layers": True}
    found = registry.expected_failure(registry.get("quant_forward"), Gpt3Family(), values, "x")
    assert found is not None
    assert "qwix 0.1.8" in found.reason
    assert found.raises is CheckFailure


class FirstEdition(Gpt3Family):
    """gpt3 declaring its abilities in the first edition: ``Capabilities`` flags and hooks."""

    capabilities = dataclasses.replace(
        Gpt3Family.capabilities,
        scan_layers=(False, True),
        decode=True,
        remat=True,
        dropout=True,
        aqt=True,
        fp8=True,
        vocab_tiling=True,
        quantization=frozenset({"qat_int8", "qat_fp8", "ptq_int8", "ptq_fp8"}),
        recorded=("linen",),
    )
    expected_bridges = MappingProxyType({"linen": 0, "nnx": 0})

    def variant(self, config, *, remat=False, dropout=0.0):
        return dataclasses.replace(config, remat=remat or config.remat, dropout_rate=dropout)

    def layer_stack_rules(self, config):
        return ((r"^layers_(?P<layer>\d+)/", "layers/"),)

    def features(self):
        return ()


class NoAqtHook(FirstEdition):
    name = "no-aqt-hook"
    aqt_config = Family.aqt_config


class NoStackRules(FirstEdition):
    name = "no-stack-rules"
    layer_stack_rules = Family.layer_stack_rules


class NoCanonicalStackRules(Gpt3Family):
    name = "no-canonical-stack-rules"

    def features(self):
        return with_features(super().features(), Layouts((False, True)))


class LinenStackRules(Gpt3Family):
    """A second-edition family still overriding the first edition's Linen stack rules."""

    name = "linen-stack-rules"
    layer_stack_rules = FirstEdition.layer_stack_rules


class UnhashableConfig(Gpt3Family):
    name = "unhashable-config"

    def config(self, size, *, scan_layers, dtype=None):
        return {"size": size, "scan_layers": scan_layers}


class UnknownMode(FirstEdition):
    name = "unknown-mode"
    capabilities = dataclasses.replace(
        FirstEdition.capabilities, quantization=frozenset({"qat_int4"})
    )


class TokenStyleWithoutConfig(FirstEdition):
    name = "token-without-config"
    capabilities = dataclasses.replace(FirstEdition.capabilities, decode_style="token")


class DecodeConfigWithPrefill(FirstEdition):
    name = "config-with-prefill"

    def decode_config(self, config):
        return config


class CurrentWithPrefill(FirstEdition):
    name = "current-with-prefill"
    logits_predict = "current"


class UnknownStyle(FirstEdition):
    name = "unknown-style"
    capabilities = dataclasses.replace(FirstEdition.capabilities, decode_style="beam")


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
            NoCanonicalStackRules(),
            "family 'no-canonical-stack-rules' declares Layouts((False, True)) without stack=",
        ),
        (
            LinenStackRules(),
            "family 'linen-stack-rules' overrides layer_stack_rules (Linen paths), which its "
            "Layouts feature does not call: state the rules in canonical (NNX) paths",
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
        "a-layouts-feature-without-stack-rules",
        "linen-stack-rules-beside-a-layouts-feature",
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


MAXTEXT_AXES = ["data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert"]
"""MaxText mesh axes, as a fake ``pyconfig`` answers them (base.yml names more)."""


@pytest.fixture
def fake_pyconfig(monkeypatch):
    """A stand-in for maxtext 0.2.5's ``pyconfig``: keys in, the same keys out."""

    def initialize(argv, **keys):
        return SimpleNamespace(**{"mesh_axes": MAXTEXT_AXES, **keys})

    pyconfig = types.ModuleType("maxtext.configs.pyconfig")
    pyconfig.initialize = initialize
    monkeypatch.setitem(sys.modules, "maxtext", types.ModuleType("maxtext"))
    monkeypatch.setitem(sys.modules, "maxtext.configs", types.ModuleType("maxtext.configs"))
    monkeypatch.setitem(sys.modules, "maxtext.configs.pyconfig", pyconfig)
    maxtext_config._initialize.cache_clear()
    yield
    maxtext_config._initialize.cache_clear()


def test_maxtext_runs_on_explicit_axes_in_its_shard_mode_explicit(fake_pyconfig):
    """On auto axes MaxText's mesh holds every MaxText axis, in auto mode; on explicit axes
    it is the harness's mesh itself, and MaxText's ``shard_mode`` and ``mesh_axes`` follow."""
    family = families.get("maxtext-llama2")
    config = maxtext_config.MaxTextConfig.create("llama2-7b", {}, scan_layers=False)
    mesh = parse_mesh("data=2,fsdp=2,tensor=2").devices()
    on_auto = family.with_mesh(config, mesh)
    assert on_auto.mesh.axis_names == tuple(MAXTEXT_AXES)
    assert not hasattr(maxtext_config.hyperparameters(on_auto, "nnx"), "shard_mode")
    explicit_mesh = explicit(mesh)
    on_explicit = family.with_mesh(config, explicit_mesh)
    assert on_explicit.mesh is explicit_mesh
    keys = maxtext_config.hyperparameters(on_explicit, "nnx")
    assert keys.shard_mode == "explicit"
    assert keys.mesh_axes == ["data", "fsdp", "tensor"]
    assert keys.ici_tensor_parallelism == 2


def test_both_editions_give_the_same_feature_configs():
    first, second = FirstEdition(), Gpt3Family()
    config = second.config("tiny", scan_layers=False)
    assert not first.features()
    assert not second.capabilities.remat
    for kind, args in [
        (Remat, ()),
        (Dropout, (0.1,)),
        (Aqt, ("serve",)),
        (Fp8, ()),
        (VocabTiling, (4,)),
        (Decode, ()),
        (Qwix, ()),
        (Recorded, ()),
        (Bridges, ()),
        (Layouts, ()),
    ]:
        old, new = required(first, kind), required(second, kind)
        assert supports(first, kind.capability)
        assert supports(second, kind.capability)
        if kind is Qwix:
            assert old.modes == new.modes
            assert quantization_scope(first, config) == quantization_scope(second, config)
        elif kind in (Decode, Recorded, Bridges):
            assert old == new
        elif kind is Layouts:
            assert (old.scan, old.axis, old.state_axis) == (new.scan, new.axis, new.state_axis)
            loop, scan = (second.config("tiny", scan_layers=s) for s in (False, True))
            assert stacking(first, loop, scan) == stacking(second, loop, scan)
            assert len(stacking(second, loop, scan).params) > 4
        else:
            assert old.config(config, *args) == new.config(config, *args), kind


class Twice(Gpt3Family):
    name = "twice"
    capabilities = dataclasses.replace(Gpt3Family.capabilities, remat=True)

    def features(self):
        return (*super().features(), Aqt(None), Remat(lambda c: c), "fp8")


def test_features_are_checked_at_load():
    assert problems(Twice()) == [
        "family 'twice' declares remat twice, as Remat(...) in features() and as "
        "Capabilities(remat=True) with variant(config, remat=True): keep the Remat feature",
        "family 'twice' lists Aqt twice in features(); give one",
        "family 'twice' declares Aqt(config=None), which is not callable as config(config, mode)",
        "family 'twice' overrides aqt_config, which its Aqt feature does not call: give "
        "Aqt(config=self.aqt_config), or drop the override",
        "family 'twice' lists Remat twice in features(); give one",
        "family 'twice' lists 'fp8' in features(), which is no Feature (Decode, Remat, Aqt, ...)",
    ]
    bare = type("Bare", (Gpt3Family,), {"features": lambda self: ()})()
    with pytest.raises(FamilyError, match=r"gpt3 does not declare Remat \(remat\)"):
        required(bare, Remat)


def test_first_edition_abilities_warn_once_with_their_second_edition_spelling():
    assert first_edition_features(Gpt3Family()) == []
    assert first_edition_features(FirstEdition()) == [
        "Capabilities(decode=True) -> Decode()",
        "Capabilities(remat=True) with variant(config, remat=True) -> Remat(config), "
        "config(config) rematerialised",
        "Capabilities(dropout=True) with variant(config, dropout=rate) -> Dropout(config), "
        "config(config, rate) with dropout",
        "Capabilities(aqt=True) with aqt_config -> Aqt(self.aqt_config)",
        "Capabilities(fp8=True) with fp8_config -> Fp8(self.fp8_config)",
        "Capabilities(vocab_tiling=True) with vocab_tiling_config -> "
        "VocabTiling(self.vocab_tiling_config)",
        "Capabilities(quantization={'ptq_fp8', 'ptq_int8', 'qat_fp8', 'qat_int8'}) -> "
        "Qwix(frozenset({'ptq_fp8', 'ptq_int8', 'qat_fp8', 'qat_int8'}))",
        "Capabilities(recorded=('linen',)) -> Recorded(('linen',))",
        "expected_bridges={'linen': 0, 'nnx': 0} -> Bridges(linen=0, nnx=0)",
        "Capabilities(scan_layers=(False, True)) with layer_stack_rules (Linen paths) -> "
        "Layouts((False, True), stack=<the same rules in canonical (NNX) paths>)",
    ]
    assert first_edition_features(ToyLm()) == [
        "Capabilities(decode=True, decode_style='token') with decode_config -> "
        "Decode(style='token', config=self.decode_config)"
    ]
    with pytest.warns(FirstEditionWarning, match=r"-> Aqt\(self.aqt_config\)") as caught:
        _warn_first_edition(_run(FirstEdition()))
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        "family 'gpt3' declares abilities in the first edition's spelling (Capabilities flags "
        "with hooks); list them in features(): Capabilities(decode=True) -> Decode(); "
    )


class FirstEditionPersistent(Gpt3Family):
    persistent_state = (nnx.BatchStat,)


def test_persistent_state_is_imported_only_when_a_check_asks():
    calls = []

    def types():
        calls.append(1)
        return (nnx.BatchStat,)

    family = _declaring(Gpt3Family, PersistentState(types))
    assert problems(family) == []
    assert first_edition_features(family) == []
    assert not calls
    assert persistent_types(family) == (nnx.BatchStat,)
    assert calls == [1]
    assert persistent_types(Gpt3Family()) == ()
    assert persistent_types(FirstEditionPersistent()) == (nnx.BatchStat,)
    assert first_edition_features(FirstEditionPersistent()) == [
        "persistent_state=(BatchStat,) -> PersistentState(lambda: (BatchStat,))"
    ]


def test_topologies_place_production_sizes_and_are_checked_at_load():
    family = _declaring(Gpt3Family, Topologies({"6b": "v5p:8x8x4=fsdp=128,tensor=2"}))
    assert problems(family) == []
    assert production_topologies(family) == {"6b": "v5p:8x8x4=fsdp=128,tensor=2"}
    assert production_topologies(Gpt3Family()) == {}
    wrong = _declaring(Gpt3Family, Topologies({"tiny": "v5p:4x4x4", "6b": "v5p:8x8@production"}))
    assert problems(wrong) == [
        "family 'gpt3' places size 'tiny' on a TPU slice in Topologies; its production sizes: 6b",
        "family 'gpt3' places size '6b' on 'v5p:8x8@production' in Topologies; give a slice "
        "as --tpu names one, without '@production' ('v5p:8x8x8')",
    ]


class TiledAtScale(Gpt3Family):
    """gpt3 whose production workload tiles its vocabulary in 4."""

    def features(self):
        tiles = VocabTiling(self.vocab_tiling_config, lambda c: 4 if c.num_layers > 2 else 1)
        return with_features(super().features(), tiles)


def test_vocab_tiles_are_whole_logits_unless_the_family_reads_them_from_its_config():
    family = Gpt3Family()
    small, large = (family.config(size, scan_layers=True) for size in ("tiny", "6b"))
    assert vocab_tiles(family, large) == 1
    tiled = TiledAtScale()
    assert problems(tiled) == []
    assert (vocab_tiles(tiled, small), vocab_tiles(tiled, large)) == (1, 4)


def test_accepted_precision_changes_are_read_and_checked_at_load():
    change = PrecisionChange(r"layers_\d+/attn", ("exp",), "NNX's softmax runs in float32")
    family = _declaring(Gpt3Family, Precision((change,)))
    assert problems(family) == []
    assert accepted_precision(family) == (change,)
    assert accepted_precision(Gpt3Family()) == ()
    wrong = (
        PrecisionChange("layers_(", ("exp",), "an unclosed group"),
        PrecisionChange("attn", "exp", "ops as one string"),
        PrecisionChange("attn", ("exp",), ""),
    )
    found = problems(_declaring(Gpt3Family, Precision(wrong)))
    assert len(found) == 3
    assert all(line.startswith("family 'gpt3' accepts PrecisionChange(") for line in found)
    assert all(line.endswith("reason=<why>)") for line in found)


def _declaring(base, *features):
    """``base`` declaring exactly ``features``."""
    return type("Declaring", (base,), {"features": lambda self: features})()


class FirstEditionMoe(MoeFamily):
    """moe declaring its loss in the first edition, turned on by ``aux_losses_config``."""

    capabilities = Capabilities(aux_losses=("moe_lb_loss",))

    def features(self):
        return ()

    def aux_losses_config(self, config):
        return dataclasses.replace(config, lb_weight=0.01)


def test_both_editions_declare_the_same_auxiliary_losses():
    config = MoeFamily().config("tiny", scan_layers=False)
    first = FirstEditionMoe()
    assert aux_losses(first) == aux_losses(MoeFamily()) == ("moe_lb_loss",)
    assert declared(MoeFamily(), AuxLosses).config is None
    assert declared(first, AuxLosses).config(config) == first.aux_losses_config(config)
    assert aux_losses(Gpt3Family()) == ()
    assert first_edition_features(first) == [
        "Capabilities(aux_losses=('moe_lb_loss',)) with aux_losses_config -> "
        "AuxLosses(('moe_lb_loss',), self.aux_losses_config)"
    ]


NEEDS = {
    "no loss": (
        _declaring(MoeFamily, AuxLosses(())),
        ["family 'moe' declares AuxLosses(names=()); give a non-empty tuple of strings"],
    ),
    "no names, no hook": (
        _declaring(MoeFamily, AuxLosses("moe_lb_loss", config="on")),
        [
            "family 'moe' declares AuxLosses(config='on'), which is not callable as config(config)",
            "family 'moe' declares AuxLosses(names='moe_lb_loss'); give a non-empty tuple of "
            "strings",
        ],
    ),
    "an ignored aux_losses_config": (
        type("Overrides", (MoeFamily,), {"aux_losses_config": lambda self, c: c})(),
        [
            "family 'moe' overrides aux_losses_config, which its AuxLosses feature does not "
            "call: give AuxLosses(config=self.aux_losses_config), or drop the override"
        ],
    ),
    "no backend": (
        _declaring(Gpt3Family, Recorded(())),
        ["family 'gpt3' declares Recorded(backends=()); give a non-empty tuple of strings"],
    ),
    "an unknown backend, no hook": (
        _declaring(Gpt3Family, Recorded(("jax",), upgrade={})),
        [
            "family 'gpt3' declares recorded references of ['jax']; backends: linen, nnx",
            "family 'gpt3' declares Recorded(upgrade={}), which is not callable as "
            "upgrade(leaves, versions)",
        ],
    ),
    "an ignored upgrade_reference": (
        type("Overrides", (Gpt3Family,), {"upgrade_reference": lambda s, x, v: x})(),
        [
            "family 'gpt3' overrides upgrade_reference, which its Recorded feature does not "
            "call: give Recorded(upgrade=self.upgrade_reference), or drop the override"
        ],
    ),
}


@pytest.mark.parametrize(("declaring", "expected"), NEEDS.values(), ids=NEEDS)
def test_aux_losses_and_recorded_features_without_what_they_need_fail_at_load(declaring, expected):
    assert problems(declaring) == expected


class PerRelease(Gpt3Family):
    """gpt3 keeping its goldens per release, in the first edition's spelling."""

    release = "1.0"
    expected_bridges = MappingProxyType({"linen": 1, "nnx": 0})


def test_bridges_and_a_release_are_read_from_either_edition_and_checked():
    assert release(Gpt3Family()) is None
    assert problems(PerRelease()) == [
        "family 'gpt3' declares bridges twice, as Bridges(...) in features() and as "
        "expected_bridges={'linen': 1, 'nnx': 0}: keep the Bridges feature"
    ]
    first = type("First", (PerRelease,), {"features": lambda self: ()})()
    assert (release(first), declared(first, Bridges)) == ("1.0", Bridges(linen=1))
    assert first_edition_features(first) == [
        "expected_bridges={'linen': 1, 'nnx': 0} -> Bridges(linen=1, nnx=0)",
        "release='1.0' -> Release('1.0')",
    ]
    second = type("Second", (Gpt3Family,), {"features": lambda self: (Release("1.0"),)})()
    assert release(second) == "1.0"
    assert declared(second, Bridges) is None
    wrong = type("Wrong", (Gpt3Family,), {"features": lambda self: (Bridges(linen=-1),)})()
    assert problems(wrong) == ["family 'gpt3' declares Bridges(linen=-1); give a count of modules"]
    misspelt = type("Misspelt", (type(first),), {"expected_bridges": {"jax": 1}})()
    assert problems(misspelt) == [
        "family 'gpt3' declares expected_bridges for ['jax']; backends: linen, nnx"
    ]


def test_a_qwix_feature_is_checked_at_load():
    assert problems(_declaring(Gpt3Family, Qwix(frozenset()))) == [
        "family 'gpt3' declares Qwix with no mode; give at least one"
    ]
    assert problems(_declaring(Gpt3Family, Qwix(frozenset({"qat_int4"}), scope="decoder"))) == [
        "family 'gpt3' declares quantization modes ['qat_int4']; known modes: qat_int8, "
        "qat_fp8, ptq_int8, ptq_fp8",
        "family 'gpt3' declares Qwix(scope='decoder'), which is not callable as scope(config)",
    ]


class OverridesAnIgnoredHook(Gpt3Family):
    """A zoo's subclass of a second-edition family that overrides a first-edition hook."""

    name = "overrides-variant"

    def variant(self, config, *, remat=False, dropout=0.0):
        return config


def test_an_override_the_features_do_not_call_fails_at_load():
    assert problems(OverridesAnIgnoredHook()) == [
        "family 'overrides-variant' overrides variant, which its Remat feature does not call: "
        "give Remat(config=self.variant), or drop the override",
        "family 'overrides-variant' overrides variant, which its Dropout feature does not "
        "call: give Dropout(config=self.variant), or drop the override",
    ]
    assert not problems(QuantizesOnlyFirstNnxBlock())
