"""What a family declares, read the same way from either edition of the contract.

The harness asks :func:`declared` (or :func:`required`) for a feature's value and
:func:`supports` whether a family has an ability by name; none of them cares whether the
family wrote a typed :class:`~conformance.contract.features.Feature` or the first
edition's :class:`~conformance.contract.Capabilities` flag and hook.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from conformance.contract.family import Family
from conformance.contract.features import Aqt, Decode, Dropout, Feature, Fp8, Remat, VocabTiling
from conformance.contract.values import FamilyError


def _first_edition_decode(family: Family) -> Decode | None:
    """``Capabilities(decode=True, decode_style=...)`` and ``decode_config``, as a Decode."""
    caps = family.capabilities
    if not caps.decode:
        return None
    token = caps.decode_style == "token"
    return Decode(style=caps.decode_style, config=family.decode_config if token else None)


def _flagged[F: Feature](kind: type[F], hook: Callable[[Family], Any]) -> Callable[[Family], Any]:
    """A feature whose first edition is a ``Capabilities`` flag and a hook of ``family``."""

    def read(family: Family) -> F | None:
        if not getattr(family.capabilities, kind.capability):
            return None
        return kind(hook(family))  # type: ignore[call-arg]

    return read


FIRST_EDITION: dict[type[Feature], Callable[[Family], Any]] = {
    Decode: _first_edition_decode,
    Remat: _flagged(Remat, lambda family: functools.partial(family.variant, remat=True)),
    Dropout: _flagged(Dropout, lambda family: lambda c, rate: family.variant(c, dropout=rate)),
    Aqt: _flagged(Aqt, lambda family: family.aqt_config),
    Fp8: _flagged(Fp8, lambda family: family.fp8_config),
    VocabTiling: _flagged(VocabTiling, lambda family: family.vocab_tiling_config),
}
"""Each feature's first-edition spelling, read into the feature's value."""


def declared[F: Feature](family: Family, kind: type[F]) -> F | None:
    """``family``'s feature of type ``kind``, however spelt; ``None`` if it lacks it."""
    for feature in family.features():
        if isinstance(feature, kind):
            return feature
    first = FIRST_EDITION.get(kind)
    return None if first is None else first(family)


def required[F: Feature](family: Family, kind: type[F]) -> F:
    """``family``'s feature of type ``kind``; :class:`FamilyError` if it lacks it."""
    found = declared(family, kind)
    if found is None:
        raise FamilyError(f"{family.name} does not declare {kind.__name__} ({kind.capability})")
    return found


def supports(family: Family, capability: str) -> bool:
    """Whether ``family`` has the ability named ``capability``, by feature or by flag."""
    for feature in family.features():
        if feature.capability == capability:
            return True
    return bool(getattr(family.capabilities, capability, False))
