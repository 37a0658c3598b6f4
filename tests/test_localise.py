import ml_dtypes
import numpy as np

from conformance.contract import Split
from conformance.runtime.diagnose.localise import (
    Call,
    Divergence,
    Recorder,
    first_divergence,
    module_pairs,
)

RULES = ((r"^layers_(\d+)/", r"layers/\1/"),)
LEAVES = tuple(
    {
        "embed/embedding": "embed/embedding",
        "layers_0/norm/scale": "layers/0/norm/scale",
        "layers_0/mlp/wi/kernel": "layers/0/mlp/wi/kernel",
        "layers_0/mlp/wo/kernel": "layers/0/mlp/wo/kernel",
    }.items()
)


def test_modules_pair_through_the_parameters_they_hold():
    linen = ["", "embed", "layers_0", "layers_0/norm", "layers_0/mlp", "layers_0/mlp/wi"]
    nnx = ["", "embed", "layers/0", "layers/0/norm", "layers/0/mlp", "layers/0/mlp/wi"]
    assert module_pairs(LEAVES, RULES, linen, nnx) == dict(zip(linen, nnx, strict=True))


def test_a_module_without_parameters_pairs_by_the_path_rules_or_its_own_path():
    linen = ["layers_0/act", "dropout", "layers_0/gone"]
    nnx = ["layers/0/act", "dropout"]
    assert module_pairs(LEAVES, RULES, linen, nnx) == {
        "layers_0/act": "layers/0/act",
        "dropout": "dropout",
    }


def test_a_module_whose_parameters_split_across_nnx_modules_has_no_pair():
    leaves = [("mlp/wi/kernel", "up/kernel"), ("mlp/wo/kernel", "down/kernel"), ("e/w", "e/w")]
    assert module_pairs(leaves, (), ["mlp"], ["up", "down", "e", ""]) == {}


def test_a_split_leaf_pairs_its_module_with_the_module_holding_every_slice():
    leaves = [("mlp/wi/kernel", "mlp/wi_0/kernel"), ("mlp/wi/kernel", "mlp/wi_1/kernel")]
    split = (Split(r"/wi/kernel$", ("/wi_0/kernel", "/wi_1/kernel")),)
    assert module_pairs(leaves, split, ["mlp", "mlp/wi"], ["mlp", "mlp/wi_0"]) == {"mlp": "mlp"}


def test_a_wrapper_and_its_one_child_leave_the_child_paired_with_its_namesake():
    leaves = [("attn/q/kernel", "attn/q/kernel")]
    assert module_pairs(leaves, (), ["attn", "attn/q"], ["attn", "attn/q"]) == {"attn/q": "attn/q"}


def _recorded(calls: dict[str, tuple[list[np.ndarray], list[np.ndarray]]]) -> Recorder:
    """A recorder holding one ``__call__`` per module, in the order given."""
    recorder = Recorder(None)
    for order, (path, (inputs, outputs)) in enumerate(calls.items()):
        recorder.calls[(path, "__call__", 0)] = Call(order, inputs, outputs)
    return recorder


X = np.linspace(-2.0, 2.0, 64, dtype=np.float32).reshape(4, 16) + np.float32(1 / 3)
ROUNDED = X.astype(ml_dtypes.bfloat16)
NEXT = np.tanh(X)
NEXT_OF_ROUNDED = np.tanh(ROUNDED.astype(np.float32))
BLOCKS = (("layers_0/scale", "layers/0/scale"), ("layers_1/scale", "layers/1/scale"))


def test_a_module_rounding_to_bfloat16_is_named_not_the_next_one():
    """At bfloat16's tolerance the rounded output would agree and pass the blame on."""
    linen = _recorded({"layers_0": ([X], [X]), "layers_1": ([X], [NEXT])})
    nnx = _recorded({"layers/0": ([X], [ROUNDED]), "layers/1": ([ROUNDED], [NEXT_OF_ROUNDED])})
    found = first_divergence(linen, nnx, BLOCKS, RULES)
    assert isinstance(found, Divergence), found
    assert found.linen_call == ("layers_0", "__call__", 0)
    assert found.inputs_compared


def test_a_linen_layer_returning_carry_and_output_is_compared_on_the_carry():
    """``nn.scan``'s ``(carry, output)`` on one side, the carry alone on the other."""
    linen = _recorded({"layers_0": ([X], [X, X]), "layers_1": ([X], [NEXT, NEXT])})
    nnx = _recorded({"layers/0": ([X], [X + 1]), "layers/1": ([X + 1], [NEXT])})
    found = first_divergence(linen, nnx, BLOCKS, RULES)
    assert isinstance(found, Divergence), found
    assert found.linen_call == ("layers_0", "__call__", 0)
    assert "output[0]" in found.describe()
