"""Every check of the suite in one table, collected from what each area module declares.

The table drives the suite: the pytest plugin parametrizes each suite test from its
:class:`Check` (axes, parameters, capability, layouts, quantization method), marks the
expected failures through :func:`expected_failure` (the one mechanism for them), keeps
goldens for the checks that have them and labels the matrix and the reports by check
name. The planted-fault runner calls checks through it too. A check is called with a
:class:`~conformance.runtime.case.Case` and its own parameters, and every failure it
raises is headed ``<family> <check>:``.
"""

from conformance.checks.declare import AXES, Axis, Check, Param, Where, declare
from conformance.checks.registry.expected import ExpectedFailure, expected_failure
from conformance.checks.registry.lookup import UnknownCheck, case_of, get, mesh_of
from conformance.checks.registry.table import BUILTIN
from conformance.checks.registry.zoo import CHECK_ENTRY_POINT_GROUP, checks, installed

__all__ = [
    "AXES",
    "Axis",
    "BUILTIN",
    "CHECK_ENTRY_POINT_GROUP",
    "Check",
    "ExpectedFailure",
    "Param",
    "UnknownCheck",
    "Where",
    "case_of",
    "checks",
    "declare",
    "expected_failure",
    "get",
    "installed",
    "mesh_of",
]
