"""Which dtypes each side computes in, and training in mixed precision.

``precision`` compares the two sides' precision profiles module by module before any
number (:mod:`conformance.runtime.precision`); ``bf16_train_step`` trains both in
bfloat16 compute with float32 parameters and optimizer state, as real zoos do, judged by
rounding rather than by a fixed tolerance.
"""

from __future__ import annotations

import jax.numpy as jnp

from conformance.checks.declare import Axis, declare
from conformance.checks.kernel import paired, precision_differences, train_step_parity
from conformance.contract import accepted_precision
from conformance.core.failure import fail_if_any
from conformance.runtime.case import Case
from conformance.runtime.sides import live_pair

_PRECISION_CAUSE = (
    "likely cause: a precision change (an operation computed, or a value passed, in "
    "another dtype), not a numeric divergence; a family that means it accepts it with "
    "Precision(accepted=(PrecisionChange(module, ops, reason),)) in its features"
)


@declare((Axis.FAMILY, Axis.SCAN_LAYERS), where="primary")
def check_precision(case: Case) -> None:
    """Each paired module computes in the same dtypes on both sides, in float32 and bfloat16.

    Both forwards are traced in each compute dtype, never run
    (:mod:`conformance.runtime.precision`): each module's ``dot_general`` operand and
    result dtypes, transcendental and reduction dtypes, and the floating-point dtypes its
    calls take and return must agree, unless the family's
    :class:`~conformance.contract.Precision` accepts the difference. An accepted change
    that covers no difference in either dtype fails too: it is stale or misspelt.
    """
    accepted = accepted_precision(case.family)
    rules = case.family.path_rules(case.bound)
    found, unused = [], list(accepted)
    for dtype in (jnp.float32, jnp.bfloat16):
        linen, nnx_ = live_pair(case.in_dtype(dtype))
        paired(linen, nnx_)
        left, missed = precision_differences(linen, nnx_, case.batch(), rules, accepted)
        unused = [change for change in unused if change in missed]
        found += [f"{jnp.dtype(dtype).name} compute: {d.describe()}" for d in left]
    if found:
        found.append(_PRECISION_CAUSE)
    found += [
        f"accepted change of {change.module} ({', '.join(change.ops)}: {change.reason}) "
        "matches no difference in float32 or bfloat16 compute: stale, or its pattern does "
        "not match the module a difference is reported at"
        for change in unused
    ]
    title = "precision profiles differ" if len(found) > len(unused) else "Precision is stale"
    fail_if_any(f"{title} ({case.layout} layout)", found)


@declare((Axis.FAMILY,), where="primary", variant=True)
def check_bf16_train_step(case: Case) -> None:
    """:func:`~conformance.checks.kernel.train_step_parity` in bfloat16 compute.

    Parameters and optimizer state stay float32 (MaxText's ``dtype: bfloat16`` with
    ``weight_dtype: float32``). On the primary mesh, in the family's preferred layout
    only: ``train_step`` covers the layouts in float32. Every leaf is held to the
    bfloat16 tolerance; a step beyond it passes when the float32 steps from the same
    parameters agree and each leaf's gap is within each side's own spread
    (:func:`~conformance.checks.kernel.spread_verdict`).
    """
    bf16, float32 = case.in_dtype(jnp.bfloat16), case.in_dtype(jnp.float32)
    train_step_parity(bf16, "bf16_train_step", float32)
