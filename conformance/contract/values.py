"""The values the Family contract speaks in: backends, batches, capabilities, rules.

Plain, immutable values a family declares or receives; :mod:`conformance.contract.family`
holds the contract itself.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax

from conformance.contract.transforms import LeafTransform

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]
"""Logical-axis rules, ``(logical_name, mesh_axis or axes or None)``, first match wins."""

PathRules = Sequence[tuple[str, str] | LeafTransform]
"""Rules taking Linen parameter paths to NNX ones, tried in order: regex rewrites
``(pattern, replacement)``, and leaf transforms (:mod:`conformance.contract.transforms`)
that change a leaf's layout too."""

QUANTIZATION_MODES = ("qat_int8", "qat_fp8", "ptq_int8", "ptq_fp8")
"""The Qwix modes a family may declare: QAT (fake-quantized forward over float
parameters) or PTQ (``qvalue`` plus ``scale`` parameters), in int8 or fp8 (e4m3)."""

DECODE_STYLES = ("prefill", "token")
"""How a family decodes: :attr:`Capabilities.decode_style`."""

PREDICTIONS = ("next", "current")
"""What the logits at a position predict: :attr:`Family.logits_predict`."""


class Backend(enum.StrEnum):
    """A backend a family is written for.

    Its value is its id in test ids, checkpoints and references, and it compares equal
    to that id.
    """

    LINEN = "linen"
    NNX = "nnx"

    @property
    def other(self) -> Backend:
        """The backend a conversion from this one goes to."""
        return Backend.NNX if self is Backend.LINEN else Backend.LINEN


BACKENDS = tuple(backend.value for backend in Backend)
"""The backends' ids (:class:`Backend`), in order."""


class Pair(enum.StrEnum):
    """Two sides a check compares: two backends, or two modes of the NNX model.

    Its :attr:`id` is its part of test ids: none for :attr:`LINEN_NNX` (every test's
    pair before modes were sides), else its value, which it compares equal to.
    """

    LINEN_NNX = "linen-vs-nnx"
    GRAPH_TREE = "graph-vs-tree"
    """NNX in flax's graph mode against tree mode (``nnx_graph_mode=False``)."""
    AUTO_EXPLICIT = "auto-vs-explicit"
    """NNX on auto mesh axes against the same devices with every axis explicit."""

    @property
    def label(self) -> str:
        """What is compared with what, as reports and the matrix say it."""
        return _PAIR_LABELS[self]

    @property
    def capability(self) -> str | None:
        """The :class:`Capabilities` field a family declares to run this pair, if any."""
        return None if self is Pair.LINEN_NNX else _PAIR_CAPABILITIES[self]

    @property
    def id(self) -> str:
        """Its part of test ids: ``""`` for :attr:`LINEN_NNX`, else its value."""
        return "" if self is Pair.LINEN_NNX else self.value

    @property
    def on_devices(self) -> bool:
        """Whether its sides exist only on a device mesh (explicit axes are a mesh's)."""
        return self is Pair.AUTO_EXPLICIT


_PAIR_LABELS = {
    Pair.LINEN_NNX: "NNX vs Linen",
    Pair.GRAPH_TREE: "NNX tree mode vs NNX graph mode",
    Pair.AUTO_EXPLICIT: "NNX explicit sharding vs NNX auto sharding",
}
_PAIR_CAPABILITIES = {Pair.GRAPH_TREE: "tree_mode", Pair.AUTO_EXPLICIT: "explicit_sharding"}


class FamilyError(LookupError):
    """A family name or a family definition is not usable."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """A deterministic batch: int32 arrays of shape ``[batch, seq]``.

    ``segment_ids`` is nonzero on real tokens and 0 on padding; ``targets`` are what
    the logits predict (:attr:`Family.logits_predict`): the next tokens, or the tokens
    themselves for a model that shifts its inputs internally. The loss trains on the
    target at a position when the position it predicts is real (for next-token logits,
    never the last column nor past a row's end): no token value is treated as padding,
    so a model that masks by token value (``tokens > 0``) must give padding token 0 and
    no real token 0. A pytree, so it can be passed to jitted functions and placed with
    ``device_put``.
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    targets: jax.Array


@dataclasses.dataclass(frozen=True)
class QuantScope:
    """What quantization rules target: modules by path regex, and operations by name."""

    module_path: str = ".*"
    """Regex fully matching the module path (``layers_0/mlp/wi`` in Linen, ``layers/0/...``
    in NNX), so it must accept both backends' spellings."""
    op_names: tuple[str, ...] = ("dot_general",)
    """Intercepted ``jax`` operations to quantize (``dot_general``, ``einsum``, ...)."""


class FirstEditionWarning(FutureWarning):
    """A family declares something in the Family contract's first-edition spelling.

    It still works; the warning shows the second edition's spelling of each declaration.
    """


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A finding: the tests of one check a family fails, narrowed by what they run on.

    ``where`` narrows by the tests' axes and the check's own parameters, by name: each
    value is the test-id part (``{"mesh": "data2-fsdp2-tensor2", "scan_layers": "scan"}``)
    or the value itself (``{"scan_layers": True}``), and a tuple of them matches any
    (``{"quant": ("ptq_int8", "ptq_fp8")}``). An empty ``where`` selects every test of
    the check. The check, each name and each value are checked when the suite is
    collected: one that selects no test is a usage error, never a silent no-op.

    ``shows`` holds the finding to its words: a regular expression the failure's message
    (``TypeError: ...``, or a check's report) must contain. A test it selects that fails
    otherwise fails, as any failure would, so a declared divergence never hides another
    one. Without it, any failure of a selected test counts as the finding.
    """

    check: str
    reason: str
    where: Mapping[str, Any] = MappingProxyType({})
    shows: str | None = None

    def options(self, name: str) -> tuple[Any, ...]:
        """The values ``where`` accepts for ``name``, any of which matches."""
        wanted = self.where[name]
        return wanted if isinstance(wanted, tuple) else (wanted,)

    def accepts(self, name: str, part: str | None, value: Any) -> bool:
        """Whether a test whose ``name`` has id part ``part`` and ``value`` is selected.

        An option matches the id part, the value, or the value's ``id`` (a mesh's).
        """
        return any(self.matches(option, part, value) for option in self.options(name))

    @staticmethod
    def matches(option: Any, part: str | None, value: Any) -> bool:
        """Whether one ``where`` option names a test's id ``part`` or ``value`` (or its ``id``)."""
        return option in (part, value) or option == getattr(value, "id", None)

    def selects(self, check: str, parts: Mapping[str, str], values: Mapping[str, Any]) -> bool:
        """Whether it selects the test of ``check`` with these id ``parts`` and ``values``.

        Both are keyed by axis and parameter name; a test of a zoo's own may know values
        only.
        """
        return check == self.check and all(
            (name in parts or name in values)
            and self.accepts(name, parts.get(name), values.get(name))
            for name in self.where
        )


class FirstEditionKey(NamedTuple):
    """A first-edition known divergence: ``{"check[id fragment]": reason}``, parsed."""

    key: str
    check: str
    fragment: str | None
    """The test-id substring in brackets; ``None`` for a bare ``"check"`` key."""
    reason: str

    @classmethod
    def parse(cls, key: str, reason: str) -> FirstEditionKey:
        """``key`` split into its check and its bracketed fragment, if any."""
        check, bracket, fragment = key.partition("[")
        return cls(key, check, fragment.removesuffix("]") if bracket else None, reason)

    def marks(self, check: str, case_id: str) -> bool:
        """Whether it marks the test of ``check`` whose id is ``case_id``."""
        return check == self.check and (self.fragment or "") in case_id


def divergences(
    declared: Sequence[Divergence] | Mapping[str, str],
) -> tuple[tuple[Divergence, ...], tuple[FirstEditionKey, ...]]:
    """A family's ``known_divergences`` as ``(typed, first-edition keys)``.

    The first edition's ``{"check[id fragment]": reason}`` mapping gives the second part,
    parsed; a sequence of :class:`Divergence` values the first.
    """
    if isinstance(declared, Mapping):
        return (), tuple(FirstEditionKey.parse(k, r) for k, r in declared.items())
    return tuple(declared), ()


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a family supports; every test that needs what it lacks skips with a reason.

    The defaults describe a family with nothing optional: one unscanned layer layout,
    no remat or dropout variant, no decode, no quantization.
    """

    scan_layers: tuple[bool, ...] = (False,)
    """Layer layouts supported (``True``: scanned), the preferred one first; both require
    :meth:`Family.layer_stack_rules`. First edition: the second declares
    :class:`~conformance.contract.Layouts` in :meth:`Family.features`."""
    remat: bool = False
    """:meth:`Family.variant` gives a rematerialised config (``layout[remat]``)."""
    dropout: bool = False
    """:meth:`Family.variant` gives a config with dropout (``dropout``)."""
    decode: bool = False
    """Serving through a KV cache, in the :attr:`decode_style` the family declares."""
    decode_style: str = "prefill"
    """How the family decodes (see :class:`Family`), one of :data:`DECODE_STYLES`:
    ``"prefill"`` (MaxText's: a call-time ``mode`` keyword, a multi-token prefill of
    right-padded prompts, then one token per row at its own position) or ``"token"``
    (Flax's examples': decoding selected by :meth:`Family.decode_config`, one token per
    call at one position for all rows, the prompt fed token by token, the cache index kept
    by the model). ``"token"`` requires :meth:`Family.decode_config`; ``"prefill"`` must
    not define it."""
    quantization: frozenset[str] = frozenset()
    """Qwix modes (names in :data:`QUANTIZATION_MODES`) the family supports."""
    aqt: bool = False
    """AQT int8 train/convert/serve through :meth:`Family.aqt_config`."""
    vocab_tiling: bool = False
    """A training loss computed from the logits a few rows at a time, through
    :meth:`Family.vocab_tiling_config`."""
    fp8: bool = False
    """FP8 training with delayed scaling through :meth:`Family.fp8_config`."""
    aux_losses: tuple[str, ...] = ()
    """Scalar auxiliary losses the model sows in a training forward, by name. First
    edition: the second declares :class:`~conformance.contract.AuxLosses` in
    :meth:`Family.features`, which says what the harness does with them."""
    recorded: tuple[str, ...] = ()
    """Backends (``"linen"``, ``"nnx"``) whose recorded reference the family keeps. First
    edition: the second declares :class:`~conformance.contract.Recorded` in
    :meth:`Family.features`."""

    @property
    def preferred_scan_layers(self) -> bool:
        """The family's preferred layer layout: the first of :attr:`scan_layers`."""
        return self.scan_layers[0] if self.scan_layers else False


@dataclasses.dataclass(frozen=True)
class CacheAsValue:
    """A KV cache the modules take and return as a value, instead of holding it.

    Given as :attr:`Decode.cache`. Every serving call passes the cache as the keyword
    :attr:`keyword` (``module.apply({"params": p}, tokens, positions, segment_ids,
    cache=c)`` in Linen, ``model(..., cache=c)`` in NNX) and the modules return
    ``(logits, cache)``, the cache updated, with the same leaves; called without it
    (every other check) they return the logits alone. Both decode styles work with it:
    ``"prefill"`` also passes ``mode``, ``"token"`` calls the modules of
    :attr:`Decode.config`.
    """

    init: Callable[[Any, int], Any]
    """``init(config, batch_size)``: the empty cache of ``batch_size`` rows for the
    serving ``config``, any pytree of arrays. It wraps the zoo's own signature, e.g.
    ``lambda config, rows: init_cache(config.length, rows, config.dtype)``. A leaf
    wrapped in ``flax.linen.LogicallyPartitioned`` (as ``nn.with_logical_partitioning``
    makes) is placed by its logical axis names; a plain leaf is replicated. It runs
    traced (jitted, with the cache's shardings), so it may depend only on its
    arguments."""
    nnx_init: Callable[[Any, int], Any] | None = None
    """The NNX side's ``init``, for a cache laid out differently from Linen's (its paths
    map by :meth:`Family.path_rules`, as parameters do). ``None`` (the default): the
    same :attr:`init` on both sides."""
    keyword: str = "cache"
    """The keyword argument the modules take the cache by."""
