import pytest

from megarl.config.schema import LORA_TARGETS
from megarl.models.tiny import make_tiny_hf_model
from tests import leftovers
from tests.peft_adapter import write_random_adapter


def pytest_sessionstart(session):
    session.config.stash[leftovers.START] = leftovers.snapshot()


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``after_all`` run last (they look at what the rest of the suite left behind)."""
    items.sort(key=lambda item: item.get_closest_marker("after_all") is not None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def lora_llama_dir(tmp_path_factory):
    """A tiny Llama with larger weights (init_std 0.08), where LoRA adapters visibly change the log-probs."""
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("lora-llama") / "llama"), "llama", seed=3, init_std=0.08)


@pytest.fixture(scope="session")
def random_adapter_dir(lora_llama_dir, tmp_path_factory):
    """A random, non-zero PEFT adapter (rank 4, every target) for lora_llama_dir, written by peft itself."""
    return write_random_adapter(lora_llama_dir, str(tmp_path_factory.mktemp("adapter") / "peft"), LORA_TARGETS)
