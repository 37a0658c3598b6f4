"""Optional abilities as typed values: the Family contract's second edition.

A family declares each optional ability it has as one value in
:meth:`~conformance.contract.Family.features`, carrying its own hooks and settings
(``Decode(style="token", config=self.decode_config)``), instead of a
:class:`~conformance.contract.Capabilities` flag, a hook method and a calling convention
in three places. A value missing what it needs fails when the family is loaded, naming
it (:mod:`conformance.contract.validate`). The first edition's spelling of the same
ability still works: :func:`conformance.contract.declared` reads either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from conformance.contract.values import Backend, CacheAsValue, PathRules, QuantScope


@dataclasses.dataclass(frozen=True)
class Feature:
    """An optional ability of a family, with its hooks and settings."""

    capability: ClassVar[str]
    """The ability's name: the checks that need it, and the family's ``unsupported`` key
    explaining why it lacks it, know it by this name."""
    hooks: ClassVar[dict[str, str]] = {}
    """Its fields that must be callable, each with how it is called."""
    optional: ClassVar[dict[str, str]] = {}
    """Its fields that may be ``None`` (the default) or else must be callable, each with
    how it is called."""
    replaces: ClassVar[tuple[str, str] | None] = None
    """``(Family method, field)``: the first edition's hook the feature's field takes
    the place of. A family overriding that method must pass it as the field, or the
    override would be silently ignored."""


@dataclasses.dataclass(frozen=True)
class Decode(Feature):
    """Serving through a KV cache: the prefill, decode and cache checks.

    The first edition's ``Capabilities(decode=True, decode_style=...)`` with
    :meth:`Family.decode_config`.
    """

    capability: ClassVar[str] = "decode"
    replaces: ClassVar[tuple[str, str] | None] = ("decode_config", "config")
    optional: ClassVar[dict[str, str]] = {"config": "config(config)"}
    style: str = "prefill"
    """How the family decodes, one of :data:`~conformance.contract.DECODE_STYLES`.

    ``"prefill"`` (MaxText's): the modules take a call-time keyword ``mode``
    (``"forward"``, ``"prefill"`` of right-padded prompts, ``"decode"`` of one token per
    row at its own position). ``"token"`` (Flax's examples'): the modules of
    :attr:`config` take one token per row per call, at one position for all rows, and
    keep the cache index themselves."""
    config: Callable[[Any], Any] | None = None
    """``config(config)``: the config whose modules decode one token per call (Flax's
    ``decode=True``), holding exactly ``config``'s parameters. Required with
    ``style="token"``, and only then."""
    cache: CacheAsValue | None = None
    """``None`` (the default): the modules hold their cache, Linen's in the ``cache``
    collection (created empty by ``init``), NNX's in ``nnx.Cache`` variables (created
    empty by ``model.init_cache(batch_size)``). A :class:`CacheAsValue`: they take it
    and return it."""


@dataclasses.dataclass(frozen=True)
class Remat(Feature):
    """A rematerialised variant: ``layout[remat]`` (and ``cost``, ``tpu_compile``).

    The first edition's ``Capabilities(remat=True)`` with :meth:`Family.variant`.
    """

    capability: ClassVar[str] = "remat"
    replaces: ClassVar[tuple[str, str] | None] = ("variant", "config")
    hooks: ClassVar[dict[str, str]] = {"config": "config(config)"}
    config: Callable[[Any], Any]
    """``config(config)``: ``config`` rematerialised. It must not change what one step
    computes from the same parameters and keys."""


@dataclasses.dataclass(frozen=True)
class Dropout(Feature):
    """A variant with dropout: ``dropout`` (and a checkpoint resumed with it).

    The first edition's ``Capabilities(dropout=True)`` with :meth:`Family.variant`.
    """

    capability: ClassVar[str] = "dropout"
    replaces: ClassVar[tuple[str, str] | None] = ("variant", "config")
    hooks: ClassVar[dict[str, str]] = {"config": "config(config, rate)"}
    config: Callable[[Any, float], Any]
    """``config(config, rate)``: ``config`` with dropout at ``rate``, drawing its
    randomness from :attr:`Family.train_rngs` (and NNX's matching ``Rngs`` streams)."""


@dataclasses.dataclass(frozen=True)
class Aqt(Feature):
    """AQT (aqtp) int8 projections: train, convert and serve (the ``aqt_*`` checks).

    The first edition's ``Capabilities(aqt=True)`` with :meth:`Family.aqt_config`.
    """

    capability: ClassVar[str] = "aqt"
    replaces: ClassVar[tuple[str, str] | None] = ("aqt_config", "config")
    hooks: ClassVar[dict[str, str]] = {"config": "config(config, mode)"}
    config: Callable[[Any, str], Any]
    """``config(config, mode)``: ``config`` quantized by AQT in ``mode``: ``"train"``
    (fake-quantized over float kernels), ``"convert"`` (the forward also writes each
    frozen kernel to the ``aqt`` collection; NNX through ``nnx.bridge.ToNNX``) or
    ``"serve"`` (kernels read from there; the float kernels are not parameters)."""


@dataclasses.dataclass(frozen=True)
class Fp8(Feature):
    """FP8 training with delayed scaling (``fp8_train_step``).

    The first edition's ``Capabilities(fp8=True)`` with :meth:`Family.fp8_config`.
    """

    capability: ClassVar[str] = "fp8"
    replaces: ClassVar[tuple[str, str] | None] = ("fp8_config", "config")
    hooks: ClassVar[dict[str, str]] = {"config": "config(config)"}
    config: Callable[[Any], Any]
    """``config(config)``: ``config`` whose projections compute in FP8 with Flax's ops,
    their scales and amax histories kept as ``_overwrite_with_gradient`` values."""


@dataclasses.dataclass(frozen=True)
class VocabTiling(Feature):
    """A training loss computed from the logits a few rows at a time (``vocab_tiling``).

    The first edition's ``Capabilities(vocab_tiling=True)`` with
    :meth:`Family.vocab_tiling_config`.
    """

    capability: ClassVar[str] = "vocab_tiling"
    replaces: ClassVar[tuple[str, str] | None] = ("vocab_tiling_config", "config")
    hooks: ClassVar[dict[str, str]] = {"config": "config(config, tiles)"}
    optional: ClassVar[dict[str, str]] = {"tiles": "tiles(config)"}
    config: Callable[[Any, int], Any]
    """``config(config, tiles)``: ``config`` whose modules, given ``targets`` and
    ``target_weights`` in a training call, return the summed weighted cross entropy
    computed ``tiles`` slices at a time, holding exactly ``config``'s parameters."""
    tiles: Callable[[Any], int] | None = None
    """``tiles(config)``: the slices ``config`` itself computes its training loss in (a
    production size whose workload tiles the vocabulary), 1 for whole logits; a step
    compiled for a TPU slice then trains as that workload does. ``None`` (the default):
    every config computes whole logits."""


@dataclasses.dataclass(frozen=True)
class Qwix(Feature):
    """Qwix quantization in the modes given (the ``quant_*`` checks, one test per mode).

    The first edition's ``Capabilities(quantization={...})`` with
    :meth:`Family.quantization_scope`.
    """

    capability: ClassVar[str] = "quantization"
    replaces: ClassVar[tuple[str, str] | None] = ("quantization_scope", "scope")
    optional: ClassVar[dict[str, str]] = {"scope": "scope(config)"}
    modes: frozenset[str]
    """The modes, names in :data:`~conformance.contract.QUANTIZATION_MODES`: QAT
    (fake-quantized forward over float parameters) or PTQ (``qvalue`` plus ``scale``
    parameters), in int8 or fp8 (e4m3)."""
    scope: Callable[[Any], QuantScope] | None = None
    """``scope(config)``: what the quantization rules target. ``None`` (the default):
    every ``jax.lax.dot_general``."""


@dataclasses.dataclass(frozen=True)
class AuxLosses(Feature):
    """Scalar auxiliary losses the model sows in a training forward (``aux_losses``).

    The first edition's ``Capabilities(aux_losses=names)`` with
    :meth:`Family.aux_losses_config`. MoE load balancing and multi-token prediction
    sow such losses: Linen ``self.sow("intermediates", name, value)``, NNX
    ``self.sow(nnx.Intermediate, name, value)`` (or a subclass of it). The harness's
    train step adds every value sown under each name to the loss, as a training stack
    must; the ``aux_losses`` check compares them across backends and shows they reach
    the loss.
    """

    capability: ClassVar[str] = "aux_losses"
    replaces: ClassVar[tuple[str, str] | None] = ("aux_losses_config", "config")
    optional: ClassVar[dict[str, str]] = {"config": "config(config)"}
    names: tuple[str, ...]
    """The sown names, at least one."""
    config: Callable[[Any], Any] | None = None
    """``config(config)``: ``config`` with the losses on, for a family whose models sow
    them only when a weight is on (MaxText's ``load_balance_loss_weight``, 0 in its
    ``base.yml``): the ``aux_losses`` check trains it, every other check the family's own
    config. ``None`` (the default): the family's own configs sow them, so every check
    trains them (and ``grad_accumulation`` skips: a loss computed from batch statistics
    need not add up over micro-batches)."""


@dataclasses.dataclass(frozen=True)
class Recorded(Feature):
    """Recorded references the family keeps (the ``recorded_*`` checks).

    The first edition's ``Capabilities(recorded=backends)`` with
    :meth:`Family.upgrade_reference`. Each backend's one-step run, recorded by ``python -m
    conformance.record`` into the repository, is compared with each live backend, so a
    backend that is gone (Linen, once deleted) stays a reference. A reference recorded
    before bfloat16 train steps and state were recorded fails the bfloat16
    ``recorded_train_step`` and ``recorded_resume`` until ``python -m conformance.record
    --extend`` adds them (no recorded number changes).
    """

    capability: ClassVar[str] = "recorded"
    replaces: ClassVar[tuple[str, str] | None] = ("upgrade_reference", "upgrade")
    optional: ClassVar[dict[str, str]] = {"upgrade": "upgrade(leaves, versions)"}
    backends: tuple[str, ...]
    """The recorded backends' ids (:class:`~conformance.contract.Backend` values or
    ``"linen"``, ``"nnx"``), at least one."""
    upgrade: Callable[[Mapping[str, Any], Mapping[str, str]], dict[str, Any]] | None = None
    """``upgrade(leaves, versions)``: parameter-shaped leaves of a reference recorded with
    ``versions`` (``{"flax": "0.12.12", "maxtext": "0.2.4", ...}``), keyed by the
    canonical (NNX) paths of the release that recorded them, returned keyed by this
    release's canonical paths in its shapes: rename, move, reshape or drop what a
    release changed. Every returned leaf must exist in the live model. ``None`` (the
    default): the leaves as recorded."""


@dataclasses.dataclass(frozen=True)
class Bridges(Feature):
    """How many modules each side runs through a bridge from the other backend.

    The first edition's :attr:`Family.expected_bridges`. The ``provenance`` check counts
    ``ToLinen`` modules (NNX code) in the Linen model and ``ToNNX`` modules (Linen code)
    in the NNX model, in the base config, and fails when a side builds another count: a
    side silently running the other backend's code (MaxText's HLO test kept compiling
    Linen after NNX became its default). Without it, ``provenance`` skips (the run's
    header still says what each side built).
    """

    capability: ClassVar[str] = "bridges"
    linen: int = 0
    """``ToLinen`` modules in the Linen model."""
    nnx: int = 0
    """``ToNNX`` modules in the NNX model."""

    def count(self, backend: Backend) -> int:
        """The modules ``backend``'s model runs through a bridge."""
        return self.linen if Backend(backend) is Backend.LINEN else self.nnx


@dataclasses.dataclass(frozen=True)
class Release(Feature):
    """The release of the model code the family runs, when its goldens differ by release.

    The first edition's :attr:`Family.release`. A zoo gated release against release
    (MaxText 0.2.4 and 0.2.5) keeps its goldens at ``goldens/<family>/<release>/<check>/``,
    one folder per release, and a run claims only its own release's; ``python -m
    conformance.upgrade`` compares the folders. Without it, goldens live at
    ``goldens/<family>/<check>/``. Recorded references are not kept per release: a later
    release is compared with what an earlier one recorded.
    """

    capability: ClassVar[str] = "release"
    name: str
    """The release, a folder name (``"0.2.5"``)."""


@dataclasses.dataclass(frozen=True)
class Layouts(Feature):
    """The layer layouts the family builds: a Python list of layers, or a scan over them.

    The first edition's ``Capabilities(scan_layers=...)`` with
    :meth:`Family.layer_stack_rules` (in Linen paths), :attr:`Family.layer_stack_axis`
    and :attr:`Family.state_stack_axis`. Undeclared, a family builds one layout, the list.
    With both, the ``layout[scan_layers]`` check and the cross-layout checkpoint
    conversions stack the list's layers into the scan's leaves by :attr:`stack`.
    """

    capability: ClassVar[str] = "scan_layers"
    optional: ClassVar[dict[str, str]] = {"stack": "stack(config)"}
    scan: tuple[bool, ...]
    """The layouts (``True``: scanned), the preferred one first: the ``smoke`` tier runs
    only that one."""
    stack: Callable[[Any], PathRules] | None = None
    r"""``stack(config)``: rewrites from the list layout's canonical (NNX) parameter paths,
    for the list ``config``, to the scan's. Each pattern captures the layer index in a
    group named ``layer`` (``(r"^layers/(?P<layer>\d+)/", "layers/")``); the leaves of
    all layers stack on a new axis (:attr:`axis`) in index order. Required with both
    layouts. Stated in canonical paths, they hold once Linen is deleted."""
    axis: int = 0
    """The axis of a scanned parameter that indexes layers (MaxText's ``param_scan_axis``
    is 1)."""
    state_axis: int = 0
    """The same for persistent state (:attr:`Family.persistent_state`): Flax's scans stack
    collections other than the parameters on axis 0 unless told otherwise."""


@dataclasses.dataclass(frozen=True)
class PersistentState(Feature):
    """NNX Variable types beside ``nnx.Param`` that are persistent model state.

    The first edition's :attr:`Family.persistent_state`.

    MaxText 0.2.5's ``MoEBiasVar``: both train states keep them, never differentiated
    (Linen in the collections Flax's bridges name after them), checkpoints and
    cross-layout conversions carry them (:attr:`Layouts.state_axis`), a recorded one-step
    state must hold them (``recorded_resume``), a recorded parameter that became one is
    accepted, and ``hygiene`` does not report them as transient.
    """

    capability: ClassVar[str] = "persistent_state"
    hooks: ClassVar[dict[str, str]] = {"types": "types()"}
    types: Callable[[], tuple[type, ...]]
    """``types()``: the Variable types. Called only when a check needs them, so a family
    may import them there: a registry that lists the family never pays for the import
    (MaxText's ``MoEBiasVar`` brings its MoE layers, seconds of imports)."""


@dataclasses.dataclass(frozen=True)
class Topologies(Feature):
    """The TPU slice each production size compiles for under ``--tpu default``.

    New in the second edition. ``--tpu default`` compiles the device size for a small
    slice and every production size for ``v5p:4x4x4`` (64 chips); a size that does not
    fit 64 chips (DeepSeek-V3's 671B parameters with their optimizer state) names the
    slice it trains on here, so the ``tpu_compile`` check judges it where it would run.
    Any other slice named on the command line (``--tpu GEN:AxB[xC]@production``) still
    takes every production size, whatever is declared.
    """

    capability: ClassVar[str] = "topologies"
    production: Mapping[str, str]
    """Production size (one of :attr:`Family.sizes` after the first) -> its slice, as
    ``--tpu`` names one, without ``@production``: ``"GEN:AxB[xC]"``, optionally
    ``"=MESH"`` for the mesh over its chips (``"v5p:8x8x8=data=4,fsdp=64,tensor=2"``).
    A size it leaves out compiles for the default slice."""


@dataclasses.dataclass(frozen=True)
class PrecisionChange:
    """A precision difference between the backends a family accepts, with its reason."""

    module: str
    r"""A regular expression matched in full against the module's Linen or NNX path
    (``r"layers(_\d+|/\d+)?/attn"`` for every layer's attention, in either layout)."""
    ops: tuple[str, ...]
    """What it covers: primitives (``exp``, ``dot_general``, ``convert_element_type``),
    groups (``"sum of products"``, ``"rounding"``), or ``"<method> takes"`` and
    ``"<method> returns"`` for the dtypes a call takes or returns. It must match the
    module the ``precision`` check reports the difference at (the deepest one)."""
    reason: str
    """Why it is accepted, in words: a run that meets it says so."""


@dataclasses.dataclass(frozen=True)
class Precision(Feature):
    """Precision differences the ``precision`` check accepts, each with its reason.

    New in the second edition. The ``precision`` check compares which dtypes each module
    computes in on each side; a difference one of :attr:`accepted` covers passes (an NNX
    rewrite through ``jax.nn.dot_product_attention`` accumulates the attention scores in
    float32 where the Linen model accumulates them in the compute dtype: a change a zoo
    may accept). One that covers no difference in a run fails it, so a stale or
    misspelt entry is found.
    """

    capability: ClassVar[str] = "precision"
    accepted: tuple[PrecisionChange, ...]


@dataclasses.dataclass(frozen=True)
class TreeMode(Feature):
    """The family's NNX model in flax's tree mode: the ``tree_mode`` check.

    New in the second edition. flax plans to make NNX's tree mode the default
    (``nnx_graph_mode=False``, ``nnx_graph_updates=False``); the check builds, runs, trains
    and checkpoints the NNX model in graph mode and in tree mode and holds the two to
    agree. Tree mode cannot hold shared references (a head tied to the embedding by
    ``self.head = self.token_embed``): a family whose NNX model has one declares the
    rewrite it runs in tree mode as :attr:`nnx_module`.
    """

    capability: ClassVar[str] = "tree_mode"
    optional: ClassVar[dict[str, str]] = {"nnx_module": "nnx_module(config, rngs)"}
    nnx_module: Callable[[Any, Any], Any] | None = None
    """``nnx_module(config, rngs)``: the model as the zoo rewrote it for tree mode, with
    the same parameter paths. ``None`` (the default): :meth:`Family.nnx_module` itself,
    built and traced in tree mode."""
    accept: tuple[tuple[str, str], ...] = ()
    """Parameters only the rewrite holds, each as ``(its path, the graph-mode parameter
    it starts as a copy of)``: a structural change the zoo made on purpose (a head
    untied from the embedding it shared). The check accepts them where it compares the
    parameters, starts them as those copies, and compares the forward and the train step
    on every other leaf; the two modes' checkpoints then differ in their trees, so they
    are not exchanged. An entry the rewrite does not hold only fails the check."""


@dataclasses.dataclass(frozen=True)
class ExplicitSharding(Feature):
    """The family's NNX model in jax's explicit sharding mode: the ``explicit_sharding`` check.

    New in the second edition. With every mesh axis explicit
    (``jax.sharding.AxisType.Explicit``, the mesh set with ``jax.set_mesh``), arrays carry
    their sharding in their type, and an operation whose result's sharding is ambiguous
    fails when traced instead of being laid out by the compiler. The check runs the NNX
    model with auto axes and with explicit axes on the same devices and holds the two to
    the same parameters, logits, train step and activation layouts. A model written for
    auto axes alone (an embedding lookup or a contraction jax cannot lay out by itself)
    declares the rewrite it runs with explicit axes as :attr:`nnx_module`.
    """

    capability: ClassVar[str] = "explicit_sharding"
    optional: ClassVar[dict[str, str]] = {"nnx_module": "nnx_module(config, rngs)"}
    nnx_module: Callable[[Any, Any], Any] | None = None
    """``nnx_module(config, rngs)``: the model as the zoo rewrote it for explicit axes,
    with the same parameter paths. ``None`` (the default): :meth:`Family.nnx_module`
    itself, traced with explicit axes."""


def with_features(base: Sequence[Feature], *new: Feature) -> tuple[Feature, ...]:
    """``base`` with each of ``new`` in place of the feature of its kind (added if none).

    For a family refining its parent's: ``with_features(super().features(), Bridges(linen=1))``.
    """
    kinds = {type(feature) for feature in new}
    return (*(feature for feature in base if type(feature) not in kinds), *new)
