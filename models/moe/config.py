"""The configuration of the ``moe`` family."""

from __future__ import annotations

import dataclasses

from conformance_models.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class MoeConfig(TransformerConfig):
    """A :class:`TransformerConfig` whose blocks' MLPs are ``num_experts`` routed experts.

    ``mlp_dim`` is each expert's hidden width; ``lb_weight`` scales the load-balancing
    loss each layer sows.
    """

    num_experts: int = 4
    lb_weight: float = 0.01
