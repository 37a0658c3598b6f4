"""Train step: parity across backends, accumulation, layout variants, hygiene, dropout,
vocab tiling, FP8, auxiliary losses."""


def test_train_step(conformance_case):
    conformance_case.run()


def test_grad_accumulation(conformance_case):
    conformance_case.run()


def test_layout(conformance_case):
    conformance_case.run()


def test_hygiene(conformance_case):
    conformance_case.run()


def test_resume(conformance_case):
    conformance_case.run()


def test_resume_conversion(conformance_case):
    conformance_case.run()


def test_optimizer_sharding(conformance_case):
    conformance_case.run()


def test_dropout(conformance_case):
    conformance_case.run()


def test_vocab_tiling(conformance_case):
    conformance_case.run()


def test_fp8_train_step(conformance_case):
    conformance_case.run()


def test_aux_losses(conformance_case):
    conformance_case.run()
