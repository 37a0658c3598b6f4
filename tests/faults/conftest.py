import pytest

from conformance.core.scope import Scope


@pytest.fixture(autouse=True)
def released():
    """Each fault builds its own family: release its models after it. Its compiled
    programs stay for the next faults, most of which run a side or a family unchanged,
    while the process is within its memory-mapping budget."""
    with Scope(keep_programs=True):
        yield
