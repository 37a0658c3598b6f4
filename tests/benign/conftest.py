import pytest

from conformance.core.scope import Scope


@pytest.fixture(autouse=True)
def released():
    """Each variant's checks build their own models: release their programs after each."""
    with Scope():
        yield
