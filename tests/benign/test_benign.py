"""Each benign variant must pass every check listed for it: no false alarm.

Variants run through the check registry on the tier's primary mesh, as the planted
faults do, in float32 (the checks of ``IN_BFLOAT16`` in bfloat16 compute, those of
``IN_BOTH`` in both); a check the tier leaves out (its quantization mode, bfloat16) is
skipped as not run.
"""

import jax.numpy as jnp
import pytest

from conformance.core.failure import CheckFailure
from tests.benign.variants import VARIANTS, dtypes_of
from tests.suite_run import facets, run_check

CASES = [
    pytest.param(
        (variant, check, quant, dtype),
        marks=[pytest.mark.xfail(reason=why, raises=CheckFailure, strict=True)]
        if (why := variant.expected_failure(check, quant))
        else [],
    )
    for variant in VARIANTS
    for check, quant in variant.checks
    for dtype in dtypes_of(check)
]


def _id(case):
    variant, check, quant, dtype = case
    low = "-bf16" if dtype == jnp.bfloat16 else ""
    pair = f"-{variant.pair.id}" if variant.pair.id else ""
    return f"{variant.name}-{check}" + (f"-{quant}" if quant else "") + low + pair


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_variant_passes(case, monkeypatch, tmp_path, tier, primary_mesh):
    variant, check, quant, dtype = case
    mesh, _ = primary_mesh
    found = facets(mesh, quant, dtype=dtype, pair=variant.pair)
    if reason := tier.leaves_out(variant.family, found):
        pytest.skip(f"not run: tier {tier.name} leaves out {check} with {reason}")
    for patch in variant.patches:
        monkeypatch.setattr(*patch)
    run_check(check, variant.family, tmp_path, mesh, quant=quant, dtype=dtype, pair=variant.pair)
