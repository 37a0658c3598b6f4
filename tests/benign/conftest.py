import pytest

from conformance.core.scope import Scope


@pytest.fixture(autouse=True)
def released():
    """Each variant's checks build their own models: release them after each. Compiled
    programs stay for the next checks (the Linen side and the variant's own programs
    recur) while the process is within its memory-mapping budget."""
    with Scope(keep_programs=True):
        yield
