import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch) -> path of a tiny random-weight HF checkpoint, built once per session."""
    from tests.checkpoints import build_checkpoint

    built: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in built:
            built[arch] = build_checkpoint(str(tmp_path_factory.mktemp(arch)), arch)
        return built[arch]

    return get
