"""Qwix quantization (QAT, PTQ; int8, fp8): layouts, forward parity and error bounds, hygiene."""


def test_quant_params(conformance_case):
    conformance_case.run()


def test_quant_forward(conformance_case):
    conformance_case.run()


def test_quant_hygiene(conformance_case):
    conformance_case.run()


def test_quant_hygiene_topology(conformance_case):
    conformance_case.run()


def test_qat_train_step(conformance_case):
    conformance_case.run()


def test_quant_checkpoint(conformance_case):
    conformance_case.run()
