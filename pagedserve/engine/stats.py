"""Engine statistics, read by LLM.get_stats(), the CLI demo and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_cache_usage: float  # used / total blocks
    kv_utilization: float  # stored tokens / allocated token slots
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_steps: int
    computed_tokens: int  # tokens run through the model: prefill chunks, recomputes, decodes
    last_batch_size: int
    last_num_scheduled_tokens: int
    block_size: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
