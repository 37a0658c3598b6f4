"""State hygiene outside training: forwards leave the NNX model's state as it was built."""

from conformance.state_checks import check_state_hygiene


def test_state_hygiene(family, scan_layers, shared_tmp_path):
    config = family.config(family.device_size, scan_layers=scan_layers)
    check_state_hygiene(family, config, shared_tmp_path, scan_layers=scan_layers)
