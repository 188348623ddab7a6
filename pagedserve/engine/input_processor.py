"""InputProcessor: a user's request -> the engine core's requests, validated once.

Tokenizes (str prompts), checks token ids, resolves max_tokens against max_model_len,
caps logprobs, fans n > 1 out into child requests "<id>#<i>" (seed + i each) and attaches
the model's EOS ids. Every refusal is an `InvalidRequestError` naming the OpenAI `param`,
raised before anything is queued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pagedserve.config import EngineConfig
from pagedserve.core.admission import check_fits
from pagedserve.errors import InvalidRequestError
from pagedserve.lora import LoRAChecker, LoRARequest
from pagedserve.messages import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_outputs import validate_structured_outputs

MAX_LOGPROBS = 20  # top logprobs a request may ask for (vLLM's default max_logprobs)


@dataclass
class ProcessedRequest:
    """What the front end keeps of one user request (the core gets `children`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[EngineCoreRequest]
    arrival_time: float


class InputProcessor:
    def __init__(self, config: EngineConfig, vocab_size: int, tokenizer, eos_token_ids: frozenset[int], pooler=None) -> None:
        self.pooler = pooler  # runner "pooling": embedding requests only
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.eos_token_ids = eos_token_ids
        self.block_size = config.cache.block_size
        self.num_kv_blocks: int | None = None  # set once the engine core has sized its cache
        self.lora: LoRAChecker | None = None  # set by the front end (enable_lora or not)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """str | list[int] | {"prompt": str} | {"prompt_token_ids": [...]} -> (text, ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'.", "prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "text prompts need a tokenizer (the engine runs with skip_tokenizer_init); "
                    "pass {'prompt_token_ids': [...]}.",
                    "prompt",
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise InvalidRequestError(
            f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}.", "prompt"
        )

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        vocab = self.vocab_size
        for t in ids:
            # bool is an int subclass; floats are refused even when integral
            if type(t) is not int or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab}), got {t!r}.", "prompt")
        return ids

    def _token_constraints(self, params: SamplingParams) -> SamplingParams:
        """Check logit_bias / allowed_token_ids against the vocabulary; tokenize bad_words
        (each with and without a leading space, as vLLM) into a copy of the params."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{name} token ids must be in [0, {vocab}), got {bad}.", name)
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer (skip_tokenizer_init is set).", "bad_words")
        seqs: list[list[int]] = []
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return replace(params, bad_words_token_ids=seqs)

    def process(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and check one user request; its engine-core requests (n of them)."""
        self._check_runner(params)
        if lora_request is not None:
            self._check_lora(lora_request)
        text, ids = self.tokenize(prompt)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string.", "cache_salt")
        max_tokens = self._max_tokens(len(ids), params)
        self._check_params(params)
        params = self._token_constraints(params)
        arrival = arrival_time or time.time()
        children = []
        for i in range(params.n):
            child_params, cid = params, request_id
            if params.n > 1:
                child_params = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                cid = f"{request_id}#{i}"
            children.append(
                EngineCoreRequest(
                    request_id=cid,
                    prompt_token_ids=ids,
                    sampling_params=child_params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_request=lora_request,
                )
            )
        return ProcessedRequest(request_id, text, ids, params, children, arrival)

    def _check_lora(self, lora_request: LoRARequest) -> None:
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters.", "lora_request")
        try:
            self.lora.check(lora_request)
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_request") from None

    def _check_runner(self, params: SamplingParams) -> None:
        """Embedding requests on a pooling model, text generation on a generating one."""
        if params.pooling is not None:
            if self.pooler is None:
                raise InvalidRequestError("this model generates text: it serves no embeddings (start it with runner='pooling').", "input")
            if params.n != 1:
                raise InvalidRequestError("an embedding request has n = 1.", "n")
            self.pooler.check_dimensions(params.pooling.dimensions)
        elif self.pooler is not None:
            raise InvalidRequestError("this model runs as an embedding (pooling) model: it generates no text.", "model")

    def _max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """max_tokens resolved ("up to max_model_len" when None, as vLLM) and checked to fit."""
        max_len = self.max_model_len
        if params.pooling is not None:  # the prompt only
            check_fits(num_prompt, 0, max_len, self.block_size, self.num_kv_blocks)
            return 0
        if params.max_tokens is None and num_prompt >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length (max_model_len) is {max_len} tokens, but the "
                f"prompt has {num_prompt} tokens, which leaves no room to generate.",
                "prompt",
            )
        max_tokens = max_len - num_prompt if params.max_tokens is None else params.max_tokens
        check_fits(num_prompt, max_tokens, max_len, self.block_size, self.num_kv_blocks)
        if max_tokens == 0 and params.prompt_logprobs is None:
            raise InvalidRequestError("max_tokens must be >= 1 unless prompt_logprobs are requested.", "max_tokens")
        return max_tokens

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the vocabulary, the logprob cap, the tokenizer."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k must be -1, 0 or at most the vocabulary size {vocab}, got {params.top_k}.", "top_k")
        limit = min(MAX_LOGPROBS, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > limit:
                raise InvalidRequestError(f"{name} must be <= {limit}, got {k}.", name)
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab}), got {t}.", "stop_token_ids")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer (skip_tokenizer_init is set).", "stop")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need a tokenizer (skip_tokenizer_init is set).", "structured_outputs"
                )
            validate_structured_outputs(params.structured_outputs)
