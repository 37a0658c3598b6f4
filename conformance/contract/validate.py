"""A family checked when it is loaded: every declaration it makes comes with its hook.

A capability declared without the hook that serves it would otherwise fail only when
its test runs, deep in a check. :func:`problems` lists what is wrong with a family, one
line each naming the family, the declaration and the hook; the registry refuses a
family with any (:func:`validate`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from conformance.contract.declared import (
    FIRST_EDITION,
    declared,
    first_edition,
    layouts,
    recorded_backends,
)
from conformance.contract.family import Family
from conformance.contract.features import (
    AuxLosses,
    Bridges,
    Decode,
    Feature,
    Layouts,
    Precision,
    PrecisionChange,
    Qwix,
    Recorded,
    Topologies,
)
from conformance.contract.values import (
    BACKENDS,
    DECODE_STYLES,
    PREDICTIONS,
    QUANTIZATION_MODES,
    CacheAsValue,
    Divergence,
    FamilyError,
)

HOOKS: dict[str, str] = {
    "remat": "variant(config, *, remat, dropout)",
    "dropout": "variant(config, *, remat, dropout)",
    "aqt": "aqt_config(config, mode)",
    "fp8": "fp8_config(config)",
    "vocab_tiling": "vocab_tiling_config(config, tiles)",
}
"""The hook each optional capability needs, beyond the required ones."""


def _overrides(family: Family, hook: str) -> bool:
    name = hook.split("(")[0]
    return getattr(type(family), name) is not getattr(Family, name)


def problems(family: Family) -> list[str]:
    """Everything wrong with ``family``'s declarations, one line each; empty if nothing.

    A declared capability without its hook (:data:`HOOKS`), both layer layouts without
    ``layer_stack_rules``, a decode style or prediction that does not hold together
    (:func:`_decoding`), an unknown quantization mode or recorded backend, no Linen
    module and no recorded reference, a relative :attr:`~Family.goldens`, no size or
    layout, and (when the family can run here) a config that is not hashable.
    """
    caps, name = family.capabilities, family.name
    typed = {f.capability for f in family.features() if isinstance(f, Feature)}
    found = [
        f"family {name!r} declares Capabilities({cap}=True) but does not define {hook}"
        for cap, hook in HOOKS.items()
        if getattr(caps, cap) and not _overrides(family, hook) and cap not in typed
    ]
    found += _layouts(family)
    qwix = [feature for feature in family.features() if isinstance(feature, Qwix)]
    modes = set(qwix[0].modes) if qwix else set(caps.quantization)
    if qwix and not modes:
        found.append(f"family {name!r} declares Qwix with no mode; give at least one")
    if unknown := sorted(modes - set(QUANTIZATION_MODES)):
        found.append(
            f"family {name!r} declares quantization modes {unknown}; known modes: "
            f"{', '.join(QUANTIZATION_MODES)}"
        )
    recorded = recorded_backends(family)
    if unknown := sorted(set(recorded) - set(BACKENDS)):
        found.append(
            f"family {name!r} declares recorded references of {unknown}; backends: "
            f"{', '.join(BACKENDS)}"
        )
    found += _features(family)
    found += _names(family)
    found += _bridges(family)
    found += _topologies(family)
    found += _precision(family)
    found += _decoding(family)
    found += _divergences(family)
    if not family.has_linen and not recorded:
        found.append(
            f"family {name!r} defines no linen_module and declares no recorded reference "
            "(Recorded in features()): its NNX side has nothing to be compared with"
        )
    if family.goldens is not None and not Path(family.goldens).is_absolute():
        found.append(
            f"family {name!r} declares goldens={str(family.goldens)!r}, a relative path: it "
            "would follow the working directory; give its package's directory, absolute"
        )
    if not layouts(family) or not family.sizes:
        found.append(f"family {name!r} declares no layer layout or no size")
    elif family.unavailable() is None:
        for scan in layouts(family):
            config = family.config(family.device_size, scan_layers=scan)
            try:
                hash(config)
            except TypeError as err:
                found.append(
                    f"family {name!r}: config({family.device_size!r}, scan_layers={scan}) is "
                    f"not hashable ({err}); the harness builds each side once per config: "
                    "use a frozen dataclass"
                )
                break
    return found


def _divergences(family: Family) -> list[str]:
    """``known_divergences`` that are neither Divergence values nor a first-edition mapping.

    Whether each selects a test is checked when the suite is collected, against the
    registered checks.
    """
    declared = family.known_divergences
    if isinstance(declared, Mapping):
        wrong = [k for k, v in declared.items() if not (isinstance(k, str) and isinstance(v, str))]
        what = "keys and reasons that are not strings"
    else:
        wrong = [
            d
            for d in declared
            if not isinstance(d, Divergence)
            or not isinstance(d.check, str)
            or not isinstance(d.reason, str)
            or not isinstance(d.where, Mapping)
            or not isinstance(d.shows, str | None)
        ]
        what = (
            "entries that are not "
            "Divergence(check: str, reason: str, where: Mapping, shows: str | None)"
        )
    if wrong:
        return [f"family {family.name!r} declares known_divergences with {what}: {wrong[:3]!r}"]
    return [
        f"family {family.name!r} declares a known divergence of {d.check} that shows "
        f"{d.shows!r}, which is no regular expression: {err}"
        for d in declared
        if isinstance(d, Divergence) and (err := _pattern_error(d.shows)) is not None
    ]


def _pattern_error(pattern: str | None) -> str | None:
    """Why ``pattern`` is no regular expression, or ``None`` if it is one (or is ``None``)."""
    try:
        re.compile(pattern or "")
    except re.error as err:
        return str(err)
    return None


def _decoding(family: Family) -> list[str]:
    """What is wrong with how ``family`` says it decodes and what its logits predict."""
    name = family.name
    if family.logits_predict not in PREDICTIONS:
        return [
            f"family {name!r} declares logits_predict={family.logits_predict!r}; known: "
            f"{', '.join(PREDICTIONS)}"
        ]
    decodes = [feature for feature in family.features() if isinstance(feature, Decode)]
    if not decodes:
        return _first_edition_decoding(family)
    return _decode(family, decodes[0])


def _features(family: Family) -> list[str]:
    """What is wrong with ``family``'s :meth:`~Family.features`, whatever their kind.

    An entry that is no feature, a feature listed twice or also declared in the first
    edition's spelling, and a hook that is not callable.
    """
    name, found = family.name, []
    kinds: dict[type, int] = {}
    for feature in family.features():
        if not isinstance(feature, Feature):
            found.append(
                f"family {name!r} lists {feature!r} in features(), which is no Feature "
                "(Decode, Remat, Aqt, ...)"
            )
            continue
        kind = type(feature)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kinds[kind] == 2:
            found.append(f"family {name!r} lists {kind.__name__} twice in features(); give one")
        if kinds[kind] == 1 and first_edition(family, kind) is not None:
            old = FIRST_EDITION[kind].spelt(family)[0]
            found.append(
                f"family {name!r} declares {feature.capability} twice, as {kind.__name__}(...) "
                f"in features() and as {old}: keep the {kind.__name__} feature"
            )
        optional = {f: c for f, c in feature.optional.items() if getattr(feature, f) is not None}
        found += [
            f"family {name!r} declares {kind.__name__}({field}={getattr(feature, field)!r}), "
            f"which is not callable as {call}"
            for field, call in {**feature.hooks, **optional}.items()
            if not callable(getattr(feature, field))
        ]
        found += _ignored_override(family, feature)
    return found


def _names(family: Family) -> list[str]:
    """A feature whose names (:class:`AuxLosses`' or :class:`Recorded`'s) are none or no strings."""
    found = []
    for feature in family.features():
        if not isinstance(feature, AuxLosses | Recorded):
            continue
        field = "names" if isinstance(feature, AuxLosses) else "backends"
        names = getattr(feature, field)
        if isinstance(names, tuple) and names and all(isinstance(n, str) for n in names):
            continue
        found.append(
            f"family {family.name!r} declares {type(feature).__name__}({field}={names!r}); "
            "give a non-empty tuple of strings"
        )
    return found


def _layouts(family: Family) -> list[str]:
    """Both layouts without stack rules, or first-edition stack rules a feature ignores.

    First-edition stack axes beside a :class:`Layouts` feature are refused as an ability
    declared twice (:func:`_features`).
    """
    name, typed = family.name, [f for f in family.features() if isinstance(f, Layouts)]
    if not typed:
        scan = family.capabilities.scan_layers
        if set(scan) == {False, True} and not _overrides(family, "layer_stack_rules"):
            return [
                f"family {name!r} declares Capabilities(scan_layers={scan}) but does not "
                "define layer_stack_rules(config), which stacks one layout into the other"
            ]
        return []
    layouts, found = typed[0], []
    if set(layouts.scan) == {False, True} and layouts.stack is None:
        found.append(
            f"family {name!r} declares Layouts({layouts.scan}) without stack=, the rules "
            "that stack the list's layers into the scan's (canonical paths)"
        )
    if _overrides(family, "layer_stack_rules"):
        found.append(
            f"family {name!r} overrides layer_stack_rules (Linen paths), which its Layouts "
            "feature does not call: state the rules in canonical (NNX) paths as "
            "Layouts(stack=...), or drop the override"
        )
    return found


def _bridges(family: Family) -> list[str]:
    """Bridge counts that are not counts, or first-edition ones keyed by no backend."""
    expected = family.expected_bridges
    if expected is not None and (unknown := sorted(set(expected) - set(BACKENDS))):
        return [
            f"family {family.name!r} declares expected_bridges for {unknown}; backends: "
            f"{', '.join(BACKENDS)}"
        ]
    found = declared(family, Bridges)
    counts = {} if found is None else {"linen": found.linen, "nnx": found.nnx}
    return [
        f"family {family.name!r} declares Bridges({side}={count!r}); give a count of modules"
        for side, count in counts.items()
        if not (isinstance(count, int) and count >= 0)
    ]


def _topologies(family: Family) -> list[str]:
    """A :class:`Topologies` entry for a size that is no production size, or no slice name.

    The slice's grammar is checked when a run compiles for TPU slices (``--tpu``), where
    a malformed one is a usage error naming the family and the size.
    """
    found = declared(family, Topologies)
    if found is None:
        return []
    if not isinstance(found.production, Mapping):
        return [
            f"family {family.name!r} declares Topologies({found.production!r}); give a "
            "mapping of production size to slice"
        ]
    production = family.sizes[1:]
    wrong = []
    for size, slice_ in found.production.items():
        if size not in production:
            wrong.append(
                f"family {family.name!r} places size {size!r} on a TPU slice in Topologies; "
                f"its production sizes: {', '.join(production) or 'none'}"
            )
        elif not isinstance(slice_, str) or not slice_ or "@" in slice_:
            wrong.append(
                f"family {family.name!r} places size {size!r} on {slice_!r} in Topologies; "
                "give a slice as --tpu names one, without '@production' ('v5p:8x8x8')"
            )
    return wrong


def _precision(family: Family) -> list[str]:
    """Each :class:`Precision` change with no module pattern that compiles, no ops or no reason."""
    found = declared(family, Precision)
    return [
        f"family {family.name!r} accepts {change!r} in Precision; give PrecisionChange("
        "module=<a regular expression>, ops=(<operation>, ...), reason=<why>)"
        for change in (() if found is None else found.accepted)
        if not _well_formed(change)
    ]


def _well_formed(change: object) -> bool:
    if not isinstance(change, PrecisionChange) or not change.reason:
        return False
    if not change.ops or isinstance(change.ops, str):
        return False
    try:
        re.compile(change.module)
    except (re.error, TypeError):
        return False
    return True


def _ignored_override(family: Family, feature: Feature) -> list[str]:
    """An override of the first-edition hook ``feature`` replaces that it does not call.

    A family subclassing one written in the second edition may override the old hook
    (``quantization_scope``, ``aqt_config``, ``variant``...); unless the feature is given
    that very method, the override would change nothing, silently.
    """
    if feature.replaces is None:
        return []
    method, field = feature.replaces
    if not _overrides(family, method) or getattr(feature, field) == getattr(family, method):
        return []
    kind = type(feature).__name__
    return [
        f"family {family.name!r} overrides {method}, which its {kind} feature does not call: "
        f"give {kind}({field}=self.{method}), or drop the override"
    ]


def _decode(family: Family, decode: Decode) -> list[str]:
    """What is wrong with ``family``'s :class:`Decode` feature."""
    name, style = family.name, decode.style
    if style not in DECODE_STYLES:
        return [
            f"family {name!r} declares Decode(style={style!r}); known styles: "
            f"{', '.join(DECODE_STYLES)}"
        ]
    found = []
    if style == "token" and decode.config is None:
        found.append(
            f"family {name!r} declares Decode(style='token') without config=, the config "
            "whose modules decode one token per call (config(config) -> config)"
        )
    if style == "prefill" and decode.config is not None:
        found.append(
            f"family {name!r} declares Decode(config=...) with style='prefill': declare "
            "style='token' to decode token by token, or drop config"
        )
    if style == "prefill" and family.logits_predict == "current":
        found.append(_CURRENT.format(name=name))
    return found + _cache(family, decode.cache)


_CURRENT = (
    "family {name!r} predicts the current token and decodes with a multi-token prefill: a "
    "model that shifts its inputs decodes token by token (decode_style='token')"
)


def _first_edition_decoding(family: Family) -> list[str]:
    """What is wrong with ``family``'s ``Capabilities(decode=..., decode_style=...)``."""
    caps, name = family.capabilities, family.name
    if caps.decode_style not in DECODE_STYLES:
        return [
            f"family {name!r} declares decode_style={caps.decode_style!r}; known styles: "
            f"{', '.join(DECODE_STYLES)}"
        ]
    token, defines = caps.decode_style == "token", _overrides(family, "decode_config")
    found = []
    if token and not caps.decode:
        found.append(
            f"family {name!r} declares decode_style='token' but not Capabilities(decode=True)"
        )
    if token and not defines:
        found.append(
            f"family {name!r} declares decode_style='token' but does not define "
            "decode_config(config), whose modules decode one token per call"
        )
    if defines and not token:
        found.append(
            f"family {name!r} defines decode_config(config) but declares "
            f"decode_style={caps.decode_style!r}: declare decode_style='token' to decode "
            "token by token, or drop decode_config"
        )
    if caps.decode and not token and family.logits_predict == "current":
        found.append(_CURRENT.format(name=name))
    return found


def _cache(family: Family, cache: object) -> list[str]:
    """What is wrong with the cache a :class:`Decode` feature declares."""
    name = family.name
    if cache is None:
        return []
    if not isinstance(cache, CacheAsValue):
        return [
            f"family {name!r} declares Decode(cache={cache!r}); give a CacheAsValue (a cache "
            "passed as a value) or None (held in the model)"
        ]
    hooks = {"init": cache.init, "nnx_init": cache.nnx_init or cache.init}
    found = [
        f"family {name!r} declares CacheAsValue({field}={hook!r}), which is not callable as "
        f"{field}(config, batch_size)"
        for field, hook in hooks.items()
        if not callable(hook)
    ]
    if not (isinstance(cache.keyword, str) and cache.keyword.isidentifier()):
        found.append(
            f"family {name!r} declares CacheAsValue(keyword={cache.keyword!r}), which is not "
            "a keyword argument's name"
        )
    return found


def validate(family: Family) -> Family:
    """``family`` if its declarations hold together; else :class:`FamilyError`, one line."""
    found = problems(family)
    if found:
        raise FamilyError("; ".join(found))
    return family
