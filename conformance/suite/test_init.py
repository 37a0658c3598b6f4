"""Init: both sides' initialisers agree in distribution, per leaf."""

from conformance.checks import check_init


def test_init(family, mesh, scan_layers, device_mesh):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_init(family, config, mesh, device_mesh)
