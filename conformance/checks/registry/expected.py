"""Why a test of a check is expected to fail: a known library failure or a declared divergence."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from conformance.checks.declare import Check
from conformance.contract import Family, divergences
from conformance.core.failure import CheckFailure, KnownFailure


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    """Why a test is expected to fail: a strict xfail, optionally of one exception type.

    ``shows``, if set, is a regular expression the failure's message must contain
    (:attr:`~conformance.contract.Divergence.shows`,
    :attr:`~conformance.core.failure.KnownFailure.shows`).
    """

    reason: str
    raises: type[BaseException] | None = None
    shows: str | None = None

    def unshown(self, failure: str) -> str | None:
        """Why ``failure`` (an exception's ``Type: message``) is not this one, or ``None``.

        Every failure is the expected one unless ``shows`` asks for words it lacks.
        """
        if self.shows is None or re.search(self.shows, failure, re.DOTALL):
            return None
        return (
            f"expected to fail ({self.reason}) with a message showing {self.shows!r}, "
            f"it failed otherwise: {failure}"
        )


def expected_failure(
    check: Check,
    family: Family,
    values: Mapping[str, Any],
    case_id: str,
    parts: Mapping[str, str] = MappingProxyType({}),
) -> ExpectedFailure | None:
    """Why ``check`` fails on this case: a known library failure or a family's divergence.

    ``values`` and ``parts`` (each axis's and parameter's value and test-id part) select
    the family's divergences (:class:`~conformance.contract.Divergence`); a first-edition key
    (``check`` or ``check[id fragment]``) matches ``case_id``. A known library failure
    must fail as a check failure, showing its words if it has them
    (:class:`~conformance.core.failure.KnownFailure`); a divergence a family declares
    may fail any way its words allow, since it is the family's finding. The family's
    finding comes first: where both select a test, the test is expected to fail as the
    family says.
    """
    typed, first_edition = divergences(family.known_divergences)
    for divergence in typed:
        if divergence.selects(check.name, parts, values):
            reason = f"{family.name} known divergence: {divergence.reason}"
            return ExpectedFailure(reason, shows=divergence.shows)
    for key in first_edition:
        if key.marks(check.name, case_id):
            return ExpectedFailure(f"{family.name} known divergence: {key.reason}")
    return _library_failure(check, values)


def _library_failure(check: Check, values: Mapping[str, Any]) -> ExpectedFailure | None:
    """The check's known failure with the pinned libraries on a case of these ``values``.

    A check may state it as a :class:`~conformance.core.failure.KnownFailure` (a reason
    and the words its report shows) or as a reason alone.
    """
    known = check.known_failure(values) if check.known_failure is not None else None
    if not known:
        return None
    if isinstance(known, KnownFailure):
        return ExpectedFailure(known.reason, CheckFailure, known.shows)
    return ExpectedFailure(known, CheckFailure)
