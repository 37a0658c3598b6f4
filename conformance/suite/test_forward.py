"""Forward: logits agree after transplanting parameters in both directions."""

import jax.numpy as jnp

from conformance.checks import check_forward


def test_forward(family, mesh, scan_layers, dtype, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers, dtype=dtype)
    wider = (
        None if dtype == jnp.float32 else family.config(family.device_size, scan_layers=scan_layers)
    )
    check_forward(family, config, mesh, device_mesh, reference_config=wider)
