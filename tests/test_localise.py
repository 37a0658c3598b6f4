from conformance.contract import Split
from conformance.runtime.diagnose.localise import module_pairs

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
