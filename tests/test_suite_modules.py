"""The suite is generated from the check registry: every registered check is collected."""

import importlib
import pkgutil

import conformance.suite
from conformance.checks.registry import checks

MODULES = {
    info.name: importlib.import_module(f"conformance.suite.{info.name}")
    for info in pkgutil.iter_modules(conformance.suite.__path__)
    if info.name.startswith("test_")
}


def test_every_registered_check_has_its_suite_module():
    missing = {c.name: c.suite_module for c in checks().values() if c.suite_module not in MODULES}
    assert not missing, f"checks filed under suite modules that do not exist: {missing}"


def test_each_suite_module_collects_exactly_its_checks():
    for name, module in MODULES.items():
        collected = sorted(k.removeprefix("test_") for k in vars(module) if k.startswith("test"))
        filed = sorted(check.name for check in checks().values() if check.suite_module == name)
        assert collected == filed, f"{name} collects {collected}, the registry files {filed}"
        assert filed or name == "test_zoo", f"{name} holds no check"


def test_a_generated_test_is_located_in_its_suite_module():
    test = MODULES["test_decode"].test_decode
    assert test.__code__.co_filename == MODULES["test_decode"].__file__
