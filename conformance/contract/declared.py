"""What a family declares, read the same way from either edition of the contract.

The harness asks :func:`declared` for a feature's value and :func:`supports` whether a
family has an ability by name; neither cares whether the family wrote a typed
:class:`~conformance.contract.features.Feature` or the first edition's
:class:`~conformance.contract.Capabilities` flag and hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conformance.contract.family import Family
from conformance.contract.features import Decode, Feature


def _first_edition_decode(family: Family) -> Decode | None:
    """``Capabilities(decode=True, decode_style=...)`` and ``decode_config``, as a Decode."""
    caps = family.capabilities
    if not caps.decode:
        return None
    token = caps.decode_style == "token"
    return Decode(style=caps.decode_style, config=family.decode_config if token else None)


FIRST_EDITION: dict[type[Feature], Callable[[Family], Any]] = {Decode: _first_edition_decode}
"""Each feature's first-edition spelling, read into the feature's value."""


def declared[F: Feature](family: Family, kind: type[F]) -> F | None:
    """``family``'s feature of type ``kind``, however spelt; ``None`` if it lacks it."""
    for feature in family.features():
        if isinstance(feature, kind):
            return feature
    first = FIRST_EDITION.get(kind)
    return None if first is None else first(family)


def supports(family: Family, capability: str) -> bool:
    """Whether ``family`` has the ability named ``capability``, by feature or by flag."""
    for feature in family.features():
        if feature.capability == capability:
            return True
    return bool(getattr(family.capabilities, capability, False))
