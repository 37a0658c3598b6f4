"""AQT (aqtp) int8: TRAIN parity and error bound, CONVERT layout and parity, SERVE from orbax."""


def test_aqt_forward(conformance_case):
    conformance_case.run()


def test_aqt_train_step(conformance_case):
    conformance_case.run()


def test_aqt_layout(conformance_case):
    conformance_case.run()


def test_aqt_convert(conformance_case):
    conformance_case.run()


def test_aqt_serve(conformance_case):
    conformance_case.run()
