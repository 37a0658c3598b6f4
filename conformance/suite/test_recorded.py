"""Recorded references: each live backend against what a backend computed when recorded."""


def test_recorded_forward(conformance_case):
    conformance_case.run()


def test_recorded_train_step(conformance_case):
    conformance_case.run()


def test_recorded_resume(conformance_case):
    conformance_case.run()


def test_recorded_decode(conformance_case):
    conformance_case.run()


def test_recorded_quant_forward(conformance_case):
    conformance_case.run()
