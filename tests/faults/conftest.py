import pytest

from conformance.core.scope import Scope


@pytest.fixture(autouse=True)
def released():
    """Each fault builds its own family: release its compiled programs after it."""
    with Scope():
        yield


def pytest_terminal_summary(terminalreporter, config):
    def planted(outcome):
        return [
            r
            for r in terminalreporter.stats.get(outcome, [])
            if "test_fault_is_caught" in r.nodeid and r.when in ("call", "setup")
        ]

    run = [r for r in planted("passed") + planted("failed") if r.when == "call"]
    not_run = planted("skipped")
    if run or not_run:
        caught = sum(r.passed for r in run)
        tier = config.getoption("conformance_tier")
        line = f"planted faults caught: {caught}/{len(run)} at tier {tier}"
        terminalreporter.write_line(line + (f"; {len(not_run)} not run" if not_run else ""))
