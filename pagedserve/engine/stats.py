"""Engine statistics, read by LLM.get_stats(), the CLI demo and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # speculative decoding (vLLM's meanings): verification steps of one request, guessed
    # tokens, accepted guesses, and accepted guesses by position in the draft
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens per verification step (accepted guesses + the one sampled), as vLLM."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
