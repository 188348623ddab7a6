"""ModelRunner: turns a SchedulerOutput into model inputs, runs the model, samples.

It keeps per-request state across steps (block table, sampling settings, generator,
tokens for penalties), updated from the scheduler's deltas, so a running request costs
only its new token and new block ids to send.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.config import KV_CACHE_DTYPES
from pagedserve.executor.attention import AttentionMetadata, get_attention_backend
from pagedserve.executor.loader import build_model
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.sampler import Sampler, SamplingBatch
from pagedserve.messages import (
    Logprob,
    ModelRunnerOutput,
    PositionLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_outputs.bitmask import apply_structured_output_bitmask
from pagedserve.structured_outputs.token_constraints import apply_token_constraints

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30  # committed lazily: RSS grows only as blocks fill


def lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory is committed page by page on first write (anonymous
    mmap), in base pages: transparent huge pages would commit (and zero) 2 MB at a time per
    tensor, which on VMs whose memory is backed lazily costs ~10x more per byte on first
    touch (measured here: prefill of 64 x 256 tokens on a fresh engine 31.3-32.7 -> 27.3 s,
    BENCHMARKS 21) and lets RSS run ahead of the blocks in use. Without mmap's
    MADV_NOHUGEPAGE (non-Linux): numpy's calloc, also lazily committed."""
    import mmap

    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache element types beyond the model dtypes (config.KV_CACHE_DTYPES' names)
_KV_DTYPES = _DTYPES | {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cpu_has_native_bf16() -> bool:
    """True where bfloat16 matmuls run in hardware (AVX512-BF16 or AMX); elsewhere (e.g. AVX2
    only) oneDNN emulates them at a fraction of float32 speed."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """ "auto" follows the checkpoint; on a CPU it is bfloat16 only with native bf16 support,
    else float32. float16 on a CPU becomes bfloat16 (CPUs lack fast fp16)."""
    if dtype == "auto":
        dtype = cfg.checkpoint_dtype or "bfloat16"
        if device.type == "cpu":
            dtype = "bfloat16" if dtype != "float32" and cpu_has_native_bf16() else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    if device.type == "cpu" and dtype == "float16":
        dtype = "bfloat16"
    return _DTYPES[dtype]


@dataclass
class StepInputs:
    order: list[ScheduledRequest]  # the scheduled requests, decodes first
    states: list[RequestState]
    cu: np.ndarray  # [n + 1] query start offsets
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None = None
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # greedy, no penalties, no logprobs, no token mask: a batch of only these samples with
    # one argmax (Sampler.greedy); anything that changes logits must clear it
    plain_greedy: bool = False

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (
            p.greedy
            and not p.has_penalties
            and p.logprobs is None
            and p.structured_outputs is None
        )


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: the model's ("auto"), or float16 / bfloat16 on the CPU
    (written rounded from the model's K/V, read back as the model's dtype by the attention
    paths: the C++ decode kernel converts in registers, the SDPA paths after gathering).
    float16 holds |K/V| up to 65504 (larger values become inf, as in llama.cpp's default
    float16 cache); bfloat16 keeps float32's range with 8 mantissa bits. The float8 types
    (vLLM's fp8 KV cache with its default scale of 1.0: values stored as they are) take a
    quarter of float32's bytes and lose precision: e4m3fn keeps 3 mantissa bits and saturates
    at +-448 (its smallest step is 2^-9), e5m2 keeps 2 bits and float16's range."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}.")
    if kv_cache_dtype == "auto":
        return model_dtype
    kv = _KV_DTYPES[kv_cache_dtype]
    if device.type != "cpu" and kv != model_dtype:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} differs from the model's {str(model_dtype).removeprefix('torch.')}: "
            "supported on the CPU only (use 'auto' on GPUs)."
        )
    return kv


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
    ) -> None:
        self.device = torch.device(device)
        self.model_config = model_config
        self.dtype = resolve_dtype(dtype, model_config, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype, self.device)
        self.backend = get_attention_backend(attention_backend, self.device.type)
        if self.kv_dtype != self.dtype and not self.backend.supports_narrow_kv_cache:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs the torch attention backend, not {self.backend.name}.")
        torch.manual_seed(seed)
        self.model = build_model(
            model_path, model_config, self.dtype, self.device, self.backend, load_format, quantization
        )
        self.enforce_eager = enforce_eager
        self.graph_runner = None
        self.sampler = Sampler(seed, self.device)
        self.requests: dict[str, RequestState] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 16
        # speculative method "draft_model": executor/draft_model.py, sharing the block tables
        self.drafter = None
        self.vocab_size = model_config.vocab_size

    # -- KV cache -------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        """KV heads held here: all of them, or this tensor-parallel rank's share / replica."""
        return self.model.tp.num_kv_heads

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.model_config
        elem = self.kv_dtype.itemsize
        draft = self.drafter.kv_bytes_per_block(block_size, elem) if self.drafter is not None else 0
        return 2 * c.num_hidden_layers * block_size * self.num_kv_heads * c.head_dim * elem + draft

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """K and V per layer: [num_blocks, block_size, kv_heads, head_dim], zeroed.

        On CPU the memory comes from calloc (via numpy), so pages are committed only as
        blocks are first written: a large cache costs RSS only as it fills.
        """
        c = self.model_config
        shape = (num_blocks, block_size, self.num_kv_heads, c.head_dim)
        self.block_size = block_size
        self.kv_caches = [(self._zeros(shape), self._zeros(shape)) for _ in range(c.num_hidden_layers)]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, block_size, self._zeros)

    @torch.inference_mode()
    def determine_available_kv_memory(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """Bytes the KV cache may take. GPU: what is left under gpu_memory_utilization of
        the device's memory after the weights and the activations of a
        max_num_batched_tokens forward (profiled). CPU: DEFAULT_CPU_KV_BYTES (committed
        lazily, so a large figure costs RSS only as blocks fill)."""
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n, block_size = max_num_batched_tokens, 16
        nb = -(-n // block_size) + 1
        self.initialize_kv_cache(nb, block_size)
        scratch = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)
        toks = [0] * n
        req = ScheduledRequest(
            "__profile__", toks, 0, list(range(1, nb)), True, True, SamplingParams(max_tokens=1), toks, []
        )
        self.execute_model(SchedulerOutput([req], n))
        self.requests.pop("__profile__", None)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch
        free, total = torch.cuda.mem_get_info()
        others = (total - free) - torch.cuda.memory_reserved()  # CUDA context, other processes
        self.kv_caches = []
        torch.cuda.empty_cache()
        budget = int(total * gpu_memory_utilization - peak - max(others, 0))
        logger.info(
            "KV cache: %.1f GiB (peak activations+weights %.1f GiB of %.1f GiB)",
            budget / 2**30,
            peak / 2**30,
            total / 2**30,
        )
        return max(budget, 0)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Decode-only steps replay CUDA graphs (Triton backend on CUDA, unless enforce_eager)."""
        if self.enforce_eager or self.device.type != "cuda" or self.backend.name != "triton":
            return
        from pagedserve.executor.cuda_graphs import CudaGraphRunner, capture_sizes

        max_blocks = -(-max_model_len // self.block_size)
        self.graph_runner = CudaGraphRunner(
            self.model, self.kv_caches, capture_sizes(max_num_seqs), max_blocks, max_model_len, self.device
        )
        self.graph_runner.capture()

    def _zeros(self, shape) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        return lazy_zeros(shape, self.kv_dtype)

    # -- one step -------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        if self.drafter is not None:
            for rid in itertools.chain(so.finished_req_ids, so.preempted_req_ids):
                self.drafter.forget(rid)
        for sr in so.scheduled:
            if sr.is_new:
                params = sr.sampling_params
                gen = self._generators.get(sr.req_id)  # survives preemption: seeds stay exact
                if gen is None and params.seed is not None:
                    gen = self._generators[sr.req_id] = torch.Generator(device=self.device)
                    gen.manual_seed(params.seed % 2**63)  # any int64 (or larger) seed
                self.requests[sr.req_id] = RequestState(
                    list(sr.prompt_token_ids), list(sr.output_token_ids), params, list(sr.block_ids), gen
                )
                if self.drafter is not None:
                    self.drafter.forget(sr.req_id)
            elif sr.block_ids:
                self.requests[sr.req_id].block_ids.extend(sr.block_ids)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests (decodes first) into model inputs."""
        # decodes (one query token) first, as the attention contract wants
        order = sorted(so.scheduled, key=lambda sr: len(sr.token_ids) != 1)
        num_decodes = sum(1 for sr in order if len(sr.token_ids) == 1)
        states = [self.requests[sr.req_id] for sr in order]
        bs = self.block_size
        n = len(order)
        q_lens = np.fromiter((len(sr.token_ids) for sr in order), dtype=np.int64, count=n)
        starts = np.fromiter((sr.num_computed_tokens for sr in order), dtype=np.int64, count=n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        seq_lens = starts + q_lens
        input_ids = np.fromiter(itertools.chain.from_iterable(sr.token_ids for sr in order), np.int64, total)
        req_idx = np.repeat(np.arange(n), q_lens)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][req_idx] + starts[req_idx]
        max_blocks = int((seq_lens.max() + bs - 1) // bs)
        block_table = np.zeros((n, max_blocks), dtype=np.int64)
        for i, st in enumerate(states):
            ids = st.block_ids[:max_blocks]  # a draft pass may see fewer positions than allocated
            block_table[i, : len(ids)] = ids
        slots = block_table[req_idx, positions // bs] * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=n,
            num_decodes=num_decodes,
            query_start_loc=torch.from_numpy(cu).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            max_decode_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
            query_start_loc_list=cu.tolist(),
            seq_lens_list=seq_lens.tolist(),
        )
        return StepInputs(
            order, states, cu, torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if not so.scheduled:
            return ModelRunnerOutput(sampled_token_ids={})
        if self.drafter is not None:  # the draft model's guesses for the placeholder slots
            so = self.drafter.fill_drafts(self, so)
        inp = self.prepare_inputs(so)
        order, states, cu, dev = inp.order, inp.states, inp.cu, self.device
        rows = [i for i, sr in enumerate(order) if sr.sample and sr.draft_token_ids is None]
        spec_rows = [i for i, sr in enumerate(order) if sr.draft_token_ids is not None]
        # host -> device copies of sampling settings go before the forward (no sync after it)
        sample_states = [states[i] for i in rows]
        plain_greedy = all(s.plain_greedy for s in sample_states)
        batch = self._sampling_batch(sample_states) if rows and not plain_greedy else None
        hidden = None
        if self.graph_runner is not None and inp.meta.num_decodes == inp.meta.num_reqs:
            m = inp.meta
            hidden = self.graph_runner.run(
                inp.input_ids, inp.positions, m.slot_mapping, m.block_tables, m.seq_lens
            )
        if hidden is None:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)

        out = ModelRunnerOutput(sampled_token_ids={})
        self._prompt_logprobs(order, states, cu, hidden, out)
        if spec_rows:
            self._verify_drafts(order, states, cu, hidden, spec_rows, out)
        if not rows:
            return out
        if len(rows) == hidden.shape[0]:  # every token samples (a decode-only step): no gather
            last = hidden
        else:
            last = hidden[torch.from_numpy(cu[1:][rows] - 1).to(dev)]
        logits = self.model.compute_logits(last)
        if so.grammar_bitmask is not None:  # structured outputs: only legal next tokens
            apply_structured_output_bitmask(logits, [order[i].req_id for i in rows], so)
        apply_token_constraints(logits, sample_states)  # logit_bias, allowed_token_ids, bad_words
        if plain_greedy:
            res = None
            sampled = self.sampler.greedy(logits).tolist()
        else:
            res = self.sampler(logits, batch)
            sampled = res.sampled.tolist()
        for j, i in enumerate(rows):
            rid = order[i].req_id
            out.sampled_token_ids[rid] = sampled[j]
            sample_states[j].output_token_ids.append(sampled[j])
        if res is not None and res.sampled_logprobs is not None:
            self._collect_logprobs(order, rows, sample_states, res, out)
        return out

    def _verify_drafts(self, order, states, cu, hidden, spec_rows, out: ModelRunnerOutput) -> None:
        """Speculative requests: logits at the last token and at each of the k guesses (one
        forward pass), verified against the target distribution (greedy: argmax
        agreement; sampled: rejection sampling, executor/rejection_sampler.py). The
        block table drops blocks that held only rejected guesses, as the scheduler does."""
        from pagedserve.executor.rejection_sampler import verify

        # one logits pass for every guessed position of the step (weights read once)
        spans = [(int(cu[i + 1]) - len(order[i].draft_token_ids) - 1, int(cu[i + 1])) for i in spec_rows]
        idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(hidden.device)
        all_logits = self.model.compute_logits(hidden[idx])  # float32
        offset = 0
        for i, (a, b) in zip(spec_rows, spans):
            sr, st = order[i], states[i]
            drafts = sr.draft_token_ids
            logits = all_logits[offset : offset + b - a]
            offset += b - a
            p = st.params
            if p.greedy:
                toks = verify(logits, drafts, greedy=True)
            else:
                toks = verify(self._target_probs(logits, p), drafts, None, False, st.generator or self.sampler.generator)
            out.spec_token_ids[sr.req_id] = toks
            st.output_token_ids.extend(toks)
            keep = -(-(sr.num_computed_tokens + len(toks)) // self.block_size)
            del st.block_ids[keep:]

    @staticmethod
    def _target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """[n, V] logits of one request -> its sampling distribution at each position
        (temperature, top-k, top-p, min-p; speculation is off for penalties)."""
        from pagedserve.executor.sampler import sampling_probs

        n = logits.shape[0]
        return sampling_probs(
            logits,
            torch.full((n,), p.temperature),
            torch.full((n,), p.top_k, dtype=torch.int64) if p.top_k > 0 else None,
            torch.full((n,), p.top_p) if p.top_p < 1.0 else None,
            torch.full((n,), p.min_p) if p.min_p > 0 else None,
        )

    def _sampling_batch(self, states: list[RequestState]) -> SamplingBatch:
        dev = self.device
        ps = [s.params for s in states]
        b = SamplingBatch(
            temperature=torch.tensor(
                [0.0 if p.greedy else p.temperature for p in ps], dtype=torch.float32, device=dev
            )
        )
        if any(p.top_k > 0 for p in ps):
            b.top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev)
        if any(p.top_p < 1.0 for p in ps):
            b.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        if any(p.min_p > 0.0 for p in ps):
            b.min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
        gens = {
            i: s.generator for i, s in enumerate(states) if s.generator is not None and not s.params.greedy
        }
        b.generators = gens or None
        if any(p.has_penalties for p in ps):
            pad = self.vocab_size
            if any(p.repetition_penalty != 1.0 for p in ps):
                b.repetition_penalty = torch.tensor([p.repetition_penalty for p in ps], device=dev)
                b.prompt_token_ids = _pad([s.prompt_token_ids for s in states], pad, dev)
            b.frequency_penalty = torch.tensor([p.frequency_penalty for p in ps], device=dev)
            b.presence_penalty = torch.tensor([p.presence_penalty for p in ps], device=dev)
            b.output_token_ids = _pad([s.output_token_ids for s in states], pad, dev)
        nlp = [p.logprobs for p in ps if p.logprobs is not None]
        b.max_num_logprobs = max(nlp) if nlp else None
        return b

    @staticmethod
    def _collect_logprobs(order, rows, states, res, out: ModelRunnerOutput) -> None:
        lps = res.sampled_logprobs.tolist()
        ranks = res.sampled_ranks.tolist()
        top_ids = res.topk_ids.tolist() if res.topk_ids is not None else None
        top_lps = res.topk_logprobs.tolist() if res.topk_logprobs is not None else None
        for j, i in enumerate(rows):
            k = states[j].params.logprobs
            if k is None:
                continue
            tok = out.sampled_token_ids[order[i].req_id]
            d: PositionLogprobs = {}
            for r in range(k):
                d[top_ids[j][r]] = Logprob(top_lps[j][r], r + 1)
            d[tok] = Logprob(lps[j], ranks[j])
            out.logprobs[order[i].req_id] = d

    def _prompt_logprobs(self, order, states, cu, hidden, out: ModelRunnerOutput) -> None:
        """Log-probabilities of prompt tokens 1.. given their prefixes (chunk by chunk)."""
        for i, sr in enumerate(order):
            st = states[i]
            k = st.params.prompt_logprobs
            if k is None:
                continue
            n_prompt = len(st.prompt_token_ids)
            first = sr.num_computed_tokens  # position of the chunk's first token
            last = min(first + len(sr.token_ids), n_prompt - 1)  # positions predicting a prompt token
            if last <= first:
                continue
            h = hidden[int(cu[i]) : int(cu[i]) + (last - first)]
            logprobs = self.model.compute_logits(h).log_softmax(dim=-1)
            targets = torch.tensor(st.prompt_token_ids[first + 1 : last + 1], device=self.device)
            tlp = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
            ranks = ((logprobs > tlp.unsqueeze(1)).sum(dim=-1) + 1).tolist()
            top_lp, top_id = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
            tl, tg = tlp.tolist(), targets.tolist()
            entries = []
            for j in range(last - first):
                d: PositionLogprobs = {}
                if k > 0:
                    for r, (tid, v) in enumerate(zip(top_id[j].tolist(), top_lp[j].tolist())):
                        d[tid] = Logprob(v, r + 1)
                d[tg[j]] = Logprob(tl[j], ranks[j])
                entries.append(d)
            out.prompt_logprobs[sr.req_id] = entries


def _pad(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    arr = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return torch.from_numpy(arr).to(device)
