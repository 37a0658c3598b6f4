"""What each side sows in a training forward, found by tracing alone.

A value a model sows in training and the family does not declare
(:class:`~conformance.contract.AuxLosses`) reaches no check: an auxiliary
loss that a migration dropped from the objective, or silenced, goes unseen. The run's
header lists such values (:func:`undeclared`), so a reader sees what is not checked.
Nothing is computed: each side's training forward is traced with ``jax.eval_shape``.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import linen as nn
from flax import nnx

from conformance.contract import Family, aux_losses
from conformance.core.trees import flatten
from conformance.runtime.backends import HIDDEN_STATES, linen_runner, model_inputs, nnx_runner

KNOWN = (HIDDEN_STATES,)
"""Names the harness reads without a declaration: the blocks' hidden states."""


def _names(sown: Any) -> set[str]:
    """The name each sown value is kept under: its path's last part that is not an index.

    NNX keeps a sown tuple in an ``nnx.Intermediate``, whose content flattens under
    ``value`` (``layers/0/mlp/moe_lb_loss/value/0``); Linen keeps the tuple itself
    (``layers_0/mlp/moe_lb_loss/0``).
    """
    found = set()
    for path in flatten(sown):
        parts = [part for part in path.split("/") if not part.isdigit()]
        if len(parts) > 1 and parts[-1] == "value":
            parts.pop()
        if parts:
            found.add(parts[-1])
    return found


def linen_sown(family: Family, config: Any) -> set[str]:
    """The names Linen's training forward of ``config`` sows in ``intermediates``."""
    runner = linen_runner(family, config)
    variables = nn.meta.unbox(dict(runner.abstract_variables))
    rngs = {stream: jax.random.key(0) for stream in family.train_rngs}
    inputs = model_inputs(family.batch(config, 1))

    def forward(variables: Any) -> Any:
        _, state = runner.module.apply(
            variables, *inputs, rngs=rngs, mutable=["intermediates"], **family.train_kwargs(config)
        )
        return state.get("intermediates", {})

    return _names(jax.eval_shape(forward, variables))


def nnx_sown(family: Family, config: Any) -> set[str]:
    """The names NNX's training forward of ``config`` sows (``nnx.Intermediate``)."""
    runner = nnx_runner(family, config)
    graphdef, state = nnx.split(runner.abstract)
    inputs = model_inputs(family.batch(config, 1))

    def forward(state: Any) -> Any:
        model = nnx.merge(graphdef, state)
        _, sown = nnx.capture(model, nnx.Intermediate)(*inputs, **family.train_kwargs(config))
        return sown

    return _names(jax.eval_shape(forward, state))


def undeclared(family: Family, config: Any) -> dict[str, list[str]]:
    """``{"Linen": [...], "NNX": [...]}``: sown in training, neither declared nor known.

    A side the family does not have (Linen deleted) is left out.
    """
    declared = set(aux_losses(family)) | set(KNOWN)
    found = {"NNX": nnx_sown(family, config)}
    if family.has_linen:
        found = {"Linen": linen_sown(family, config), **found}
    return {side: sorted(names - declared) for side, names in found.items()}
