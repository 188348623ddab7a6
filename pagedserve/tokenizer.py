"""Tokenizer loading (HF tokenizer.json, or the GGUF file's own vocabulary) and chat templates."""

from __future__ import annotations

import json
import os


def load_tokenizer(path: str):
    """A transformers fast tokenizer from a local HF directory (a GGUF's vocabulary comes
    through its converted directory: `executor.loader.resolve_model_path`). Never downloads."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def eos_token_ids(tokenizer, model_path: str, config_eos: list[int]) -> frozenset[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json together."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.isdir(model_path) and os.path.exists(gen):
        with open(gen) as f:
            e = json.load(f).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [] if e is None else [e])
    return frozenset(ids)


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs,
) -> list[int]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must have 'role' and 'content'.")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=...")
    out = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tokenize=True,
        **kwargs,
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)
