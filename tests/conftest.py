"""The harness's own tests: the catalogues' verdict lines, written where pytest-xdist's
controller runs them too (it loads no conftest below this one)."""

import collections

pytest_plugins = ["pytester"]


def pytest_terminal_summary(terminalreporter, config):
    """``planted faults caught: N/M`` and ``benign variants passed: N/M`` for the run."""
    tier = config.getoption("conformance_tier")
    for line in (_faults(terminalreporter.stats, tier), _benign(terminalreporter.stats, tier)):
        if line:
            terminalreporter.write_line(line)


def _faults(stats, tier):
    """A planted fault is caught when its test passes (the check failed where it should)."""
    planted = {
        outcome: [
            r
            for r in stats.get(outcome, [])
            if "test_fault_is_caught" in r.nodeid and r.when in ("call", "setup")
        ]
        for outcome in ("passed", "failed", "skipped")
    }
    run = [r for r in planted["passed"] + planted["failed"] if r.when == "call"]
    if not run and not planted["skipped"]:
        return ""
    caught = sum(r.passed for r in run)
    not_run = f"; {len(planted['skipped'])} not run" if planted["skipped"] else ""
    return f"planted faults caught: {caught}/{len(run)} at tier {tier}{not_run}"


def _benign(stats, tier):
    """A benign variant passes when every check it ran passed."""
    outcomes = collections.defaultdict(list)
    for outcome in ("passed", "failed", "xfailed", "xpassed"):
        for report in stats.get(outcome, []):
            if "test_variant_passes" in report.nodeid and report.when == "call":
                variant = report.nodeid.split("[", 1)[1].split("-", 1)[0]
                outcomes[variant].append(outcome in ("passed", "xpassed"))
    if not outcomes:
        return ""
    passed = sum(all(ran) for ran in outcomes.values())
    return f"benign variants passed: {passed}/{len(outcomes)} at tier {tier}"
