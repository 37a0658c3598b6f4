def pytest_terminal_summary(terminalreporter):
    planted = [
        r
        for outcome in ("passed", "failed")
        for r in terminalreporter.stats.get(outcome, [])
        if "test_fault_is_caught" in r.nodeid and r.when == "call"
    ]
    if planted:
        caught = sum(r.passed for r in planted)
        terminalreporter.write_line(f"planted faults caught: {caught}/{len(planted)}")
