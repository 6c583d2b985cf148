import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The tiny byte-level BPE tokenizer the test checkpoints use (384 tokens)."""
    from checkpoints import make_tokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)
