"""The ``moe`` family: a small mixture-of-experts decoder written for Linen and for NNX."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

from conformance.families import (
    AuxLosses,
    Bridges,
    ExplicitSharding,
    Feature,
    LogicalRules,
    TreeMode,
)
from conformance_models.common import LOGICAL_AXIS_RULES
from conformance_models.moe import linen_model, nnx_model
from conformance_models.moe.config import MoeConfig
from conformance_models.moe.routing import AUX_LOSS
from conformance_models.transformer_family import TransformerFamily


class MoeFamily(TransformerFamily):
    """Llama's attention and a routed mixture of SwiGLU experts, with a load-balancing loss.

    Its experts' kernels are stacked on the logical axis ``expert``, which shards over
    the ``data`` mesh axis (experts spread over the data-parallel replicas, as GShard
    places them), so its sharding goldens show expert parallelism. Each layer sows
    ``moe_lb_loss``, which the train step adds to the loss (``aux_losses``).
    """

    name = "moe"
    train_rngs = ()
    unsupported: Mapping[str, str] = MappingProxyType(
        {"scan_layers": "kept small: one layer layout, a Python list of blocks"}
    )

    def features(self) -> Sequence[Feature]:
        """Its load-balancing loss, no bridge, and NNX tree mode.

        Unlike the other transformers, one layer layout (``unsupported`` says why) and no
        decoding.
        """
        return (AuxLosses((AUX_LOSS,)), Bridges(linen=0, nnx=0), TreeMode(), ExplicitSharding())

    base_configs: ClassVar[dict[str, MoeConfig]] = {
        "tiny": MoeConfig(
            vocab_size=256,
            d_model=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            mlp_dim=64,
            max_seq_len=32,
            scan_layers=False,
            norm_eps=1e-6,
            num_experts=4,
        ),
    }
    sizes = tuple(base_configs)
    linen_decoder = linen_model.Moe
    nnx_decoder = nnx_model.Moe

    def logical_axis_rules(self) -> LogicalRules:
        """The built-in rules, with ``expert`` on the ``data`` mesh axis."""
        return (("expert", "data"), *LOGICAL_AXIS_RULES)
