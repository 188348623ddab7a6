"""Beam search with vLLM's semantics, on top of the engine.

Each step runs every live beam as a one-token request asking for its 2 * beam_width most
likely next tokens; the beams of one prompt fork over shared KV blocks through the
prefix cache (a beam's full blocks are its parent's, so only its last partial block and
new token are computed). Candidates ending in EOS (unless ignore_eos) are set aside as
completed; the best beam_width others continue. The score is vLLM's
cumulative_logprob / len(prompt + output, minus a final EOS) ** length_penalty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos: int | None, length_penalty: float) -> float:
    n = len(seq.tokens)
    if eos is not None and seq.tokens[-1] == eos:
        n -= 1
    return seq.cum_logprob / (n**length_penalty)


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.engine
    tok = engine.tokenizer
    eos = tok.eos_token_id
    w = params.beam_width
    step_params = SamplingParams(
        max_tokens=1,
        logprobs=2 * w,
        temperature=params.temperature,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    instances = []
    for p in prompts if isinstance(prompts, list) else [prompts]:
        _, ids = engine.input_processor.tokenize(p)
        instances.append({"prompt_len": len(ids), "beams": [BeamSearchSequence(list(ids))], "completed": []})
    key = lambda s: beam_score(s, eos, params.length_penalty)  # noqa: E731
    for _ in range(params.max_tokens):
        live = [(inst, b) for inst in instances for b in inst["beams"]]
        if not live:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in live], step_params, use_tqdm=False)
        new_beams: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), out in zip(live, outs):
            lps = out.outputs[0].logprobs[0]
            for tid, lp in lps.items():
                if lp.rank is None or lp.rank > 2 * w:
                    continue  # the sampled token is reported too; keep only the top 2W
                cand = BeamSearchSequence(
                    beam.tokens + [tid], beam.logprobs + [lp.logprob], beam.cum_logprob + lp.logprob
                )
                if tid == eos and not params.ignore_eos:
                    cand.finish_reason = "stop"
                    inst["completed"].append(cand)
                else:
                    new_beams[id(inst)].append(cand)
        for inst in instances:
            inst["beams"] = sorted(new_beams[id(inst)], key=key, reverse=True)[:w]
    results = []
    for inst in instances:
        for b in inst["beams"]:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(inst["completed"] + inst["beams"], key=key, reverse=True)[:w]
        for b in best:
            b.text = tok.decode(b.tokens[inst["prompt_len"] :], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
