import pytest

from megarl.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama")
