"""What a family declares, read the same way from either edition of the contract.

The harness asks :func:`declared` (or :func:`required`) for a feature's value and
:func:`supports` whether a family has an ability by name; none of them cares whether the
family wrote a typed :class:`~conformance.contract.features.Feature` or the first
edition's :class:`~conformance.contract.Capabilities` flag and hook.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from conformance.contract.family import Family
from conformance.contract.features import (
    Aqt,
    AuxLosses,
    Bridges,
    Decode,
    Dropout,
    Feature,
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
)
from conformance.contract.values import FamilyError, QuantScope


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


@dataclasses.dataclass(frozen=True)
class _FirstEdition:
    """How a feature was spelt in the first edition: read into its value, and respelt."""

    read: Callable[[Family], Any]
    """The feature's value from the first edition's declaration, or ``None``."""
    spelt: Callable[[Family], tuple[str, str]]
    """The declaration as the family wrote it, and the same in :meth:`Family.features`."""


def _decode_spellings(family: Family) -> tuple[str, str]:
    if family.capabilities.decode_style == "token":
        old = "Capabilities(decode=True, decode_style='token') with decode_config"
        return old, "Decode(style='token', config=self.decode_config)"
    return "Capabilities(decode=True)", "Decode()"


def _first_edition_qwix(family: Family) -> Qwix | None:
    """``Capabilities(quantization={...})`` and ``quantization_scope``, as a Qwix."""
    modes = family.capabilities.quantization
    return Qwix(frozenset(modes), family.quantization_scope) if modes else None


def _qwix_spellings(family: Family) -> tuple[str, str]:
    modes = ", ".join(repr(mode) for mode in sorted(family.capabilities.quantization))
    if type(family).quantization_scope is Family.quantization_scope:
        return f"Capabilities(quantization={{{modes}}})", f"Qwix(frozenset({{{modes}}}))"
    old = f"Capabilities(quantization={{{modes}}}) with quantization_scope"
    return old, f"Qwix(frozenset({{{modes}}}), self.quantization_scope)"


def quantization_modes(family: Family) -> frozenset[str]:
    """The Qwix modes ``family`` declares (:class:`Qwix`, in either edition); maybe none."""
    found = declared(family, Qwix)
    return frozenset() if found is None else found.modes


def quantization_scope(family: Family, config: Any) -> QuantScope:
    """What ``family``'s Qwix rules target for ``config``: every ``dot_general`` by default."""
    found = declared(family, Qwix)
    return QuantScope() if found is None or found.scope is None else found.scope(config)


def _listed(kind: type[Feature], field: str, hook: str) -> _FirstEdition:
    """A feature first spelt as a ``Capabilities`` tuple ``field`` and an optional ``hook``.

    ``Capabilities(aux_losses=names)`` with ``aux_losses_config``, read as
    ``AuxLosses(names, config)``; the hook is the feature's second field, ``None`` when
    the family keeps :class:`Family`'s.
    """

    def own(family: Family) -> bool:
        return getattr(type(family), hook) is getattr(Family, hook)

    def read(family: Family) -> Any:
        values = tuple(getattr(family.capabilities, field))
        if not values:
            return None
        return kind(values, None if own(family) else getattr(family, hook))  # type: ignore[call-arg]

    def spelt(family: Family) -> tuple[str, str]:
        values = tuple(getattr(family.capabilities, field))
        old, new = f"Capabilities({field}={values!r})", f"{kind.__name__}({values!r}"
        return (old, f"{new})") if own(family) else (f"{old} with {hook}", f"{new}, self.{hook})")

    return _FirstEdition(read, spelt)


def aux_losses(family: Family) -> tuple[str, ...]:
    """The auxiliary losses ``family`` declares (:class:`AuxLosses`, either edition); maybe none."""
    found = declared(family, AuxLosses)
    return () if found is None else tuple(found.names)


def recorded_backends(family: Family) -> tuple[str, ...]:
    """The backends whose recorded reference ``family`` keeps (:class:`Recorded`); maybe none."""
    found = declared(family, Recorded)
    return () if found is None else tuple(found.backends)


def upgrade_reference(
    family: Family, leaves: Mapping[str, Any], versions: Mapping[str, str]
) -> dict[str, Any]:
    """``leaves`` of a reference recorded with ``versions``, made current by ``family``."""
    found = declared(family, Recorded)
    upgrade = None if found is None else found.upgrade
    return dict(leaves) if upgrade is None else upgrade(leaves, versions)


def _first_edition_bridges(family: Family) -> Bridges | None:
    """:attr:`Family.expected_bridges`, as a Bridges."""
    expected = family.expected_bridges
    if expected is None:
        return None
    return Bridges(linen=expected.get("linen", 0), nnx=expected.get("nnx", 0))


def _bridges_spellings(family: Family) -> tuple[str, str]:
    expected = dict(family.expected_bridges or {})
    counts = ", ".join(f"{side}={count}" for side, count in expected.items())
    return f"expected_bridges={expected!r}", f"Bridges({counts})"


def _first_edition_release(family: Family) -> Release | None:
    """:attr:`Family.release`, as a Release."""
    return None if family.release is None else Release(family.release)


def _first_edition_layouts(family: Family) -> Layouts | None:
    """``Capabilities(scan_layers=...)`` and the stack axes, as Layouts without ``stack``.

    The first edition's stack rules are in Linen paths, not the feature's canonical ones:
    the harness applies them to Linen's parameters itself (``layer_stack_rules``).
    """
    scan = tuple(family.capabilities.scan_layers)
    axes = (family.layer_stack_axis, family.state_stack_axis)
    if scan == (False,) and axes == (0, 0):
        return None
    return Layouts(scan, None, *axes)


def _layouts_spellings(family: Family) -> tuple[str, str]:
    scan = tuple(family.capabilities.scan_layers)
    both = set(scan) == {False, True}
    axes = [
        ("layer_stack_axis", "axis", family.layer_stack_axis),
        ("state_stack_axis", "state_axis", family.state_stack_axis),
    ]
    old = ["layer_stack_rules (Linen paths)"] * both + [f"{a}={v}" for a, _, v in axes if v]
    new = [repr(scan), *["stack=<the same rules in canonical (NNX) paths>"] * both]
    new += [f"{b}={v}" for _, b, v in axes if v]
    first = f"Capabilities(scan_layers={scan!r})" + (f" with {', '.join(old)}" if old else "")
    return first, f"Layouts({', '.join(new)})"


def layouts(family: Family) -> tuple[bool, ...]:
    """The layer layouts ``family`` builds (:class:`Layouts`), preferred first; ``(False,)``."""
    found = declared(family, Layouts)
    return (False,) if found is None else tuple(found.scan)


def preferred_layout(family: Family) -> bool:
    """Whether ``family`` prefers its layers scanned: the first of :func:`layouts`."""
    scan = layouts(family)
    return scan[0] if scan else False


def _first_edition_persistent(family: Family) -> PersistentState | None:
    """:attr:`Family.persistent_state`, as a PersistentState."""
    types = tuple(family.persistent_state)
    return PersistentState(lambda: types) if types else None


def _persistent_spellings(family: Family) -> tuple[str, str]:
    names = ", ".join(kind.__name__ for kind in family.persistent_state)
    return f"persistent_state=({names},)", f"PersistentState(lambda: ({names},))"


def persistent_types(family: Family) -> tuple[type, ...]:
    """The Variable types ``family`` keeps as persistent state (:class:`PersistentState`)."""
    found = declared(family, PersistentState)
    return () if found is None else tuple(found.types())


def release(family: Family) -> str | None:
    """The release whose goldens ``family`` runs (:class:`Release`), or ``None``."""
    found = declared(family, Release)
    return None if found is None else found.name


def production_topologies(family: Family) -> Mapping[str, str]:
    """Each production size ``family`` places on its own TPU slice (:class:`Topologies`)."""
    found = declared(family, Topologies)
    return {} if found is None else dict(found.production)


def vocab_tiles(family: Family, config: Any) -> int:
    """The slices ``config`` computes its training loss in (:class:`VocabTiling`); 1 by default."""
    found = declared(family, VocabTiling)
    return 1 if found is None or found.tiles is None else found.tiles(config)


def accepted_precision(family: Family) -> tuple[PrecisionChange, ...]:
    """The precision differences ``family`` accepts (:class:`Precision`); none by default."""
    found = declared(family, Precision)
    return () if found is None else tuple(found.accepted)


def _spelt(old: str, new: str) -> Callable[[Family], tuple[str, str]]:
    return lambda family: (old, new)


FIRST_EDITION: dict[type[Feature], _FirstEdition] = {
    Decode: _FirstEdition(_first_edition_decode, _decode_spellings),
    Remat: _FirstEdition(
        _flagged(Remat, lambda family: functools.partial(family.variant, remat=True)),
        _spelt(
            "Capabilities(remat=True) with variant(config, remat=True)",
            "Remat(config), config(config) rematerialised",
        ),
    ),
    Dropout: _FirstEdition(
        _flagged(Dropout, lambda family: lambda c, rate: family.variant(c, dropout=rate)),
        _spelt(
            "Capabilities(dropout=True) with variant(config, dropout=rate)",
            "Dropout(config), config(config, rate) with dropout",
        ),
    ),
    Aqt: _FirstEdition(
        _flagged(Aqt, lambda family: family.aqt_config),
        _spelt("Capabilities(aqt=True) with aqt_config", "Aqt(self.aqt_config)"),
    ),
    Fp8: _FirstEdition(
        _flagged(Fp8, lambda family: family.fp8_config),
        _spelt("Capabilities(fp8=True) with fp8_config", "Fp8(self.fp8_config)"),
    ),
    VocabTiling: _FirstEdition(
        _flagged(VocabTiling, lambda family: family.vocab_tiling_config),
        _spelt(
            "Capabilities(vocab_tiling=True) with vocab_tiling_config",
            "VocabTiling(self.vocab_tiling_config)",
        ),
    ),
    Qwix: _FirstEdition(_first_edition_qwix, _qwix_spellings),
    AuxLosses: _listed(AuxLosses, "aux_losses", "aux_losses_config"),
    Recorded: _listed(Recorded, "recorded", "upgrade_reference"),
    Bridges: _FirstEdition(_first_edition_bridges, _bridges_spellings),
    Layouts: _FirstEdition(_first_edition_layouts, _layouts_spellings),
    PersistentState: _FirstEdition(_first_edition_persistent, _persistent_spellings),
    Release: _FirstEdition(
        _first_edition_release,
        lambda family: (f"release={family.release!r}", f"Release({family.release!r})"),
    ),
}
"""Each feature's first-edition spelling: read into the feature's value, and respelt."""


def declared[F: Feature](family: Family, kind: type[F]) -> F | None:
    """``family``'s feature of type ``kind``, however spelt; ``None`` if it lacks it."""
    for feature in family.features():
        if isinstance(feature, kind):
            return feature
    return first_edition(family, kind)


def first_edition[F: Feature](family: Family, kind: type[F]) -> F | None:
    """``family``'s feature of type ``kind`` as its first-edition spelling declares it."""
    first = FIRST_EDITION.get(kind)
    return None if first is None else first.read(family)


def first_edition_features(family: Family) -> list[str]:
    """Each ability ``family`` declares in the first edition's spelling, respelt.

    ``"<first edition> -> <feature in features()>"``, a line each; empty for a family
    written in the second edition (or declaring nothing optional).
    """
    typed = {type(feature) for feature in family.features()}
    return [
        "{} -> {}".format(*edition.spelt(family))
        for kind, edition in FIRST_EDITION.items()
        if kind not in typed and edition.read(family) is not None
    ]


def required[F: Feature](family: Family, kind: type[F]) -> F:
    """``family``'s feature of type ``kind``; :class:`FamilyError` if it lacks it."""
    found = declared(family, kind)
    if found is None:
        raise FamilyError(f"{family.name} does not declare {kind.__name__} ({kind.capability})")
    return found


def supports(family: Family, capability: str) -> bool:
    """Whether ``family`` has the ability named ``capability``, however spelt."""
    if any(feature.capability == capability for feature in family.features()):
        return True
    kinds = [kind for kind in FIRST_EDITION if kind.capability == capability]
    if kinds:
        return first_edition(family, kinds[0]) is not None
    return bool(getattr(family.capabilities, capability, False))


def spelling(capability: str) -> str:
    """How a family declares the ability named ``capability``: ``"<Feature> in features()"``.

    ``Capabilities(<capability>=...)`` for an ability with no typed feature.
    """
    kinds = [kind.__name__ for kind in Feature.__subclasses__() if kind.capability == capability]
    return f"{kinds[0]} in features()" if kinds else f"Capabilities({capability}=...)"
