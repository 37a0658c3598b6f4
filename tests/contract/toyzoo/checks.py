"""A check of the zoo's own, registered through the ``conformance.checks`` entry point.

The zoo's models promise bounded logits at initialisation (its own invariant, not one
the harness knows): ``logits_bounded`` holds every live side to it, on each layer
layout, on the run's primary mesh. ``TOYZOO_LOGIT_BOUND`` overrides the bound, so the
contract test can show the check fail.
"""

import os

import jax.numpy as jnp

from conformance.checks.declare import Axis, declare
from conformance.core.failure import fail
from conformance.runtime.case import Case
from conformance.runtime.sides import live_sides

LOGIT_BOUND = 30.0
"""The largest |logit| the zoo's models may give from their initial parameters."""


@declare((Axis.FAMILY, Axis.SCAN_LAYERS), where="primary", pair=False)
def check_logits_bounded(case: Case) -> None:
    """Every live side's logits from its own initial parameters stay within the bound."""
    bound = float(os.environ.get("TOYZOO_LOGIT_BOUND", LOGIT_BOUND))
    batch = case.batch()
    for side in live_sides(case):
        logits, _ = side.forward(side.init(), batch)
        worst = float(jnp.max(jnp.abs(logits)))
        if worst > bound:
            fail(f"{side.name} logits reach |{worst:.4g}|, over the zoo's bound {bound:g}")
