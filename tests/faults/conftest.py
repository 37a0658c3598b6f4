import pytest

from conformance.core.scope import Scope


@pytest.fixture(autouse=True)
def released():
    """Each fault builds its own family: release its compiled programs after it."""
    with Scope():
        yield
