"""The offline API, compatible with vLLM's `LLM` so that switching is a change of import."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine_args import EngineArgs, signature
from pagedserve.lora import LoRARequest
from pagedserve.messages import EngineStats
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, PoolingParams, RequestOutputKind, SamplingParams
from pagedserve.tokenizer import apply_chat_template


class LLM:
    """An engine for offline batches.

    >>> llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    """

    def __init__(self, model: str = "default", **kwargs) -> None:
        """Engine arguments are `pagedserve.engine_args.EngineArgs`' fields, with vLLM's
        names and defaults; an unsupported or unknown one raises ValueError naming it."""
        self.engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.engine = LLMEngine(
            self.engine_args.create_engine_config(), engine_core_process=bool(self.engine_args.engine_core_process)
        )

    # -- generation -----------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for a str, a list of str, or a list of {"prompt_token_ids": [...]} dicts.
        Returns RequestOutputs in input order. All requests are validated before any runs.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per
        prompt (engine started with enable_lora)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            raise ValueError("pass token ids as [{'prompt_token_ids': [...]}], not a flat list of ints.")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts.")
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(
            [(p, sp, priority[i] if priority else 0, loras[i]) for i, (p, sp) in enumerate(zip(prompts, params))],
            use_tqdm,
        )

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [
            {"prompt_token_ids": apply_chat_template(tok, c, add_generation_prompt, chat_template)}
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, sp, prio, lora in items:
                if sp.output_kind is not RequestOutputKind.FINAL_ONLY:
                    sp = replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(engine.add_request(None, prompt, sp, priority=prio, lora_request=lora))
        except ValueError:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        t0 = time.perf_counter()
        n_in = n_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            n_in += len(out.prompt_token_ids)
                            if isinstance(out, RequestOutput):
                                n_out += sum(len(c.token_ids) for c in out.outputs)
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(
                                f"in {n_in / dt:.0f} tok/s, out {n_out / dt:.0f} tok/s", refresh=False
                            )
                            bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    # -- pooling (runner="pooling") -----------------------------------------------------
    def embed(
        self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = True
    ) -> list[PoolingRequestOutput]:
        """One vector per prompt (`outputs.embedding`), on a model started with
        runner="pooling" (vLLM's `LLM.embed`). Prompts as for `generate`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        sp = SamplingParams(max_tokens=0, pooling=pooling_params or PoolingParams())
        return self._run([(p, sp, 0, None) for p in prompts], use_tqdm)

    def score(self, text_1, text_2, use_tqdm: bool = True) -> list[float]:
        """Cosine similarity of `text_1`'s embedding (one string, or a list paired with
        `text_2`) with each of `text_2`'s (vLLM's `LLM.score` for embedding models)."""
        a = [text_1] if isinstance(text_1, str) else list(text_1)
        b = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(a) != 1 and len(a) != len(b):
            raise ValueError(f"text_1 must be one text or as many as text_2 ({len(b)}), got {len(a)}.")
        vecs = [o.outputs.embedding for o in self.embed(a + b, PoolingParams(normalize=True), use_tqdm)]
        left, right = vecs[: len(a)], vecs[len(a) :]
        return [cosine(left[0 if len(a) == 1 else i], v) for i, v in enumerate(right)]

    def beam_search(self, prompts, params: BeamSearchParams):
        """Beam search with vLLM's semantics (see frontend/beam_search.py): returns one
        BeamSearchOutput per prompt, its `sequences` best first."""
        from pagedserve.frontend.beam_search import beam_search

        return beam_search(self, prompts, params)

    # -- misc -------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine (and its engine-core process, if any)."""
        self.engine.shutdown()


LLM.__init__.__signature__ = signature()  # help(LLM) lists every engine argument


def _per_prompt_loras(lora_request, n: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_request entries for {n} prompts.")
    return loras


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = sum(x * x for x in a) ** 0.5, sum(y * y for y in b) ** 0.5
    return dot / (na * nb) if na and nb else 0.0


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
