"""The header names what each side sows in training and the family does not declare."""

from conformance.core.scope import Scope
from conformance.runtime.sown import undeclared
from conformance_models.gpt3.family import Gpt3Family
from conformance_models.moe.family import MoeFamily


class MoeUndeclared(MoeFamily):
    """moe whose load-balancing loss is sown on both sides but not declared (planted)."""

    def features(self):
        return ()


def _undeclared(family):
    config = family.config(family.device_size, scan_layers=False)
    with Scope():
        return undeclared(family, config)


def test_an_undeclared_auxiliary_loss_is_named_on_each_side():
    assert _undeclared(MoeUndeclared()) == {"Linen": ["moe_lb_loss"], "NNX": ["moe_lb_loss"]}


def test_declared_losses_and_the_hidden_states_are_not_listed():
    assert _undeclared(MoeFamily()) == {"Linen": [], "NNX": []}
    assert _undeclared(Gpt3Family()) == {"Linen": [], "NNX": []}
