"""State hygiene outside training: forwards leave the NNX model's state as it was built."""


def test_state_hygiene(conformance_case):
    conformance_case.run()
