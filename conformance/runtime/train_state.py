"""The train state's layout, alike on both backends: its leaves, their kinds, RNG streams.

Both sides keep a persistent train state with the same canonical paths:
``model/<param path>``, ``optimizer/opt_state/<optax path>/<param path>`` and
``optimizer/step``. NNX models keep their RNG streams (``nnx.RngState``: a key and a
counter per stream) as variables; Linen takes them per call. The NNX train state leaves
them out, so both train states hold the same leaves: each step draws fresh streams from
its step counter (:func:`step_streams`), as the Linen step folds the step into a key per
stream of ``Family.train_rngs``, and a checkpoint holds no RNG streams on either side.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import NamedSharding, PartitionSpec

from conformance.core.trees import Flat, flatten, flatten_state
from conformance.runtime.backends import OVERWRITE

STREAMS_SEED = 0
"""Seed of the RNG streams a train step draws (folded with the step counter)."""

OverwriteWithGradient = variablelib.variable_type_from_name(OVERWRITE, allow_register=True)
"""The NNX Variable type of :data:`OVERWRITE` (what ``nnx.bridge`` makes of the collection)."""


def step_streams(abstract: nnx.State, step: jax.Array) -> nnx.State:
    """RNG streams for ``step`` shaped like ``abstract``: fresh keys, counters at zero.

    Each key leaf gets its own key, a function of its position and ``step`` only, so a
    step is deterministic and successive steps draw different dropout masks.
    """
    leaves, treedef = jax.tree.flatten(abstract)
    base = jax.random.fold_in(jax.random.key(STREAMS_SEED), step)
    streams = []
    for index, leaf in enumerate(leaves):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            key = jax.random.fold_in(base, index)
            streams.append(jax.random.split(key, leaf.shape) if leaf.shape else key)
        else:
            streams.append(jnp.zeros(leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, streams)


class NnxTrainState(nnx.Module):
    """The NNX train state: the model and its optimizer, split and merged as one."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation) -> None:
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


def state_kind(var: nnx.Variable) -> str:
    """A train-state leaf's kind, named alike on both backends.

    ``Param`` (Linen's ``params`` collection), ``OptState`` (optimizer state, the step
    counter included), :data:`OVERWRITE` (FP8 scales and amax histories), or the Variable
    type's own name for anything else (``MoEBiasVar``): a leaf that changes kind between
    releases has changed collection.
    """
    for kind in (OverwriteWithGradient, nnx.Param, nnx.OptState):
        if isinstance(var, kind):
            return OVERWRITE if kind is OverwriteWithGradient else kind.__name__
    return type(var).__name__


def flat_state(state: Any) -> Flat:
    """A train state or gradient tree (Linen dicts or NNX State) as ``{path: array}``."""
    if isinstance(state, nnx.State):
        return {p: v.get_value() for p, v in flatten_state(state).items()}
    return flatten(state)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())
