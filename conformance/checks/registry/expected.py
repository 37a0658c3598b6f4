"""Why a test of a check is expected to fail: a known library failure or a declared divergence."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from conformance.checks.declare import Check
from conformance.contract import Family
from conformance.core.failure import CheckFailure


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    """Why a test is expected to fail: a strict xfail, optionally of one exception type."""

    reason: str
    raises: type[BaseException] | None = None


def expected_failure(
    check: Check, family: Family, values: Mapping[str, Any], case_id: str
) -> ExpectedFailure | None:
    """Why ``check`` fails on this case: a known library failure or a family's divergence.

    A known library failure must fail as a check failure; a divergence a family declares
    (``Family.known_divergences``, keyed ``check`` or ``check[id fragment]``) may fail
    any way, since it is the family's finding.
    """
    if check.known_failure is not None and (reason := check.known_failure(values)):
        return ExpectedFailure(reason, CheckFailure)
    for key, reason in family.known_divergences.items():
        name, _, fragment = key.partition("[")
        if name == check.name and fragment.removesuffix("]") in case_id:
            return ExpectedFailure(f"{family.name} known divergence: {reason}")
    return None
