"""Each benign variant must pass every check listed for it: no false alarm.

Variants run through the check registry on the tier's primary mesh, as the planted
faults do, in float32 (the checks of ``IN_BFLOAT16`` in bfloat16 compute); a check the
tier leaves out (its quantization mode, bfloat16) is skipped as not run.
"""

import jax.numpy as jnp
import pytest

from conformance.core.failure import CheckFailure
from tests.benign.variants import IN_BFLOAT16, VARIANTS
from tests.suite_run import facets, run_check

CASES = [
    pytest.param(
        (variant, check, quant),
        marks=[pytest.mark.xfail(reason=why, raises=CheckFailure, strict=True)]
        if (why := variant.expected_failure(check, quant))
        else [],
    )
    for variant in VARIANTS
    for check, quant in variant.checks
]


def _id(case):
    variant, check, quant = case
    return f"{variant.name}-{check}" + (f"-{quant}" if quant else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_variant_passes(case, monkeypatch, tmp_path, tier, primary_mesh):
    variant, check, quant = case
    mesh, _ = primary_mesh
    dtype = jnp.bfloat16 if check in IN_BFLOAT16 else jnp.float32
    if reason := tier.leaves_out(variant.family, facets(mesh, quant, dtype=dtype)):
        pytest.skip(f"not run: tier {tier.name} leaves out {check} with {reason}")
    for patch in variant.patches:
        monkeypatch.setattr(*patch)
    run_check(check, variant.family, tmp_path, mesh, quant=quant, dtype=dtype)
