"""NNX RNG streams are kept out of train states: listed, redrawn per step, nothing else hidden."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conformance import families
from conformance.contract import AuxLosses, Bridges, PersistentState, with_features
from conformance.core.sharding import parse_mesh
from conformance.runtime.objective import target_weights
from conformance.runtime.train_state import flat_state, step_streams
from conformance.runtime.training import linen_trainer, nnx_trainer
from conformance_models.llama.family import LlamaFamily
from conformance_models.moe.routing import AUX_LOSS
from tests.faults.training import MoeLossWeightedOff, StrayCounterBesideRngs
from tests.suite_run import run_check


def _dropout_config():
    family = families.get("gpt3")
    return family, dataclasses.replace(family.config("tiny", scan_layers=False), dropout_rate=0.1)


def test_rng_streams_are_listed_and_left_out_of_the_train_state():
    family, config = _dropout_config()
    trainer = nnx_trainer(family, config)
    streams = trainer.runner.rng_streams
    assert streams, "gpt3 with dropout should carry RNG streams"
    assert all(p.endswith(("/key", "/count")) for p in streams)
    state = flat_state(trainer.abstract_state)
    assert not [p for p in state if p.removeprefix("model/") in streams]
    linen_leaves = len(jax.tree.leaves(linen_trainer(family, config).abstract_state))
    assert len(state) == linen_leaves


def test_step_streams_are_a_function_of_the_step_alone():
    family, config = _dropout_config()
    abstract = nnx_trainer(family, config).abstract_streams

    def keys(step):
        leaves = jax.tree.leaves(step_streams(abstract, np.uint32(step)))
        return [
            np.asarray(jax.random.key_data(x))
            for x in leaves
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        ]

    first, again, second = keys(0), keys(0), keys(1)
    assert first
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not any(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert len({a.tobytes() for a in first}) == len(first), "streams must not share a key"
    counts = [
        x for x in jax.tree.leaves(step_streams(abstract, np.uint32(3))) if x.dtype == "uint32"
    ]
    assert counts
    assert all(int(c) == 0 for c in counts)


def test_fp8_state_holds_the_same_overwrite_values_on_both_sides():
    family = families.get("llama")
    config = family.fp8_config(family.config("tiny", scan_layers=False))
    linen, nnx_ = linen_trainer(family, config), nnx_trainer(family, config)
    overwrite = {p for p in flat_state(nnx_.abstract_state) if "Fp8DirectDotGeneralOp_0" in p}
    assert len(overwrite) == len(linen.overwrite) == 6 * 15  # 7 projections x 2 layers + head
    assert len(flat_state(nnx_.abstract_state)) == len(jax.tree.leaves(linen.abstract_state))


@pytest.mark.parametrize("trainer", [linen_trainer, nnx_trainer])
def test_fp8_refuses_micro_batches(trainer):
    family = families.get("llama")
    config = family.fp8_config(family.config("tiny", scan_layers=False))
    with pytest.raises(ValueError, match="cannot accumulate gradients over micro-batches"):
        trainer(family, config, 4)


class CounterDeclaredPersistent(StrayCounterBesideRngs):
    """The stray counter of the hygiene fault, declared persistent model state."""

    def features(self):
        return with_features(super().features(), PersistentState(lambda: (nnx.BatchStat,)))


def test_hygiene_accepts_declared_persistent_state(tmp_path):
    run_check(
        "hygiene", CounterDeclaredPersistent(), tmp_path, parse_mesh("data=2,fsdp=2,tensor=2")
    )


def test_the_loss_trains_on_the_positions_whose_predicted_token_is_real():
    """Next-token logits skip each row's last real position; current-token ones do not."""
    segments = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
    zeros = np.zeros_like(segments)
    batch = families.Batch(zeros, zeros, segments, zeros)
    expected = {
        "next": [[1, 1, 0, 0], [1, 1, 1, 0]],
        "current": [[1, 1, 1, 0], [1, 1, 1, 1]],
    }
    for predicts, weights in expected.items():
        np.testing.assert_array_equal(target_weights(batch, predicts), weights)


class _Built:
    """``family.nnx_module(config, rngs)`` as the class a ``ToLinen`` bridge builds."""

    def __init__(self, family, config):
        self.family, self.config = family, config

    def __call__(self, rngs):
        with nnx.use_eager_sharding(False):  # the harness places the parameters
            return self.family.nnx_module(self.config, rngs)


class CounterBridgedToLinen(LlamaFamily):
    """Linen is the NNX model behind Flax's ``ToLinen`` (as MaxText 0.2.5's Linen is), and
    the model holds a declared persistent counter beside its parameters."""

    def features(self):
        persistent = PersistentState(lambda: (nnx.BatchStat,))
        return with_features(super().features(), Bridges(linen=1, nnx=0), persistent)

    def nnx_module(self, config, rngs):
        model = super().nnx_module(config, rngs)
        model.calls = nnx.BatchStat(jnp.full((), 7, jnp.int32))
        return model

    def linen_module(self, config):
        return nnx.bridge.to_linen(_Built(self, config))

    def path_rules(self, config):
        del config
        return ()


def test_both_train_states_keep_declared_persistent_state_and_agree(tmp_path):
    family = CounterBridgedToLinen()
    config = family.config("tiny", scan_layers=True)  # the bridge takes no integer keys
    linen, nnx_ = linen_trainer(family, config), nnx_trainer(family, config)
    assert linen.kinds["model/calls"] == nnx_.kinds["model/calls"] == "BatchStat"
    assert set(linen.kinds) == set(nnx_.kinds)
    run_check("train_step", family, tmp_path, parse_mesh("fsdp=8"), scan_layers=True)


class MoeLossWeightedOn(MoeLossWeightedOff):
    """The planted weight-0 moe whose feature turns its loss on for ``aux_losses``."""

    def features(self):
        return (AuxLosses((AUX_LOSS,), self.loss_on),)

    def loss_on(self, config):
        return dataclasses.replace(config, lb_weight=0.01)


def test_aux_losses_trains_the_config_of_the_family_feature(tmp_path):
    """Benign: a family whose loss is on only in its ``AuxLosses.config`` passes."""
    run_check("aux_losses", MoeLossWeightedOn(), tmp_path, parse_mesh("data=2,fsdp=2,tensor=2"))


def test_grad_accumulation_runs_where_the_own_config_sows_no_auxiliary_loss():
    from conformance.checks import registry

    requires = registry.get("grad_accumulation").requires
    assert "sows auxiliary losses" in requires(MoeLossWeightedOff())
    assert requires(MoeLossWeightedOn()) is None
