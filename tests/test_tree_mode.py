"""The harness under flax's NNX tree-mode defaults (FLIP 5310).

``nnx_graph_mode=False`` and ``nnx_graph_updates=False`` are the defaults flax plans to
flip to. A zoo that flips them must still be testable: the harness's own training,
decoding and checkpoint code, and the built-in families, run under either.
"""

import flax
import pytest
from flax import nnx

from conformance import families
from conformance.core.environment import nnx_mode
from conformance.core.failure import CheckFailure
from conformance.core.scope import Scope
from conformance.core.sharding import LogicalRankError, parse_mesh, ranked
from conformance.core.trees import LeafSpec
from conformance_models.gpt3 import nnx_model as gpt3_nnx
from tests.suite_run import run_check

MESH = parse_mesh("data=2,fsdp=2,tensor=2")


@pytest.fixture
def tree_mode():
    """Every program traced in the test in NNX tree mode, in a scope of its own."""
    with Scope(), nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        yield


@pytest.mark.parametrize(
    ("name", "check", "params"),
    [
        ("gpt3", "layout", {"variant": "scan_layers"}),
        ("moe", "aux_losses", {}),
    ],
)
def test_checks_pass_in_tree_mode(tree_mode, tmp_path, name, check, params):
    """Stacked layers and the auxiliary losses' gradient work in tree mode.

    The harness's NNX train step (a ``DiffState`` gradient) and decoding run in tree mode
    in every ``graph-vs-tree`` test of ``train_step`` and ``decode``.
    """
    run_check(check, families.get(name), tmp_path, MESH, params=params)


def test_logical_names_must_cover_every_dimension():
    """A stacked leaf that lost its layer axis name is refused, not placed on wrong dims."""
    specs = {"kernel": LeafSpec((2, 4, 8), "float32"), "bias": LeafSpec((2, 8), "float32")}
    assert ranked({"kernel": ("layers", "embed", "mlp"), "bias": None}, specs)
    with pytest.raises(
        LogicalRankError, match=r"1 leaf\(s\) .*: kernel: shape \(2, 4, 8\), logical"
    ):
        ranked({"kernel": ("embed", "mlp"), "bias": ("layers", "mlp")}, specs)


def _stacked_by_vmap_metadata(block, config, rngs):
    """The built-ins' layer stack before tree mode: ``nnx.vmap``'s own ``transform_metadata``."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
        return block(config, rngs=rngs)

    return create(rngs)


def test_a_scanned_family_that_lost_its_layer_axis_is_reported(tree_mode, tmp_path, monkeypatch):
    """A stacked layer whose names lost ``layers`` (tree mode's ``nnx.vmap``) is a report."""
    monkeypatch.setattr(gpt3_nnx, "make_layers", _stacked_by_vmap_metadata)
    with pytest.raises(CheckFailure) as caught:
        run_check("forward", families.get("gpt3"), tmp_path, MESH, scan_layers=True)
    report = str(caught.value)
    assert report.startswith("gpt3 forward: NNX raised LogicalRankError while building the model")
    assert "layers/attn/out/bias: shape (2, 64), logical names ('embed',)" in report


@pytest.mark.parametrize(
    ("graph", "words"),
    [(True, "NNX graph mode"), (False, "NNX tree mode (nnx_graph_mode=False")],
)
def test_the_run_says_which_nnx_mode_it_traces_in(graph, words):
    before = flax.config.nnx_graph_mode
    flax.config.update("nnx_graph_mode", graph)
    try:
        assert nnx_mode().startswith(words)
    finally:
        flax.config.update("nnx_graph_mode", before)
