import collections

import pytest

from conformance.core.scope import Scope


@pytest.fixture(autouse=True)
def released():
    """Each variant's checks build their own models: release their programs after each."""
    with Scope():
        yield


def pytest_terminal_summary(terminalreporter, config):
    """``benign variants passed: N/M``: a variant passes when every check it ran passed."""
    outcomes: dict[str, list[bool]] = collections.defaultdict(list)
    for outcome in ("passed", "failed", "xfailed", "xpassed"):
        for report in terminalreporter.stats.get(outcome, []):
            if "test_variant_passes" in report.nodeid and report.when == "call":
                variant = report.nodeid.split("[", 1)[1].split("-", 1)[0]
                outcomes[variant].append(outcome in ("passed", "xpassed"))
    if outcomes:
        passed = sum(all(ran) for ran in outcomes.values())
        tier = config.getoption("conformance_tier")
        line = f"benign variants passed: {passed}/{len(outcomes)} at tier {tier}"
        terminalreporter.write_line(line)
