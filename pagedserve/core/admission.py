"""Whether a request can ever run: the one check the front end's input processor makes
before queueing anything (with the OpenAI `param` to blame) and the scheduler repeats
for requests that reach the core another way. Raises InvalidRequestError (a ValueError).
"""

from __future__ import annotations

from pagedserve.errors import InvalidRequestError


def kv_blocks_needed(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request may hold at its longest (the last sampled token is never written)."""
    return -(-max(num_prompt_tokens + max_tokens - 1, num_prompt_tokens) // block_size)


def check_fits(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_kv_blocks: int | None
) -> None:
    """A non-empty prompt whose prompt + max_tokens fit max_model_len and, at full length,
    the whole KV cache (`num_kv_blocks`; None: not sized yet, not checked)."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("prompt must contain at least one token.", "prompt")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length (max_model_len) is {max_model_len} tokens, but the request "
            f"needs {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, max_tokens={max_tokens}).",
            "max_tokens",
        )
    need = kv_blocks_needed(num_prompt_tokens, max_tokens, block_size)
    if num_kv_blocks is not None and need > num_kv_blocks:
        raise InvalidRequestError(
            f"The request needs up to {need} KV blocks ({num_prompt_tokens} prompt tokens + max_tokens="
            f"{max_tokens}, block_size={block_size}) but the whole KV cache has {num_kv_blocks} blocks "
            f"({num_kv_blocks * block_size} tokens); lower max_tokens or give the cache more memory.",
            "max_tokens",
        )
