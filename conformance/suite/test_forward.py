"""Forward: logits agree after transplanting parameters in both directions."""


def test_forward(conformance_case):
    conformance_case.run()
