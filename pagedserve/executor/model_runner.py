"""ModelRunner: one step of the model over a SchedulerOutput, and what it owns across steps.

It composes the executor's parts, each in its own module:
  input_batch.py   per-request state across steps, flattening a step into model inputs
  kv_cache.py      the paged KV tensors, bytes per block, GPU sizing by profiling
  sampler.py       sampling settings of a batch and the sampling itself
  logprobs.py      sampled and prompt log-probabilities
  spec_verify.py   verification of speculative guesses
  cuda_graphs.py   decode steps replayed as CUDA graphs
and, with speculative method "draft_model", the draft model (executor/draft_model.py),
given to the constructor.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedserve.config import LoRAConfig
from pagedserve.executor import host_memory, kv_cache
from pagedserve.executor.attention import get_attention_backend
from pagedserve.executor.dtypes import resolve_dtype, resolve_kv_dtype
from pagedserve.executor.input_batch import InputBatch, StepInputs
from pagedserve.executor.loader import build_model
from pagedserve.executor.logprobs import collect_prompt_logprobs, collect_sampled_logprobs
from pagedserve.executor.lora import LoRAManager
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.pooling import Pooler, PoolerConfig
from pagedserve.executor.quant.copy_budget import CopyPolicy
from pagedserve.executor.sampler import Sampler, make_sampling_batch
from pagedserve.executor.spec_verify import verify_drafts
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.structured_outputs.bitmask import apply_structured_output_bitmask
from pagedserve.structured_outputs.token_constraints import apply_token_constraints

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        model_config: ModelConfig,
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        attention_backend: str = "auto",
        load_format: str = "auto",
        enforce_eager: bool = False,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        kv_cache_prefault: bool | None = False,
        block_size: int = 16,
        drafter_factory=None,
        pooler: PoolerConfig | None = None,
        lora: LoRAConfig | None = None,
        weight_copies: CopyPolicy | None = None,
    ) -> None:
        """`drafter_factory(model_config, dtype, device, backend)`: the draft model of
        speculative method "draft_model" (it shares this runner's block tables). `lora`
        with enable_lora: the projections carry adapter slots (executor/lora.py). `weight_copies`:
        what a packed model may keep beside its blocks (None: the default policy)."""
        self.device = torch.device(device)
        self.model_config = model_config
        self.dtype = resolve_dtype(dtype, model_config, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype, self.device)
        self.kv_cache_prefault = bool(kv_cache_prefault)  # None (offline default): lazy
        self.backend = get_attention_backend(attention_backend, self.device.type)
        if self.kv_dtype != self.dtype and not self.backend.supports_narrow_kv_cache:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs the torch attention backend, not {self.backend.name}.")
        torch.manual_seed(seed)
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()
        self.model = build_model(
            model_path, model_config, self.dtype, self.device, self.backend, load_format, quantization, weight_copies,
            silu_halves=lora is None or not lora.enable_lora,  # LoRA adds to the whole gate_up output
        )
        if self.device.type == "cpu":
            host_memory.release_free_memory()  # loading's temporaries, kept by the settings above
        self.enforce_eager = enforce_eager
        self.graph_runner = None
        self.sampler = Sampler(seed, self.device)
        self.input_batch = InputBatch(self.device, block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_layout = kv_cache.kv_cache_layout(model_config)
        if drafter_factory and self.kv_layout.num_groups > 1:
            raise ValueError(
                f"speculative method 'draft_model' with {model_config.architecture}'s sliding-window layers "
                "(several KV cache groups) is not supported; use method 'ngram'."
            )
        self.drafter = drafter_factory(model_config, self.dtype, self.device, self.backend) if drafter_factory else None
        self.vocab_size = model_config.vocab_size
        self.pooler = Pooler(pooler) if pooler is not None else None  # runner "pooling"
        self.lora = None
        if lora is not None and lora.enable_lora:
            self.lora = LoRAManager(
                self.model, model_config, lora.max_loras, lora.max_lora_rank, lora.cpu_loras, self.dtype, self.device
            )

    @property
    def requests(self):
        """Request id -> RequestState (the persistent batch's)."""
        return self.input_batch.requests

    @property
    def block_size(self) -> int:
        return self.input_batch.block_size

    # -- KV cache -------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        """KV heads held here: all of them, or this tensor-parallel rank's share / replica."""
        return self.model.tp.num_kv_heads

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.model_config
        # one block is one group's layers (all of them without sliding-window layers)
        own = kv_cache.kv_bytes_per_block(self.kv_layout.num_slots, block_size, self.num_kv_heads, c.head_dim, self.kv_dtype)
        draft = self.drafter.kv_bytes_per_block(block_size, self.kv_dtype.itemsize) if self.drafter is not None else 0
        return own + draft

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """K and V per layer: [num_blocks, block_size, kv_heads, head_dim], zeroed (on the CPU
        committed page by page as blocks are first written, or at once with
        kv_cache_prefault: kv_cache.lazy_zeros). With KV
        cache groups, slot s of every group shares one pair (kv_cache.KVCacheLayout)."""
        c, lay = self.model_config, self.kv_layout
        shape = (num_blocks, block_size, self.num_kv_heads, c.head_dim)
        self.input_batch.block_size = block_size
        self.input_batch.num_groups = lay.num_groups
        self.model.kv_group_of_layer = list(lay.group_of_layer)
        slots = kv_cache.allocate(lay.num_slots, shape, self.kv_dtype, self.device, self.kv_cache_prefault)
        if self.kv_cache_prefault and self.device.type == "cpu":
            logger.info("KV cache committed: %.2f GiB", 2 * lay.num_slots * slots[0][0].nbytes / 2**30)
        self.kv_caches = [slots[s] for s in lay.slot_of_layer]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, block_size, lambda s: kv_cache.zeros(s, self.kv_dtype, self.device, self.kv_cache_prefault)
            )

    def kv_offload_connector(self, offload_dir: str, capacity_bytes: int, fingerprint: dict):
        """The disk KV tier over this runner's KV tensors, in a namespace of the model files,
        dtypes, block size and layout (None with a draft model: its K/V would be missing)."""
        if self.drafter is not None:
            logger.warning("KV offload tier off: speculative method 'draft_model' keeps K/V the tier does not carry")
            return None
        from pagedserve.executor import kv_offload_store as kvs

        c, lay = self.model_config, self.kv_layout
        fp = kvs.kv_fingerprint(
            **fingerprint,
            model_files=kvs.model_files_identity(fingerprint["model_path"]),
            dtype=str(self.dtype),
            kv_dtype=str(self.kv_dtype),
            block_size=self.block_size,
            layers=c.num_hidden_layers,
            kv_heads=self.num_kv_heads,
            head_dim=c.head_dim,
            layout=(lay.windows, lay.group_of_layer, lay.slot_of_layer),
            architecture=c.architecture,
        )
        return kvs.KVOffloadConnector(kvs.KVBlockStore(offload_dir, fp, capacity_bytes), self.kv_caches)

    def determine_available_kv_memory(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """Bytes the KV cache may take. GPU: profiled (kv_cache.profile_gpu_kv_bytes). CPU:
        kv_cache.DEFAULT_CPU_KV_BYTES (committed at start with kv_cache_prefault, a server's
        default; else lazily, a large figure costing RSS only as blocks fill)."""
        if self.device.type != "cuda":
            return kv_cache.DEFAULT_CPU_KV_BYTES
        return kv_cache.profile_gpu_kv_bytes(self, gpu_memory_utilization, max_num_batched_tokens)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Decode-only steps replay CUDA graphs (Triton backend on CUDA, unless enforce_eager)."""
        if self.enforce_eager or self.device.type != "cuda" or self.backend.name != "triton" or self.lora is not None:
            return
        if self.kv_layout.num_groups > 1:  # graphs replay one block table
            logger.info("CUDA graphs off: %d KV cache groups", self.kv_layout.num_groups)
            return
        if not getattr(self.model, "cuda_graph_safe", True):
            logger.info("CUDA graphs off: %s reads step data on the host", type(self.model).__name__)
            return
        from pagedserve.executor.cuda_graphs import CudaGraphRunner, capture_sizes

        max_blocks = -(-max_model_len // self.block_size)
        self.graph_runner = CudaGraphRunner(
            self.model, self.kv_caches, capture_sizes(max_num_seqs), max_blocks, max_model_len, self.device
        )
        self.graph_runner.capture()

    def warm_up_cpu(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """Build oneDNN's primitives for every row count a step can hand the packed
        products (onednn_linear.warm_up: up to the token budget, at most WARM_UP_MAX_ROWS;
        the LM head up to the running requests), so no served step pays their JIT. Off with
        enforce_eager."""
        from pagedserve.executor import onednn_linear

        if self.enforce_eager:
            return
        t0 = time.perf_counter()
        rows = min(max_num_batched_tokens, onednn_linear.WARM_UP_MAX_ROWS)
        n = onednn_linear.warm_up(self.model, rows, min(max_num_seqs, rows))
        if n:
            logger.info("warmed %d packed products up in %.1f s", n, time.perf_counter() - t0)

    # -- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Update the persistent batch, run the model over the step's tokens, then sample
        (speculative rows verify their guesses; prompt logprobs where asked)."""
        self.input_batch.update(so)
        if self.drafter is not None:
            self.drafter.update(so)
        if self.pooler is not None:
            for rid in (*so.finished_req_ids, *so.preempted_req_ids):
                self.pooler.forget(rid)
        if not so.scheduled:
            return ModelRunnerOutput(sampled_token_ids={})
        if self.drafter is not None:  # the draft model's guesses for the placeholder slots
            so = self.drafter.fill_drafts(self, so)
        inp = self.input_batch.prepare(so)
        pooled = [i for i, st in enumerate(inp.states) if st.params.pooling is not None]
        rows = [
            i
            for i, sr in enumerate(inp.order)
            if sr.sample and sr.draft_token_ids is None and inp.states[i].params.pooling is None
        ]
        spec_rows = [i for i, sr in enumerate(inp.order) if sr.draft_token_ids is not None]
        # sampling settings go to the device before the forward (no sync after it)
        sample_states = [inp.states[i] for i in rows]
        plain_greedy = all(s.plain_greedy for s in sample_states)
        batch = make_sampling_batch(sample_states, self.vocab_size, self.device) if rows and not plain_greedy else None
        keep = self._last_token_rows(inp, pooled) if len(pooled) == len(inp.order) else None
        if keep is not None:  # a step of last-token pooling only: the prompts' last rows
            out = ModelRunnerOutput(sampled_token_ids={})
            self._pool_rows(inp, self._forward(inp, torch.tensor(keep, dtype=torch.int64, device=self.device)), out)
            return out
        hidden = self._forward(inp)
        out = ModelRunnerOutput(sampled_token_ids={})
        collect_prompt_logprobs(self.model, inp.order, inp.states, inp.cu, hidden, out)
        if pooled:
            self._pool(inp, hidden, pooled, out)
        if spec_rows:
            verify_drafts(
                self.model, inp, hidden, spec_rows, self.block_size, self.sampler.generator, out, self.kv_layout.num_groups
            )
        if rows:
            self._sample(so, inp, hidden, rows, sample_states, batch, out)
        return out

    def _pool(self, inp: StepInputs, hidden: torch.Tensor, rows: list[int], out: ModelRunnerOutput) -> None:
        """Pooling requests: each chunk's hidden states to the pooler; a request whose
        prompt ends this step gets its vector."""
        for i in rows:
            sr, p = inp.order[i], inp.states[i].params.pooling
            a, b = int(inp.cu[i]), int(inp.cu[i + 1])
            self.pooler.add_chunk(sr.req_id, hidden[a:b], sr.num_computed_tokens)
            if sr.sample:
                out.pooled[sr.req_id] = self.pooler.finish(sr.req_id, hidden[b - 1], p.dimensions, p.normalize)

    def _last_token_rows(self, inp: StepInputs, pooled: list[int]) -> list[int] | None:
        """With last-token pooling and no adapters: the rows of the step's prompts that end
        here (the only hidden states read), else None (every row is computed)."""
        if self.lora is not None or self.pooler.config.pooling_type != "last":
            return None
        if any(st.params.prompt_logprobs is not None for st in inp.states):
            return None
        return [int(inp.cu[i + 1]) - 1 for i in pooled if inp.order[i].sample]

    def _pool_rows(self, inp: StepInputs, last: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Last-token pooling from `last`: one hidden state per prompt ending this step, in order."""
        ends = [i for i, sr in enumerate(inp.order) if sr.sample]
        for j, i in enumerate(ends):
            sr, p = inp.order[i], inp.states[i].params.pooling
            out.pooled[sr.req_id] = self.pooler.finish(sr.req_id, last[j], p.dimensions, p.normalize)

    def _forward(self, inp: StepInputs, keep: torch.Tensor | None = None) -> torch.Tensor:
        if self.lora is not None:  # each token's adapter, grouped for the step
            self.lora.begin_step([st.lora_request for st in inp.states], np.diff(inp.cu))
            try:
                return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
            finally:
                self.lora.end_step()
        m = inp.meta
        if self.graph_runner is not None and m.num_decodes == m.num_reqs:
            hidden = self.graph_runner.run(inp.input_ids, inp.positions, m.slot_mapping, m.block_tables, m.seq_lens)
            if hidden is not None:
                return hidden if keep is None else hidden.index_select(0, keep)
        if keep is not None:
            return self.model(inp.input_ids, inp.positions, self.kv_caches, m, keep=keep)
        return self.model(inp.input_ids, inp.positions, self.kv_caches, m)

    def _samples_model_dtype(self, so, constrained: bool, batch) -> bool:
        """Whether this step's logits can stay in the model's dtype (CPU: the fused argmax and
        temperature kernels read bf16 exactly, so the tokens are those of the float32 logits;
        a 64-row SmolLM2 step skips a 12.6 MB conversion pass). Not with structured outputs,
        token constraints (`constrained`), logprobs, penalties or top-k / top-p / min-p."""
        return (
            self.device.type == "cpu"
            and so.grammar_bitmask is None
            and not constrained
            and (batch is None or batch.reads_model_dtype)
        )

    def _sample(self, so, inp: StepInputs, hidden, rows, sample_states, batch, out: ModelRunnerOutput) -> None:
        """One token for each of `rows` (the requests that sample, not speculative ones)."""
        order = inp.order
        if len(rows) == hidden.shape[0]:  # every token samples (a decode-only step): no gather
            last = hidden
        else:
            last = hidden[torch.from_numpy(inp.cu[1:][rows] - 1).to(self.device)]
        constrained = any(s.params.has_token_constraints for s in sample_states)
        logits = self.model.compute_logits(last, float32=not self._samples_model_dtype(so, constrained, batch))
        if so.grammar_bitmask is not None:  # structured outputs: only legal next tokens
            apply_structured_output_bitmask(logits, [order[i].req_id for i in rows], so)
        if constrained:
            apply_token_constraints(logits, sample_states)  # logit_bias, allowed_token_ids, bad_words
        if batch is None:  # every row plain greedy
            res, sampled = None, self.sampler.greedy(logits).tolist()
        else:
            res = self.sampler(logits, batch)
            sampled = res.sampled.tolist()
        for j, i in enumerate(rows):
            out.sampled_token_ids[order[i].req_id] = sampled[j]
            sample_states[j].output_token_ids.append(sampled[j])
        if res is not None and res.sampled_logprobs is not None:
            collect_sampled_logprobs(order, rows, sample_states, res, out)
