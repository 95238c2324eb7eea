"""Fixtures of the store tests: one store per module (tests/support/shared_store.py)."""

import pytest
from shared_store import shared_store


@pytest.fixture(scope="module")
def module_store():
    yield from shared_store()


@pytest.fixture
def in_store(module_store):
    """Runs a coroutine on the module's store, which is emptied when the test ends."""
    yield module_store.run
    module_store.run(module_store.empty())
