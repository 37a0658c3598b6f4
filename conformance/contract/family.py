"""The Family contract: what a model family tells the harness, and nothing else.

A *family* tells the harness how to build one model twice, once with Flax Linen and
once with Flax NNX, and how the two parameter trees correspond. This module imports no
other harness module: it is the whole interface a model zoo writes against.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from conformance.contract.features import Feature
from conformance.contract.values import (
    Batch,
    Capabilities,
    Divergence,
    FamilyError,
    LogicalRules,
    PathRules,
    QuantScope,
)


class Family(abc.ABC):
    """One model family, written for both backends: the whole contract with the harness.

    Required: :attr:`name`, :meth:`config`, :meth:`linen_module` (unless Linen was
    deleted: see there), :meth:`nnx_module`, :meth:`batch` and
    :meth:`logical_axis_rules`. Everything else has a default that suits a family which
    ignores it, or is guarded by a :class:`Capabilities` field whose tests skip, with
    the reason, when the family does not declare it.

    Configs must be hashable (a frozen dataclass is): the harness builds each side once
    per config and reuses it. Init and evaluation must be deterministic: the same seed
    gives the same parameters, the same parameters and batch the same logits, in every
    call and process; a training forward draws randomness only from :attr:`train_rngs`
    (and NNX's matching ``Rngs`` streams). Modules are called as follows:

    * ``linen_module(config).apply({"params": p}, tokens, positions, segment_ids,
      **kwargs)`` and ``nnx_module(config, rngs)(tokens, positions, segment_ids,
      **kwargs)`` return logits ``[batch, seq, vocab]`` in the config's compute dtype.
      ``kwargs`` is empty in evaluation and :meth:`train_kwargs` in a training step,
      where Linen also gets one key per stream in :attr:`train_rngs`.
    * Optionally, both sides sow the stacked outputs of their decoder blocks, ``[layers,
      batch, seq, d_model]``, as an intermediate named ``hidden_states`` on the top module
      (Linen collection ``intermediates``; NNX ``nnx.Intermediate``). The harness records
      every module call itself and names the first whose inputs agree and whose output
      diverges; the sown states only name the block when that recording stops at a Linen
      ``nn.scan`` (docs/checks.md, "Localisation").
    * Every parameter carries logical axis names (Linen ``nn.with_logical_partitioning``;
      NNX ``out_sharding`` metadata) resolved by :meth:`logical_axis_rules`, one per
      dimension, a stacked layer's axis included: a parameter with too few or too many
      is refused where its side is built (``LogicalRankError``, naming it); one without
      names is replicated.
    * With ``Capabilities(decode=True)`` and ``decode_style="prefill"`` (the default),
      both sides also take a call-time keyword ``mode``: ``"forward"`` (the default),
      ``"prefill"`` (a right-padded prompt, whose keys and values fill the cache) or
      ``"decode"`` (one token per row, at the positions given, against the cache).
      Linen keeps the cache in the ``cache`` collection, created empty by ``init(...,
      mode="prefill")``; NNX keeps it in ``nnx.Cache`` variables created empty by
      ``model.init_cache(batch_size)``. Cache leaves carry logical axis names and map
      between backends by :meth:`path_rules`.
    * With ``decode_style="token"`` (Flax's examples), the modules of
      :meth:`decode_config` decode: each call takes one token per row, ``[batch, 1]``,
      at one position for every row, and the model advances its own cache index. Linen
      creates the empty ``cache`` collection with ``init`` on a full-length batch; NNX
      with ``model.init_cache(batch_size)``. The harness feeds each prompt token by
      token, then the greedy tokens; with ``logits_predict="current"`` the token fed at
      a position is the one before it (0 at the first), as the model's own shift does.
    * Decoding is declared in the second edition as a
      :class:`~conformance.contract.Decode` feature (:meth:`features`), which says the
      same and more: modules that take their cache and return it as a value, as several
      public model libraries' do, declare ``Decode(cache=CacheAsValue(...))``.
    * With ``Capabilities(vocab_tiling=True)``, the modules of a
      :meth:`vocab_tiling_config` also take the keywords ``targets`` and
      ``target_weights`` (``[batch, seq]``) in a training call and then return the
      weighted sum of next-token cross entropy (a float32 scalar) instead of logits.
      A family whose own configs tile their loss (a production workload's) says how
      many slices each computes with ``VocabTiling(tiles=...)``, so that a step compiled
      for a TPU slice (``tpu_compile``) trains as that workload does; without it, every
      config of the family computes whole logits.
    """

    name: str
    """Registry name, lower case, used in test ids."""

    sizes: tuple[str, ...] = ("tiny",)
    """Config sizes. The first is run on devices by every numeric check; the others (for
    example production sizes) are only evaluated abstractly: structure and sharding
    goldens, without allocating parameters, and compiled for a production TPU slice
    (``--tpu GEN:AxB[xC]@production``; under ``--tpu default``, ``v5p:4x4x4`` unless a
    :class:`~conformance.contract.Topologies` feature places the size elsewhere)."""

    capabilities: Capabilities = Capabilities()

    known_divergences: Sequence[Divergence] | Mapping[str, str] = ()
    """Tests this family is known to fail, each with the reason: a finding, not noise.

    Each is a :class:`~conformance.contract.Divergence`: a check, narrowed by axis and
    parameter values (``Divergence("layout", why, {"mesh": "fsdp8", "scan_layers":
    True})``). The suite marks those tests as strict expected failures, so a fix
    upstream turns them red until the entry is removed. The first that selects a test
    marks it, before any known library failure of the check. One that can mark no test
    (no such check, axis or value, or each of its tests marked by an earlier one) is a
    usage error when the suite is collected. A finding may declare its words
    (``shows=r"Duplicate RngCount"``, a regular expression): a test it marks that fails
    without them fails. Without ``shows`` (the default), any failure of a marked test
    counts as the finding.

    The first edition's spelling, ``{key: reason}`` with a key ``"check"`` or
    ``"check[id fragment]"`` (a test-id substring), still works; there too the first key
    that matches a test marks it, and a key each of whose tests an earlier one matches is a
    usage error.
    """

    unsupported: Mapping[str, str] = MappingProxyType({})
    """Why the family cannot run something, shown in every skip reason it explains.

    Keyed by a feature's ability (its ``capability``: ``{"decode": "..."}``,
    ``"scan_layers"`` for a missing layer layout, ``"quantization"`` for a missing Qwix
    mode) or by the name of a check the family cannot run for a reason of the check's own.
    """

    batch_axis: str = "batch"
    """Logical name of a batch's leading axis; batches are placed by resolving it."""

    train_rngs: tuple[str, ...] = ()
    """Linen RNG streams a training forward draws (``("dropout",)``); none by default.
    Each step passes one key per stream, derived from the step counter."""

    persistent_state: tuple[type, ...] = ()
    """NNX Variable types beside ``nnx.Param`` that are persistent model state. Default:
    none. First edition: the second declares ``PersistentState(types)`` in
    :meth:`features`, ``types()`` called only when a check needs them."""

    logits_predict: str = "next"
    """What the logits at position ``i`` predict, one of :data:`PREDICTIONS`: ``"next"``,
    ``tokens[i + 1]`` (the batch's ``targets`` are the next tokens), or ``"current"``,
    ``tokens[i]``, for a model that shifts its inputs right internally (Flax's lm1b; its
    ``targets`` are the tokens). The loss trains only on positions whose predicted token
    is real; decoding feeds what the prediction needs (see :class:`Family`)."""

    expected_bridges: Mapping[str, int] | None = None
    """How many modules each side runs through a bridge from the other backend, by
    backend id (``{"linen": n, "nnx": m}``); ``None``: not declared. First edition: the
    second declares :class:`~conformance.contract.Bridges` in :meth:`features`."""

    release: str | None = None
    """The release of the model code the family runs, when its goldens differ between
    releases; ``None``: goldens not kept per release. First edition: the second declares
    :class:`~conformance.contract.Release` in :meth:`features`."""

    goldens: Path | None = None
    """The directory holding this family's goldens and recorded references, for a family
    that ships them in its package (the built-in families do: ``Path(__file__).resolve().parent
    / "goldens"``, absolute, so it never follows the working directory). The suite's checks
    of this family read and regenerate them there, whatever project runs it. ``None`` (the
    default): the running project's goldens directory, the ``conformance_goldens`` ini
    option resolved against the file that sets it. A user's own golden tests always keep
    their goldens in the project."""

    layer_stack_axis: int = 0
    """Axis of a scanned leaf that indexes layers. First edition: the second declares
    ``Layouts(axis=...)`` in :meth:`features`."""

    state_stack_axis: int = 0
    """Axis of a scanned :attr:`persistent_state` leaf that indexes layers. First edition:
    the second declares ``Layouts(state_axis=...)`` in :meth:`features`."""

    def features(self) -> Sequence[Feature]:
        """The optional abilities the family has, each a typed value with its own hooks.

        The second edition's spelling (:mod:`conformance.contract.features`): a
        :class:`~conformance.contract.Decode` says how the family serves through its KV
        cache, in place of ``Capabilities(decode=True, decode_style=...)`` and
        :meth:`decode_config`; ``Remat``, ``Dropout``, ``Aqt``, ``Fp8`` and ``VocabTiling``
        carry the config hook their ``Capabilities`` flag needed, ``Qwix`` the modes and
        the scope, ``AuxLosses`` the sown names and the config that turns them on,
        ``Layouts`` the layer layouts and their stack rules in canonical paths,
        ``Recorded`` the recorded backends and the upgrade of old references,
        ``Bridges`` the bridged module counts, ``Release`` the release goldens are kept by,
        ``PersistentState`` the Variable types kept as persistent state (default: none),
        ``Topologies`` the TPU slice each production size compiles for under ``--tpu
        default`` (default: ``v5p:4x4x4``) and ``Precision`` the precision differences
        between the backends the ``precision`` check accepts (default: none; every
        difference fails it), ``TreeMode`` that the NNX model runs in flax's tree mode,
        with the rewrite it runs there if it holds shared references (undeclared, the
        ``tree_mode`` check and the ``graph-vs-tree`` tests of the checks on the ``pair``
        axis skip), and ``ExplicitSharding`` that it runs on jax's explicit mesh axes,
        with the rewrite it runs there if any (undeclared, the ``explicit_sharding`` check
        and the ``auto-vs-explicit`` tests skip). Declaring an ability in both spellings is a load
        error. None by default.
        """
        return ()

    @property
    def device_size(self) -> str:
        """The size every numeric check runs on devices: the first of :attr:`sizes`."""
        return self.sizes[0]

    @abc.abstractmethod
    def config(self, size: str, *, scan_layers: bool, dtype: jnp.dtype = jnp.float32) -> Any:
        """Return the config of ``size`` with the given layer layout and compute dtype.

        ``scan_layers`` is one of the family's layouts (its
        :class:`~conformance.contract.Layouts`); the config must train deterministically
        (no dropout: a :class:`~conformance.contract.Dropout` feature turns it on).
        """

    def linen_module(self, config: Any) -> nn.Module:
        """Return the Linen module for ``config``.

        A family whose Linen implementation was deleted does not define it, and declares
        the references recorded while it existed (a :class:`~conformance.contract.Recorded`
        feature): its NNX side is then compared with those and with its goldens, and every
        check that needs a live Linen side skips saying so (see :attr:`has_linen`).
        """
        del config
        raise FamilyError(f"{self.name} has no Linen module (Family.linen_module is not defined)")

    @property
    def has_linen(self) -> bool:
        """Whether the family defines :meth:`linen_module` (a live Linen side exists)."""
        return type(self).linen_module is not Family.linen_module

    @abc.abstractmethod
    def nnx_module(self, config: Any, rngs: nnx.Rngs) -> nnx.Module:
        """Return the NNX module for ``config``, initialised from ``rngs``."""

    @abc.abstractmethod
    def batch(self, config: Any, batch_size: int, seed: int = 0) -> Batch:
        """Return a deterministic batch for ``config`` (same seed, same batch)."""

    @abc.abstractmethod
    def logical_axis_rules(self) -> LogicalRules:
        """Return the logical-axis rules both backends are sharded with."""

    def axis_rules(self, config: Any) -> LogicalRules:
        """The logical-axis rules ``config``'s parameters are resolved with for sharding goldens.

        By default :meth:`logical_axis_rules`, for every size. A family whose production
        sizes bring their own rules (MaxText's model ymls) returns each config's. Arrays
        placed on devices (the device size) always follow :meth:`logical_axis_rules`, so
        for the device size the two must agree; ``sharding`` fails if they do not.
        """
        del config
        return self.logical_axis_rules()

    def unavailable(self) -> str | None:
        """Why the family cannot run in this environment (one line), or ``None`` if it can.

        A family wrapping an optional dependency returns the install hint here; the
        suite then skips every test on the family with this reason.
        """
        return None

    def sequence_length(self, config: Any) -> int:
        """The longest sequence ``config`` runs (decode fits prompts and steps in it).

        By default the length of the family's own batch.
        """
        return int(self.batch(config, 1).tokens.shape[1])

    def train_kwargs(self, config: Any) -> Mapping[str, Any]:
        """Keyword arguments both modules take in a training forward; none by default.

        The built-in families return ``{"deterministic": False}``, so that dropout (when
        a :meth:`variant` turns it on) applies in training only.
        """
        del config
        return {}

    def with_mesh(self, config: Any, mesh: jax.sharding.Mesh) -> Any:
        """``config`` for modules that constrain their activations on ``mesh``.

        ``mesh`` is the device mesh the harness places parameters and batches on: the
        test's mesh, or one device for the one-device reference. A family whose modules
        take a mesh (MaxText's build their own from the config) must use exactly this
        one, so that a partitioned run and the one-device run differ only in placement.
        The result must be hashable and compare unequal for different meshes. Identity
        by default: modules that only annotate parameters need no mesh.
        """
        del mesh
        return config

    def variant(self, config: Any, *, remat: bool = False, dropout: float = 0.0) -> Any:
        """``config`` rematerialised (``remat``) or with dropout at rate ``dropout``.

        Neither may change what one step computes from the same parameters and keys;
        ``layout[remat]`` and ``dropout`` check that. Required with
        ``Capabilities(remat=True)`` or ``Capabilities(dropout=True)``; by default the
        family has no variant. First edition: the second declares ``Remat(config)`` and
        ``Dropout(config)`` in :meth:`features`.
        """
        wanted = [w for w, on in (("remat", remat), (f"dropout {dropout}", dropout)) if on]
        if wanted:
            raise FamilyError(f"{self.name} has no {' or '.join(wanted)} variant")
        return config

    def path_rules(self, config: Any) -> PathRules:
        """Rewrites from Linen parameter paths to NNX ones; identity by default.

        ``(pattern, replacement)`` pairs and leaf transforms (``Split``, ``Stack``,
        ``Transpose``, ``Reshape``: :mod:`conformance.contract.transforms`, for a leaf
        held in another layout), tried in order: the first rule whose pattern matches a
        path (``re.search``) takes it, rewriting its first match (``re.sub(..., count=1)``),
        and no later rule sees that path; a path no rule matches keeps its name. The
        resulting map must be one-to-one and cover every NNX parameter. Cache paths map by
        the same rules, by name only.
        """
        del config
        return ()

    def layer_stack_rules(self, config: Any) -> PathRules:
        r"""Rewrites from unscanned Linen parameter paths to scanned ones.

        Each pattern captures the layer index in a group named ``layer``, e.g.
        ``(r"^layers_(?P<layer>\d+)/", "layers/")``; leaves of all layers are stacked on
        a new axis (:attr:`layer_stack_axis`) in index order. Required when
        :attr:`Capabilities.scan_layers` declares both layouts; empty by default. First
        edition: the second declares ``Layouts(scan, stack)`` in :meth:`features`, its
        rules in canonical (NNX) paths.
        """
        del config
        return ()

    def quantization_scope(self, config: Any) -> QuantScope:
        """What quantization targets; by default every ``jax.lax.dot_general``.

        First edition: the second declares ``Qwix(modes, scope)`` in :meth:`features`.
        """
        del config
        return QuantScope()

    def aqt_config(self, config: Any, mode: str) -> Any:
        """``config`` with its projections quantized by AQT (aqtp) int8 in ``mode``.

        ``mode`` is ``"train"`` (fake-quantized over float kernels), ``"convert"`` (the
        forward also writes each frozen kernel, ``qvalue`` int8 plus ``scale``, to the
        ``aqt`` collection; NNX through ``nnx.bridge.ToNNX``, an ``aqt`` Variable) or
        ``"serve"`` (kernels are read from there; the float kernels are not parameters).
        Required with ``Capabilities(aqt=True)``. First edition: the second declares
        ``Aqt(config)`` in :meth:`features`.
        """
        del config
        raise FamilyError(f"{self.name} does not support AQT (mode {mode!r})")

    def fp8_config(self, config: Any) -> Any:
        """``config`` whose projections compute in FP8 with delayed scaling.

        Flax's FP8 ops (``flax.linen.fp8_ops``; on NNX bridged with ``nnx.bridge``) keep
        their scales and amax histories in the ``_overwrite_with_gradient`` collection
        (Linen) or Variable type (NNX): a train step replaces them with their gradient,
        which is their next value, and optimises only the parameters. Required with
        ``Capabilities(fp8=True)``. First edition: the second declares ``Fp8(config)`` in
        :meth:`features`.
        """
        del config
        raise FamilyError(f"{self.name} does not support FP8 training")

    def aux_losses_config(self, config: Any) -> Any:
        """The config the ``aux_losses`` check trains: ``config`` itself by default.

        For a family whose models sow their declared auxiliary losses
        (``Capabilities(aux_losses=names)``) only when a weight is on, as MaxText's
        ``load_balance_loss_weight`` (0 in its ``base.yml``): return ``config`` with it
        on, and every other check keeps the family's own config. First edition: the
        second declares ``AuxLosses(names, config)`` in :meth:`features`.
        """
        return config

    def decode_config(self, config: Any) -> Any:
        """``config`` whose modules decode one token per call (Flax's ``decode=True``).

        They hold exactly ``config``'s parameters. Required with
        ``Capabilities(decode_style="token")``, and only then. First edition: the second
        declares ``Decode(style="token", config=...)`` in :meth:`features`.
        """
        del config
        raise FamilyError(f"{self.name} has no token-by-token decode config")

    def vocab_tiling_config(self, config: Any, tiles: int) -> Any:
        """``config`` whose training loss computes the logits ``tiles`` slices at a time.

        The batch's ``batch x seq`` positions are cut into ``tiles`` equal slices and
        each slice's logits are computed and reduced to its loss separately, so the
        ``[batch, seq, vocab]`` logits never exist at once. Its modules return that loss
        when called with ``targets`` and ``target_weights`` (see :class:`Family`), and
        hold exactly ``config``'s parameters. Required with
        ``Capabilities(vocab_tiling=True)``. First edition: the second declares
        ``VocabTiling(config)`` in :meth:`features`.
        """
        del config
        raise FamilyError(f"{self.name} does not support vocab tiling ({tiles} tiles)")

    def upgrade_reference(
        self, leaves: Mapping[str, Any], versions: Mapping[str, str]
    ) -> dict[str, Any]:
        """Parameter-shaped leaves of a reference recorded with ``versions``, made current.

        ``leaves`` are host arrays keyed by the canonical (NNX) parameter paths of the
        release that recorded them (parameters, gradients, or one optimizer slot);
        ``versions`` are that reference's library and model versions (``{"flax":
        "0.12.12", "maxtext": "0.2.4", ...}``). Return them keyed by this release's
        canonical paths, in its shapes: rename, move, reshape or drop the leaves a
        release changed. Every returned leaf must exist in the live model. Unchanged by
        default. First edition: the second declares ``Recorded(backends, upgrade)`` in
        :meth:`features`.
        """
        del versions
        return dict(leaves)

    def __repr__(self) -> str:
        return f"<Family {self.name}>"
