"""Teacher forcing: a generation fed another's tokens decodes exactly those tokens.

bfloat16 ``decode`` feeds NNX Linen's greedy tokens, so that a near tie rounding breaks
the other way cannot part the two sequences. Both decode styles are covered: a prefill
then a token per row (llama) and token by token from position 0 (the Flax-style toy).
"""

import numpy as np
import pytest

from conformance import families
from conformance.core.scope import Scope
from conformance.core.sharding import parse_mesh
from conformance.runtime.case import Case
from conformance.runtime.generation import prompt_only
from conformance.runtime.sides import live_pair
from tests.contract.toyzoo.families import ToyLm

STEPS = 3
MESH = parse_mesh("data=2,fsdp=2,tensor=2")


@pytest.mark.parametrize("model", [families.get("llama"), ToyLm()], ids=["prefill", "by-token"])
def test_forced_tokens_are_what_the_decoder_is_fed(model):
    with Scope():
        side = live_pair(Case.of(model, mesh=MESH, devices=MESH.devices()))[1]
        params = side.init()
        greedy = side.generate(params, STEPS)
        again = side.generate(params, STEPS, forced=greedy.tokens)
        np.testing.assert_array_equal(again.tokens, greedy.tokens)
        np.testing.assert_array_equal(again.step_logits, greedy.step_logits)

        other = (greedy.tokens + 1) % greedy.step_logits.shape[-1]
        forced = side.generate(params, STEPS, forced=other)
        np.testing.assert_array_equal(forced.tokens, other)
        prompts = (prompt_only(g.prefill_logits, g.lengths) for g in (forced, greedy))
        np.testing.assert_array_equal(*prompts)
        assert not np.allclose(forced.step_logits[-1], greedy.step_logits[-1])
