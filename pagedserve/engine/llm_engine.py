"""LLMEngine: the synchronous engine for offline use, vLLM v1's three parts in a row.

  input processor (tokenize, validate, n > 1 fan-out)
    -> engine core (scheduler + executor + step; in this process, or in a child process
       with `engine_core_process=True`)
    -> output processor (detokenize, stop strings, RequestOutputs).

`step()` runs one engine step and returns the RequestOutputs it produced.
"""

from __future__ import annotations

import itertools
import logging

from pagedserve.config import EngineConfig
from pagedserve.core.engine_core import resolve_config
from pagedserve.engine.core_client import EngineCoreClient, InprocClient, MPClient
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.lora import BaseDims, LoRAChecker, LoRARequest
from pagedserve.messages import EngineStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


class FrontEnd:
    """What every front end builds from a config: tokenizer, input and output processors.
    Resolves `config.scheduler` in place (max_model_len, token budget)."""

    def __init__(self, config: EngineConfig) -> None:
        info = resolve_config(config)
        self.config = config
        self.model_path = info.model_path
        self.model_config = info.model_config
        mc = config.model
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(info.tokenizer_path)
        eos = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos = eos_token_ids(self.tokenizer, info.model_path, self.model_config.eos_token_ids)
        self.pooler = info.pooler  # runner "pooling"; None generates
        self.input_processor = InputProcessor(config, self.model_config.vocab_size, self.tokenizer, eos, info.pooler)
        lc = config.lora
        self.input_processor.lora = LoRAChecker(lc.enable_lora, lc.max_lora_rank, BaseDims.of(self.model_config))
        self.output_processor = OutputProcessor(self.tokenizer)

    def core_ready(self, num_kv_blocks: int) -> None:
        self.input_processor.num_kv_blocks = num_kv_blocks


class LLMEngine(FrontEnd):
    def __init__(self, config: EngineConfig, engine_core_process: bool = False) -> None:
        super().__init__(config)
        process = engine_core_process or config.parallel.data_parallel_size > 1  # replicas: each its own process
        self.core: EngineCoreClient = MPClient(config) if process else InprocClient(config)
        self.num_blocks = self.core.info.num_kv_blocks
        self.load_seconds = self.core.info.load_seconds
        self.core_ready(self.num_blocks)
        self._ids = itertools.count()

    @property
    def engine_core(self):
        """The EngineCore object when it runs in this process (None otherwise)."""
        return self.core.engine_core

    def get_tokenizer(self):
        return self.tokenizer

    # -- requests -----------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate, tokenize and queue a request; raises InvalidRequestError (a ValueError;
        nothing queued) if it is invalid or could never fit. Returns its id.

        `cache_salt` (or a prompt dict's "cache_salt") isolates prefix-cache entries. With
        n > 1 the samples are child requests "<id>#<i>" that share the prompt's full blocks
        through the prefix cache (each child writes its own partial last block, vLLM's
        choice, so no copy-on-write is ever needed)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        req = self.input_processor.process(request_id, prompt, params, arrival_time, priority, cache_salt, lora_request)
        self.core.add_requests(req.children)
        self.output_processor.add_request(req)
        return request_id

    def abort_request(self, request_ids) -> None:
        """Abort requests (by the ids given to add_request) from any state; frees their blocks."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        children = []
        for rid in request_ids:
            children += self.output_processor.child_ids_of(rid)
            self.output_processor.remove(rid)
        if children:
            self.core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # -- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step's outputs. A request whose outputs fail to process (a detokenizer
        or formatting bug) fails alone: the core aborts it (its blocks are freed) and it
        ends here with finish_reason "error" and the message in `extra["error"]`."""
        res = self.output_processor.process(self.core.get_output().outputs)
        if res.stopped:
            self.core.finish_requests_stopped(res.stopped)
        if res.abort:
            self.core.abort_requests(res.abort)
        return res.outputs + res.failed_outputs if res.failed_outputs else res.outputs

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def remove_lora(self, lora_int_id: int) -> None:
        """Unload an adapter; requests using it finish with it first."""
        self.input_processor.lora.forget(lora_int_id)
        self.core.remove_lora(lora_int_id)

    def shutdown(self) -> None:
        self.core.shutdown()
