import pytest

from megarl.models.tiny import make_tiny_hf_model
from tests import leftovers


def pytest_sessionstart(session):
    session.config.stash[leftovers.START] = leftovers.snapshot()


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``after_all`` run last (they look at what the rest of the suite left behind)."""
    items.sort(key=lambda item: item.get_closest_marker("after_all") is not None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama")
