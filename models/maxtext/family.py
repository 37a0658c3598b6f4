"""MaxText families registered through the ``conformance.families`` entry point group.

Each family is one MaxText model shrunk by MaxText's own ``base_*`` overrides, built
twice by MaxText itself. On maxtext 0.2.4: its pure Linen ``TransformerLinenPure``
(``pure_nnx``, ``enable_nnx``, ``pure_nnx_decoder`` all False) and its NNX
``Transformer`` (all True). On 0.2.5, which deleted Linen: its ``TransformerLinen``, the
``ToLinen`` bridge around the NNX ``Transformer``, and the NNX ``Transformer``; every
numeric check also runs against the references 0.2.4 recorded
(:mod:`conformance_models.maxtext.releases` holds what differs). Nothing here imports
``maxtext`` until a test needs a model, so the families load without it and
:meth:`MaxTextFamily.unavailable` gives the skip reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from conformance.families import (
    QUANTIZATION_MODES,
    Aqt,
    AuxLosses,
    Backend,
    Batch,
    Bridges,
    Decode,
    Divergence,
    Dropout,
    ExplicitSharding,
    Family,
    FamilyError,
    Feature,
    Fp8,
    Layouts,
    LogicalRules,
    PathRules,
    PersistentState,
    QuantScope,
    Qwix,
    Recorded,
    Release,
    Remat,
    Topologies,
    TreeMode,
    VocabTiling,
)
from conformance_models import GOLDENS
from conformance_models.data import make_batch
from conformance_models.maxtext import releases
from conformance_models.maxtext.config import SEQ_LEN, MaxTextConfig, all_explicit, hyperparameters


def _installed() -> str | None:
    """The installed maxtext release, if supported."""
    return None if releases.unsupported() else releases.installed()


class MaxTextFamily(Family):
    """A MaxText model, ``model_name`` shrunk by ``overrides``, as a conformance family."""

    sizes: tuple[str, ...] = ("tiny",)
    """``tiny`` (``model_name`` shrunk, run on devices), then production sizes: MaxText
    model ymls as shipped, evaluated abstractly (structure and sharding goldens)."""
    batch_axis = "activation_batch"
    goldens = GOLDENS
    model_name: ClassVar[str]
    """The MaxText model (a yml under ``maxtext/configs/models``)."""
    overrides: ClassVar[Mapping[str, Any]]
    """MaxText config keys set on top of the model's yml (``override_model_config`` is on)."""
    production: ClassVar[Mapping[str, Mapping[str, Any]]] = MappingProxyType({})
    """Keys a production size's workload sets on top of its yml (none by default)."""

    train_rngs = ("dropout",)

    divergences: ClassVar[Mapping[str, tuple[Divergence, ...]]] = MappingProxyType({})
    """Known divergences by maxtext release (what :attr:`known_divergences` gives)."""

    explicit_axes: ClassVar[bool] = True
    """Whether MaxText runs the model on explicit mesh axes (``shard_mode: explicit``),
    declared from 0.2.5, whose config lists the decoders it supports there."""

    def features(self) -> Sequence[Feature]:
        """Prefill decoding, remat and dropout, AQT, FP8, vocab tiling and every Qwix mode.

        Decoding is MaxText's ``model_mode``, through caches the models hold. The installed
        release, when supported, keeps its own goldens (:class:`Release`); from 0.2.5 the
        Linen side is one ``ToLinen`` around the whole NNX model (:class:`Bridges`), while
        0.2.4's Linen bridges 3 to 5 of its layers, by model and layout: not declared.
        From 0.2.5 the MoE routing bias is persistent state (:class:`PersistentState`).
        Its NNX model is held to itself in tree mode (:class:`TreeMode`) and, from 0.2.5
        where MaxText supports the model there (:attr:`explicit_axes`), on explicit axes
        with MaxText's ``shard_mode: explicit`` (:class:`ExplicitSharding`).
        """
        installed = _installed()
        per_release = () if installed is None else (Release(installed),)
        bridged = (Bridges(linen=1, nnx=0),) if releases.bridged() else ()
        persistent = (PersistentState(self.persistent_types),) if releases.bridged() else ()
        on_explicit = (ExplicitSharding(),) if releases.bridged() and self.explicit_axes else ()
        return (
            # MaxText's default is scanned layers (smoke runs those), stacked on axis 1
            # (its param_scan_axis); the routing bias, persistent state, on axis 0.
            Layouts((True, False), self.stack_rules, axis=1),
            *per_release,
            *bridged,
            *persistent,
            Decode(),
            Remat(self.remat_config),
            Dropout(self.dropout_config),
            Aqt(self.aqt_config),
            Fp8(self.fp8_config),
            VocabTiling(self.vocab_tiling_config, self.vocab_tiles),
            Qwix(frozenset(QUANTIZATION_MODES), self.quantization_scope),
            # maxtext 0.2.4's two implementations, read by later releases through the
            # version map.
            Recorded((Backend.LINEN, Backend.NNX), self.upgrade_reference),
            TreeMode(),
            *on_explicit,
        )

    def unavailable(self) -> str | None:
        """Why MaxText families cannot run here: maxtext missing, or an unsupported release."""
        return releases.unsupported()

    @property
    def known_divergences(self) -> tuple[Divergence, ...]:  # type: ignore[override]
        """The installed release's known divergences (:attr:`divergences`)."""
        return self.divergences.get(_installed() or "", ())

    def upgrade_reference(
        self, leaves: Mapping[str, Any], versions: Mapping[str, str]
    ) -> dict[str, Any]:
        """A reference's leaves, recorded with another maxtext, in this release's layout.

        The version map is :func:`~conformance_models.maxtext.releases.upgrade`.
        """
        try:
            return releases.upgrade(leaves, versions.get("maxtext", "unknown"))
        except ValueError as err:
            raise FamilyError(f"{self.name}: {err}") from None

    @staticmethod
    def persistent_types() -> tuple[type, ...]:
        """From 0.2.5, the MoE routing bias (``MoEBiasVar``) is a Variable of its own.

        0.2.4 kept it as a parameter; 0.2.5 moved it out of ``nnx.Param`` (and, through
        the ``ToLinen`` bridge, out of Linen's ``params`` into collection ``MoEBiasVar``).
        Imported here, when a check asks: MaxText's MoE layers take seconds to import.
        """
        if not releases.bridged():
            return ()
        from maxtext.layers.moe import MoEBiasVar

        return (MoEBiasVar,)

    def config(
        self, size: str, *, scan_layers: bool, dtype: jnp.dtype = jnp.float32
    ) -> MaxTextConfig:
        """The model of ``size`` with the given layer layout and compute dtype.

        ``tiny`` is ``model_name`` shrunk by :attr:`overrides`; a production size is its
        yml as shipped, with its workload's :attr:`production` keys, sharded by its own
        rules (:meth:`axis_rules`). A workload's ``num_vocab_tiling`` becomes the config's
        ``vocab_tiles`` (:meth:`vocab_tiles`), so a step compiled for it tiles its loss
        as the workload does.
        """
        if size not in self.sizes:
            raise ValueError(f"{self.name} has no size {size!r}; sizes: {', '.join(self.sizes)}")
        if size == self.device_size:
            overrides = {"override_model_config": True, **_TINY, **self.overrides}
            return MaxTextConfig.create(
                self.model_name, overrides, scan_layers=scan_layers, dtype=dtype
            )
        keys = dict(self.production.get(size, {}))
        tiles = keys.pop("num_vocab_tiling", 1)
        overrides = {"override_model_config": True, **keys}
        return MaxTextConfig.create(
            size, overrides, scan_layers=scan_layers, dtype=dtype, vocab_tiles=tiles
        )

    def linen_module(self, config: MaxTextConfig) -> nn.Module:
        """MaxText's Linen model for ``config``.

        0.2.4's ``TransformerLinenPure``; from 0.2.5, ``TransformerLinen`` (the ``ToLinen``
        bridge around the NNX model).
        """
        if releases.bridged():
            from conformance_models.maxtext.bridged_linen import linen_transformer
        else:
            from conformance_models.maxtext.pure_linen import linen_transformer

        return linen_transformer(config)

    def nnx_module(self, config: MaxTextConfig, rngs: nnx.Rngs) -> nnx.Module:
        """MaxText's NNX ``Transformer`` for ``config``."""
        from conformance_models.maxtext.modules import nnx_transformer

        return nnx_transformer(config, rngs)

    def batch(self, config: MaxTextConfig, batch_size: int, seed: int = 0) -> Batch:
        """A padded batch of :data:`SEQ_LEN` tokens per row (segment id 0 on padding)."""
        vocab = hyperparameters(config, "linen").vocab_size
        return make_batch(vocab, SEQ_LEN, batch_size, seed)

    def train_kwargs(self, config: MaxTextConfig) -> Mapping[str, Any]:
        """Train with dropout enabled (applied only when the config's rate is nonzero)."""
        del config
        return {"deterministic": False}

    def with_mesh(self, config: MaxTextConfig, mesh: jax.sharding.Mesh) -> MaxTextConfig:
        """``config`` whose modules constrain activations on ``mesh``'s devices.

        MaxText names its mesh axes itself (``mesh_axes``: data, stage, fsdp, tensor, ...);
        the module mesh holds ``mesh``'s devices in the same arrangement, each of its
        axes at its size and every other MaxText axis at size 1. On explicit axes
        (MaxText's ``shard_mode: explicit``), MaxText's shardings must name the mesh set
        in context: the module mesh is ``mesh`` itself, and MaxText's ``mesh_axes`` are
        its axes.
        """
        names = tuple(hyperparameters(config, "linen").mesh_axes)
        foreign = [name for name in mesh.axis_names if name not in names]
        if foreign:
            raise FamilyError(
                f"{self.name}: mesh axes {foreign} are not MaxText mesh axes ({', '.join(names)})"
            )
        if all_explicit(mesh):
            return dataclasses.replace(config, mesh=mesh)
        order = sorted(range(len(mesh.axis_names)), key=lambda i: names.index(mesh.axis_names[i]))
        shape = tuple(mesh.shape.get(name, 1) for name in names)
        devices = np.transpose(mesh.devices, order).reshape(shape)
        module_mesh = jax.sharding.Mesh(
            devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)
        )
        return dataclasses.replace(config, mesh=module_mesh)

    def remat_config(self, config: MaxTextConfig) -> MaxTextConfig:
        """MaxText's ``remat_policy`` ``full`` instead of ``minimal`` (no dropout)."""
        return dataclasses.replace(config, remat=True, dropout_rate=0.0)

    def dropout_config(self, config: MaxTextConfig, rate: float) -> MaxTextConfig:
        """``config`` with MaxText's ``dropout_rate`` at ``rate``."""
        return dataclasses.replace(config, dropout_rate=rate)

    def aqt_config(self, config: MaxTextConfig, mode: str) -> MaxTextConfig:
        """MaxText's AQT int8 (``quantization: int8``) in ``mode``, rounding to nearest."""
        if mode not in ("train", "convert", "serve"):
            raise FamilyError(f"{self.name}: no AQT mode {mode!r}; modes: train, convert, serve")
        return dataclasses.replace(config, aqt_mode=mode)

    def fp8_config(self, config: MaxTextConfig) -> MaxTextConfig:
        """MaxText's ``quantization: fp8`` (Flax's ``Fp8DirectDotGeneralOp``)."""
        return dataclasses.replace(config, fp8=True)

    def vocab_tiling_config(self, config: MaxTextConfig, tiles: int) -> MaxTextConfig:
        """MaxText's ``num_vocab_tiling: tiles``.

        The loss is MaxText's own ``vocab_tiling_linen_loss`` or ``vocab_tiling_nnx_loss``.
        """
        return dataclasses.replace(config, vocab_tiles=tiles)

    def vocab_tiles(self, config: MaxTextConfig) -> int:
        """MaxText's ``num_vocab_tiling`` of ``config`` (a 70B workload's is 4)."""
        return config.vocab_tiles

    def stack_rules(self, config: MaxTextConfig) -> PathRules:
        r"""MaxText stacks ``decoder/<stack>_<i>/`` into ``decoder/<stack>/`` on axis 1.

        ``<stack>`` is ``layers``, or ``dense_layers`` and ``moe_layers`` for DeepSeek.
        """
        del config
        return ((r"^decoder/(?P<stack>[a-z_]+?)_(?P<layer>\d+)/", r"decoder/\g<stack>/"),)

    def quantization_scope(self, config: MaxTextConfig) -> QuantScope:
        """The scope of MaxText's own Qwix rule (``use_qwix_quantization``): decoder layers."""
        del config
        return QuantScope(module_path="decoder/.*layers.*", op_names=("dot_general",))

    def logical_axis_rules(self) -> LogicalRules:
        """MaxText's own rules for the tiny model: ``base.yml`` merged with its yml."""
        return _rules(self.config(self.device_size, scan_layers=False))

    def axis_rules(self, config: MaxTextConfig) -> LogicalRules:
        """MaxText's own rules for ``config``: ``base.yml`` merged with its model's yml."""
        return _rules(config)


def _rules(config: MaxTextConfig) -> LogicalRules:
    """The logical-axis rules MaxText resolves for ``config``."""
    return tuple(
        (name, tuple(target) if isinstance(target, list) else target)
        for name, target in hyperparameters(config, "linen").logical_axis_rules
    )


_BF16_ROUNDED = (
    "MaxText's attend() (layers/embeddings.py) casts the tied embedding table to bfloat16 "
    "even in a float32 model, so the token-embedding gradient is bf16-rounded"
)
_BF16_ATTEND = (
    _BF16_ROUNDED + " and is not additive over micro-batches (both backends alike; up to "
    "2.5e-4 apart on 4 micro-batches)"
)
_PARTITIONED = (
    "on data=2,fsdp=2,tensor=2 one step's attention-projection gradients differ from the "
    "same step on one device by up to {gap} ({leaf}), on both backends alike and with "
    "Shardy on or off, while fsdp=8 agrees with one device: the model computes "
    "differently when partitioned on the 3-axis mesh (sharding_invariance), not a "
    "Linen/NNX divergence. With norm scales split over 'fsdp' (logical_axis_rules "
    "[['norm', 'fsdp']], llama2-7b's own setting) instead of MaxText's default 'tensor' it "
    "agrees with one device to 1e-7; XLA's CPU partitioner miscomputes a plain matmul "
    "between these layouts (tests/test_upstream.py::"
    "test_matmul_into_a_batch_split_over_two_axes)"
)
_PTQ_LINEN = (
    "qwix 0.1.8's PTQ looks for a weight only among the current Linen module's own "
    "top-level params (utils/flax_util.py find_param); MaxText's Linen decoder layers are "
    "NNX layers behind a ToLinen bridge (0.2.4: each layer; 0.2.5: the whole model), whose "
    "params lie nested below that module, so on "
    "Linen no decoder-layer kernel becomes qvalue/scale ({leaves} stay float in every "
    "layer) while NNX quantizes each one"
)


_PTQ = MappingProxyType({"quant": ("ptq_int8", "ptq_fp8")})
_NO_PATH = r"AttributeError.*'NoneType' object has no attribute 'path'"
"""The words of the bridged Linen face's failure inside a tiled loss (``shows``)."""
_STATIC_STATE = r"State.* assigned to static attribute 'quant_einsum_wi_0'"
"""The words of 0.2.5's routed MoE failing to build through the bridge with AQT."""
_DUPLICATE_RNGS = (
    r"raised ValueError while building the model.*Duplicate RngCount"
    r"|shared references, which tree mode cannot hold: Rngs at"
)
"""The words of a tree-mode build meeting a shared ``nnx.Rngs`` (the ``tree_mode`` check
names the references themselves)."""
_UNQUANTIZED = r"ptq_\w+ quantized parameters on mesh \S+: \d+ leaf\(s\) disagree"
"""The words of Linen's PTQ kernels left float against NNX's ``qvalue`` and ``scale``."""
_CARRY_TYPES = r"TypeError.*scan body function carry input and carry output must have equal"
"""The words of the layer scan losing the carry's layout on explicit axes."""
_BATCH_SHARDING = (
    r"ShardingTypeError.*dot_general requires lhs batch dimensions and rhs batch dimensions "
    r"to have the same sharding"
)
"""The words of deepseek3's RMSNorm einsum on explicit axes split over tensor."""

_SCAN = MappingProxyType({"scan_layers": True})
_LOOP = MappingProxyType({"scan_layers": False})
_MESH3 = MappingProxyType({"mesh": "data2-fsdp2-tensor2"})
"""What known divergences are narrowed by: PTQ modes, a layer layout, the 3-axis mesh."""


def _ptq_divergences(leaves: str) -> tuple[Divergence, ...]:
    """PTQ's parameter layout and forward fail alike: Linen kernels are never quantized."""
    reason = _PTQ_LINEN.format(leaves=leaves)
    return (
        Divergence("quant_params", reason, _PTQ, r"ptq_\w+: \d+ difference\(s\)"),
        Divergence("quant_forward", reason, _PTQ, _UNQUANTIZED),
    )


_MOE_AQT = (
    "the routed MoE's dense path (layers/moe.py aqt_einsum) calls self.quant.einsum(...), a "
    "Linen AqtEinsum built at call time inside an NNX module. "
)
_MOE_AQT_CALL = _MOE_AQT + (
    "Every AQT mode fails to run on both backends: Linen apply raises 'AqtDotGeneral_0 "
    "needs PRNG for \"params\"', NNX 'Can't call compact methods on unbound modules'"
)
_MOE_AQT_LAYOUT = _MOE_AQT + (
    "Linen's serve-mode init hoists its frozen kernels to the layer "
    "(decoder/moe_layers_0/AqtEinsum_{0,1,2}/AqtDotGeneral_0/qrhs/frozen/{qvalue,scale/0}, "
    "int8[4, 64, 64]; scanned, decoder/moe_layers/..., int8[1, 4, 64, 64]); the NNX model "
    "has none of these 6 leaves"
)
_HOISTED = r"aqt_layout: frozen kernels: 6 difference.*/AqtEinsum_0/\S+/qvalue: Linen has it"
"""The words of 0.2.4's Linen MoE frozen kernels that the NNX model lacks."""
_MOE_AQT_BRIDGED = (
    "maxtext 0.2.5's routed MoE keeps its AQT einsums as NNX state in plain attributes "
    "(quant_einsum_wi_0, ...), which Flax treats as static: building the model through the "
    'ToLinen bridge raises "Found data on value of type State assigned to static attribute '
    "'quant_einsum_wi_0' of Pytree type RoutedMoE\" (unrolled layers in every mode, scanned "
    "layers in convert and serve), while the NNX model builds. Scanned layers' AQT forward "
    "and train step agree on 0.2.5; on 0.2.4 every mode failed on both backends"
)
_VOCAB_TILING = Divergence(
    "vocab_tiling",
    (
        "maxtext 0.2.4's vocab-tiled losses (utils/vocabulary_tiling.py: "
        "vocab_tiling_linen_loss, vocab_tiling_nnx_loss) multiply the output head's gradient "
        "by the loss cotangent but not the hidden states' gradient, so with a mean loss the "
        "gradients below the output head come out too large: on gpt3 and llama2 exactly 92x, "
        "the number of real targets in the harness's batch (llama2's query kernel: 0.103 "
        "untiled, 9.49 tiled), about 92x on gemma2's local-attention query kernel and up "
        "to 154x on deepseek3; the loss itself is right, and both backends alike (tiled "
        "Linen and NNX agree to 1.1e-5)"
    ),
    shows=r"one step on mesh \S+: \d+ leaf\(s\) disagree",
)
_MOE_FP8 = (
    "the routed MoE's dense path (layers/moe.py aqt_einsum) builds its einsum at call time "
    "from the quantization, for FP8 a Linen module (quantizations._Fp8EinsumWrapper around "
    "nn.Fp8Einsum), inside an NNX module: Linen trains, NNX raises 'Can't call compact "
    "methods on unbound modules' in its first step"
)


_VOCAB_TILING_BRIDGED = Divergence(
    "vocab_tiling",
    (
        "maxtext 0.2.5 deleted its Linen tiled loss (vocab_tiling_linen_loss), "
        "and its Linen face cannot run the NNX one: the ToLinen bridge's Qwix patch "
        "(layers/nnx_wrappers.py _fix_for_qwix_quantization) wraps every NNX module call "
        "to read the innermost Linen module's path, which is None inside "
        "vocab_tiling_nnx_loss's scan: the bridged Linen step raises \"AttributeError: "
        "'NoneType' object has no attribute 'path'\"; the NNX step trains tiled"
    ),
    shows=_NO_PATH,
)

_TILED_70B = MappingProxyType(
    {
        "tpu": tuple(
            f"{size}-v5p-4x4x4-data2-fsdp16-tensor2-scan" for size in ("llama2-70b", "llama3.1-70b")
        )
    }
)
"""The 70B workloads' production compiles, whose loss tiles the vocabulary."""

_TILED_PRODUCTION_0_2_4 = Divergence(
    "tpu_compile",
    (
        "the 70B workloads tile the vocabulary (num_vocab_tiling: 4), and maxtext 0.2.4's "
        "two tiled losses lay the output head out apart in the production step "
        "(v5p:4x4x4, remat): vocab_tiling_linen_loss leaves the head's gradient and the "
        "final norm's replicated ([None, None]) where vocab_tiling_nnx_loss keeps them on "
        "['fsdp', 'tensor'] and ['fsdp']: Linen all-gathers 3.20 GB per step against "
        "NNX's 2.71 GB and needs 74.97 GiB per chip against NNX's 64.68 on llama2-70b "
        "(4.78 against 2.81 GB, 86.64 against 65.52 GiB, 91% of the chip, on "
        "llama3.1-70b, whose vocabulary is 4x larger), and NNX all-reduces 20 times to "
        "Linen's 14"
    ),
    _TILED_70B,
)


_TILED_PRODUCTION_BRIDGED = Divergence(
    "tpu_compile",
    (
        "the 70B workloads tile the vocabulary (num_vocab_tiling: 4), so their production "
        "step computes MaxText's tiled loss, which the bridged Linen face of maxtext 0.2.5 "
        "cannot run (as vocab_tiling: the ToLinen bridge's Qwix patch reads a Linen module "
        "path that is None inside vocab_tiling_nnx_loss's scan); on 0.2.4 both sides "
        "compile it"
    ),
    _TILED_70B,
    shows=_NO_PATH,
)


_TREE_MODE_SHARED_RNGS = (
    "NNX tree mode cannot build the model: a shared reference (ValueError: Duplicate "
    "RngCount). maxtext {release}'s {where} keeps the nnx.Rngs it hands to {to}, which "
    "keeps it too (self.rngs = rngs in both)"
)


_ON_THE_TREE_PAIR = (
    "structure",
    "sharding",
    "init",
    "forward",
    "train_step",
    "decode",
    "cost",
    "activation_sharding",
)
"""The checks that also compare graph with tree mode, on the ``graph-vs-tree`` pair."""

_IN_THE_PREFERRED_LAYOUT = ("resume_conversion",)
"""The checks on a pair that run in the family's preferred layer layout alone (MaxText's:
scanned layers), on the primary mesh: a finding narrowed by layout or mesh is not theirs."""


def _shared_rngs(release: str, where: str, to: str, **narrowed: Any) -> tuple[Divergence, ...]:
    """Tree mode fails: ``where`` keeps the nnx.Rngs it hands ``to``, which keeps it too.

    The ``tree_mode`` check, and every check's tests on the ``graph-vs-tree`` pair.
    """
    reason = _TREE_MODE_SHARED_RNGS.format(release=release, where=where, to=to)
    on_pair = {**narrowed, "pair": "graph-vs-tree"}
    everywhere = () if narrowed else _IN_THE_PREFERRED_LAYOUT
    return (
        Divergence("tree_mode", reason, narrowed, _DUPLICATE_RNGS),
        *(Divergence(check, reason, on_pair, _DUPLICATE_RNGS) for check in _ON_THE_TREE_PAIR),
        *(
            Divergence(check, reason, {"pair": "graph-vs-tree"}, _DUPLICATE_RNGS)
            for check in everywhere
        ),
    )


_TREE_MODE_0_2_4 = _shared_rngs(
    "0.2.4", "attention (layers/attentions.py)", "its attention_op (layers/attention_op.py)"
)
_TREE_MODE_LAYER = _shared_rngs(
    "0.2.5",
    "decoder layer (models/gpt3.py, gemma2.py, deepseek.py; not llama2.py)",
    "its attention (layers/attentions.py)",
)
_TREE_MODE_DECODER = _shared_rngs(
    "0.2.5",
    "decoder (layers/nnx_decoders.py)",
    "every unrolled layer's attention (scanned layers get streams of their own and pass)",
    **_LOOP,
)


_ON_THE_EXPLICIT_PAIR = ("forward", "train_step", "decode", "cost", "activation_sharding")
"""The checks that run programs on explicit axes, on the ``auto-vs-explicit`` pair."""


def _on_explicit_axes(
    reason: str,
    checks: tuple[str, ...] = _ON_THE_EXPLICIT_PAIR,
    shows: str | None = None,
    **narrowed: Any,
) -> tuple[Divergence, ...]:
    """``reason`` for each of ``checks`` on the ``auto-vs-explicit`` pair, as ``narrowed``.

    The ``explicit_sharding`` check, which runs on no pair, is narrowed without one;
    it and ``cost``, which run on the primary mesh alone, without a mesh. Each failure must
    contain ``shows``, if given.
    """
    on_pair = {**narrowed, "pair": "auto-vs-explicit"}
    where = {
        "explicit_sharding": {name: value for name, value in narrowed.items() if name != "mesh"},
        "cost": {name: value for name, value in on_pair.items() if name != "mesh"},
    }
    return tuple(Divergence(check, reason, where.get(check, on_pair), shows) for check in checks)


def _resumed_on_explicit_axes(reason: str, shows: str) -> tuple[Divergence, ...]:
    """``reason`` for the checks run in the preferred (scanned) layout alone, explicitly."""
    return tuple(
        Divergence(check, reason, {"pair": "auto-vs-explicit"}, shows)
        for check in _IN_THE_PREFERRED_LAYOUT
    )


_SCAN_UNTRACED = (
    "on explicit axes (shard_mode: explicit) maxtext 0.2.5's scanned layers do not trace: "
    "the layer scan (layers/nnx_decoders.py, _apply_layers_sequentially) raises TypeError "
    "'scan body function carry input and carry output must have equal types': a layer "
    "returns the residual stream without the layout it was given (8@(data,fsdp) x 16 x "
    "64@tensor in, whole out). Unrolled layers trace"
)
_EXPLICIT_SCAN = _on_explicit_axes(
    _SCAN_UNTRACED, ("explicit_sharding", *_ON_THE_EXPLICIT_PAIR), _CARRY_TYPES, **_SCAN
)
_LAYOUTS_UNRESOLVED = (
    "a harness limit, not a MaxText finding: on auto axes MaxText's activation "
    "constraints resolve to nothing in the harness (they read flax's logical_axis_rules "
    "context, which the harness does not enter), so the compiler lays the embedding out "
    "whole and splits the query projection over tensor; on explicit axes MaxText's "
    "out_shardings lay them out as its rules say (the embedding "
    "P(('data', 'fsdp'), None, 'tensor'), the query projection whole)"
)
_EXPLICIT_LAYOUTS = _on_explicit_axes(
    _LAYOUTS_UNRESOLVED, ("explicit_sharding", "activation_sharding"), **_LOOP
)
_EXPLICIT_KV_CACHE = _on_explicit_axes(
    "on explicit axes maxtext 0.2.5's autoregressive KV-cache update "
    "(inference/kvcache.py, update_ar_key_value) raises ShardingTypeError: "
    "dynamic_update_slice of the cache, its heads split over tensor "
    "(float32[8,2@tensor,8,16]), by a whole update (float32[1,2,8,16]). On fsdp8, where "
    "nothing splits the heads, decoding on explicit axes agrees with auto axes",
    ("decode", "cost"),
    **_LOOP,
    **_MESH3,
)
_NORM_UNALIGNED = (
    "on explicit axes deepseek3's RMSNorm (layers/normalizations.py:129, called by "
    "pre_attention_norm_op in models/deepseek.py) raises ShardingTypeError: its einsum "
    "'...k,k->...k' takes the activations split over tensor on k and the scale whole "
    "('dot_general requires lhs batch dimensions and rhs batch dimensions to have the same "
    "sharding, got ('tensor',) and (None,)'). models/deepseek.py builds its RMSNorms "
    "without shard_mode (llama2.py passes config.shard_mode), so they skip aligning the "
    "scale with the normalised axis; with it passed, the dense MoE's wo einsum "
    "(layers/moe.py, dense_matmul) raises next: contracting dimensions split over tensor "
    "on both operands, no out_sharding. On fsdp8 deepseek3 agrees with auto axes"
)
_EXPLICIT_NORM = _on_explicit_axes(_NORM_UNALIGNED, shows=_BATCH_SHARDING, **_LOOP, **_MESH3)
_NORM_FIRST = "with scanned layers too, the explicit side raises first at deepseek3's RMSNorm: "
_EXPLICIT_SCANNED_NORM = _on_explicit_axes(
    _NORM_FIRST + _NORM_UNALIGNED,
    ("explicit_sharding", *_ON_THE_EXPLICIT_PAIR),
    _BATCH_SHARDING,
    **_SCAN,
    **_MESH3,
)


def _releases(
    found: tuple[Divergence, ...],
    only: Mapping[str, tuple[Divergence, ...]] = MappingProxyType({}),
    tree_mode: tuple[Divergence, ...] = _TREE_MODE_LAYER,
) -> Mapping[str, tuple[Divergence, ...]]:
    """Known divergences by maxtext release: ``found`` on every release, then ``only``'s.

    0.2.4's vocab-tiling bug is 0.2.4's alone (0.2.5 fixed it in NNX and deleted the Linen
    tiled loss, which its bridged Linen side cannot replace). Tree mode cannot build any
    0.2.4 model, nor a 0.2.5 one whose layers share an nnx.Rngs (``tree_mode``).
    """
    tiling = {"0.2.4": _VOCAB_TILING, "0.2.5": _VOCAB_TILING_BRIDGED}
    tree = {"0.2.4": _TREE_MODE_0_2_4, "0.2.5": tree_mode}
    return MappingProxyType(
        {
            release: (tiling[release], *tree[release], *found, *only.get(release, ()))
            for release in tiling
        }
    )


_TINY = MappingProxyType(
    {"base_num_decoder_layers": 2, "vocab_size": 256, "matmul_precision": "highest"}
)
"""The device size: two layers, a small vocabulary, and float32 matmuls for the numbers
the CPU compares. A production size keeps MaxText's default matmul precision, as
production compiles it (libtpu's Mosaic refuses the sparse MoE's ``gmm`` kernel asked
for float32 contraction of bfloat16 operands)."""
_SMALL_ATTENTION = MappingProxyType(
    {
        "base_emb_dim": 64,
        "base_num_query_heads": 4,
        "base_num_kv_heads": 2,
        "base_mlp_dim": 128,
        "head_dim": 16,
    }
)


class MaxTextGpt3(MaxTextFamily):
    """``gpt3-52k`` with two layers: learned positions, fused QKV with biases, tied logits."""

    name = "maxtext-gpt3"
    model_name = "gpt3-52k"
    sizes = ("tiny", "gpt3-175b")
    overrides = MappingProxyType({})
    explicit_axes = False
    unsupported = MappingProxyType(
        {
            "explicit_sharding": "maxtext 0.2.5 refuses shard_mode: explicit for its gpt3 "
            "decoder (configs/types.py: \"Decoder 'gpt3' is not supported with 'explicit' "
            'sharding"), so there is no explicit side to compare'
        }
    )
    divergences = _releases(
        (
            Divergence("grad_accumulation", _BF16_ATTEND),
            *_ptq_divergences("self_attention/{qkv_proj,out}/kernel and mlp/{wi,wo}/kernel"),
            Divergence(
                "layout",
                "the key bias of the fused qkv_proj has a zero true gradient (softmax "
                "ignores a per-query shift), so its gradient is rounding noise, which Adam "
                "scales to steps of up to the learning rate; the noise, and so the step, "
                "differs between remat policies and between scanned and unrolled layers",
            ),
        ),
        {
            "0.2.5": (
                Divergence(
                    "sharding_invariance",
                    "on data2-fsdp2-tensor2 with scanned layers one element of the "
                    "token-embedding gradient is 1.061e-5 from one device's (atol 1e-5), on "
                    "both backends alike: "
                    + _BF16_ROUNDED
                    + ", and another reduction order moves it by a rounding step (one that "
                    "neither of the check's one-ulp parameter nudges reproduces there)",
                    {**_MESH3, **_SCAN},
                ),
            ),
        },
    )

    def features(self) -> Sequence[Feature]:
        """MaxText's features, with ``gpt3-175b`` compiled for 256 v5p chips.

        At 175B, parameters, gradients and Adam state in float32 are about 2.8 TB: 44 GB
        per chip on the default production slice's 64 before any temporary, and libtpu
        asks "143G" of temporaries there for the rematerialised step, over v5p's 95.
        """
        return (*super().features(), Topologies({"gpt3-175b": "v5p:8x8x4"}))


class MaxTextLlama2(MaxTextFamily):
    """A tiny ``llama2-7b``: 64 wide, 4 query and 2 key/value heads, SwiGLU."""

    name = "maxtext-llama2"
    model_name = "llama2-7b"
    sizes = ("tiny", "llama2-70b", "llama3.1-70b")
    production = MappingProxyType(
        {"llama2-70b": {"num_vocab_tiling": 4}, "llama3.1-70b": {"num_vocab_tiling": 4}}
    )
    overrides = _SMALL_ATTENTION
    divergences = _releases(
        (
            *_ptq_divergences(
                "self_attention/{query,key,value,out}/kernel and mlp/{wi_0,wi_1,wo}/kernel"
            ),
        ),
        {
            "0.2.4": (
                _TILED_PRODUCTION_0_2_4,
                Divergence(
                    "grad_accumulation",
                    "scanned layers: loss and gradients agree; one Adam-updated element of "
                    "self_attention/out/kernel is 1.9e-5 apart (atol 1e-5): its gradient is "
                    "near zero, and Adam scales that rounding noise up to a step",
                    _SCAN,
                ),
            ),
            "0.2.5": (
                _TILED_PRODUCTION_BRIDGED,
                *_EXPLICIT_SCAN,
                *_EXPLICIT_LAYOUTS,
                *_EXPLICIT_KV_CACHE,
                *_resumed_on_explicit_axes(_SCAN_UNTRACED, _CARRY_TYPES),
            ),
        },
        _TREE_MODE_DECODER,
    )


class MaxTextDeepseek3(MaxTextFamily):
    """``deepseek3-tiny`` cut to 2 layers: 1 dense and 1 MoE layer of 4 experts, MLA."""

    name = "maxtext-deepseek3"
    model_name = "deepseek3-tiny"
    sizes = ("tiny", "deepseek3-671b")
    production = MappingProxyType({"deepseek3-671b": {"mla_naive_kvcache": False}})
    overrides = MappingProxyType(
        {
            "first_num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            # MaxText's own decode test serves MLA from the compressed cache.
            "mla_naive_kvcache": False,
            # The sparse (ragged-dot) MoE path does not trace on a mesh with tensor
            # parallelism in maxtext 0.2.4: the routed experts' output keeps the
            # tensor-split embedding (1, 16, 32) while the shared expert's is whole
            # (1, 16, 64). The dense path runs on every mesh.
            "sparse_matmul": False,
        }
    )
    divergences = _releases(
        (
            *_ptq_divergences(
                "self_attention/{wq_a,wq_b,wkv_a,wkv_b,out}/kernel, the dense mlp/{wi_0,wi_1,wo}"
                "/kernel, the MoE gate/kernel and shared_experts/{wi_0,wi_1,wo}/kernel"
            ),
            Divergence(
                "sharding_invariance",
                _PARTITIONED.format(gap=0.11, leaf="self_attention/wkv_a/kernel"),
                _MESH3,
            ),
        ),
        {
            "0.2.4": (
                *(
                    Divergence(check, _MOE_AQT_CALL)
                    for check in ("aqt_forward", "aqt_train_step", "aqt_convert", "aqt_serve")
                ),
                Divergence("aqt_layout", _MOE_AQT_LAYOUT, shows=_HOISTED),
                Divergence("fp8_train_step", _MOE_FP8),
                Divergence(
                    "grad_accumulation",
                    "4 micro-batches against the whole batch: "
                    + _PARTITIONED.format(gap=0.11, leaf="self_attention/wkv_a/kernel"),
                ),
                Divergence(
                    "tpu_compile",
                    "on v5p:8x8x16 (data=2, fsdp=512) maxtext 0.2.4's rematerialised "
                    "deepseek3-671b step needs 116.07 GiB per chip on both sides, 21.07 GiB "
                    "over v5p's 95 (maxtext 0.2.5's: 90.30 GiB); the forward and the decode "
                    "call fit",
                    {"tpu": "deepseek3-671b-v5p-8x8x16-data2-fsdp512-scan"},
                ),
            ),
            "0.2.5": (
                Divergence("aqt_forward", _MOE_AQT_BRIDGED, _LOOP, _STATIC_STATE),
                Divergence("aqt_train_step", _MOE_AQT_BRIDGED, _LOOP, _STATIC_STATE),
                Divergence("aqt_convert", _MOE_AQT_BRIDGED, shows=_STATIC_STATE),
                Divergence("aqt_serve", _MOE_AQT_BRIDGED, shows=_STATIC_STATE),
                # Both layouts: aqt_layout builds the serve mode (before aqtp's scanned
                # frozen names, the library's known failure, are reached).
                Divergence("aqt_layout", _MOE_AQT_BRIDGED, shows=_STATIC_STATE),
                Divergence(
                    "grad_accumulation",
                    "4 micro-batches against the whole batch: "
                    + _PARTITIONED.format(gap=0.11, leaf="self_attention/wkv_a/kernel"),
                    _MESH3,
                ),
                *_EXPLICIT_NORM,
                *_EXPLICIT_SCANNED_NORM,
                # The layer scan's finding where the RMSNorm's does not come first: on
                # fsdp8, where nothing splits over tensor (the primary mesh's checks,
                # explicit_sharding and cost, raise at the RMSNorm).
                *_on_explicit_axes(
                    _SCAN_UNTRACED,
                    tuple(c for c in _ON_THE_EXPLICIT_PAIR if c != "cost"),
                    _CARRY_TYPES,
                    **_SCAN,
                    mesh="fsdp8",
                ),
                *_resumed_on_explicit_axes(_NORM_FIRST + _NORM_UNALIGNED, _BATCH_SHARDING),
                *_on_explicit_axes(
                    "on data=2,fsdp=2,tensor=2 the explicit side raises first, at "
                    "deepseek3's RMSNorm (as forward does on the auto-vs-explicit pair); on "
                    "fsdp8 the layouts differ: " + _LAYOUTS_UNRESOLVED,
                    ("explicit_sharding",),
                    **_LOOP,
                ),
                *_on_explicit_axes(
                    _LAYOUTS_UNRESOLVED, ("activation_sharding",), **_LOOP, mesh="fsdp8"
                ),
            ),
        },
    )

    def features(self) -> Sequence[Feature]:
        """MaxText's features, with the load-balancing loss on in :meth:`aux_losses_config`.

        At 671B, parameters and Adam state in float32 are about 126 GB per chip on the
        default production slice's 64, and on 256 chips libtpu asks "152G" of temporaries
        for the rematerialised step, over v5p's 95: the size compiles for 1,024 v5p chips
        (``v5p:8x8x16``), on ``data`` and ``fsdp`` only. MaxText's sparse MoE path does not
        trace with tensor parallelism (see ``sparse_matmul`` in :attr:`overrides`): on a
        ``tensor`` axis of 2 the decoder adds a tensor-split (rows, 16, 3584) to a whole
        (rows, 16, 7168).
        """
        return (
            *super().features(),
            AuxLosses(("moe_lb_loss",), self.aux_losses_config),
            Topologies({"deepseek3-671b": "v5p:8x8x16=data=2,fsdp=512"}),
        )

    def aux_losses_config(self, config: MaxTextConfig) -> MaxTextConfig:
        """``config`` with MaxText's load-balancing loss on (``load_balance_loss_weight``).

        DeepSeek-V3 balances its experts through the routing bias and ships with the loss
        off (``base.yml``: 0.0), as this family's other checks run it. On here, each MoE
        layer sows ``moe_lb_loss``, on the path where MaxText's scanned-layer
        load-balancing loss once went wrong (#4829).
        """
        return dataclasses.replace(
            config, overrides=(*config.overrides, ("load_balance_loss_weight", 0.01))
        )


class MaxTextGemma2(MaxTextFamily):
    """A tiny ``gemma2-2b``: local (sliding window 4) and global attention, soft caps.

    One decoder layer: MaxText's gemma2 layer is a local then a global attention block
    (``base_num_decoder_layers`` counts pairs), so one holds both kinds. A second pair
    doubled the cost of every unrolled-layer test; the other families' two layers cover
    layer stacking.
    """

    name = "maxtext-gemma2"
    model_name = "gemma2-2b"
    sizes = ("tiny", "gemma2-27b")
    overrides = MappingProxyType(
        {**_SMALL_ATTENTION, "sliding_window_size": 4, "base_num_decoder_layers": 1}
    )
    divergences = _releases(
        (
            *_ptq_divergences(
                "self_attention_{local,global}/{query,key,value,out}/kernel and "
                "mlp_{local,global}/{wi_0,wi_1,wo}/kernel"
            ),
            Divergence(
                "grad_accumulation",
                "4 micro-batches against the whole batch: "
                + _PARTITIONED.format(gap=0.15, leaf="self_attention_local/query/kernel")
                + "; on fsdp=8, "
                + _BF16_ATTEND,
            ),
            Divergence(
                "decode_consistency",
                "MaxText's sliding-window mask in autoregressive mode "
                "(layers/attention_op.py) compares cache slots (8 prefill slots, then the "
                "generated ones), not positions, so a local-attention layer's window is wrong "
                "for every right-padded row: decode step 0 differs from the full forward in "
                "every row by up to 3.6 in the logits, on both backends alike (decode itself "
                "agrees)",
            ),
            Divergence(
                "sharding_invariance",
                _PARTITIONED.format(gap=0.15, leaf="self_attention_local/query/kernel"),
                _MESH3,
            ),
        ),
        {
            "0.2.4": (
                Divergence(
                    "layout",
                    "scanned against unrolled layers: "
                    + _PARTITIONED.format(gap=0.15, leaf="self_attention_local/query/kernel"),
                    {**_MESH3, "variant": "scan_layers"},
                ),
            ),
            "0.2.5": (
                *_EXPLICIT_SCAN,
                *_EXPLICIT_LAYOUTS,
                *_EXPLICIT_KV_CACHE,
                *_resumed_on_explicit_axes(_SCAN_UNTRACED, _CARRY_TYPES),
                *_on_explicit_axes(
                    "a partitioning problem of the auto side, not of explicit axes: "
                    + _PARTITIONED.format(gap=0.12, leaf="self_attention_local/query/kernel")
                    + ". The attribution agrees: on auto axes the step differs from itself "
                    "on one device, on explicit axes it does not, and the two agree there",
                    ("train_step",),
                    **_LOOP,
                    **_MESH3,
                ),
            ),
        },
    )
