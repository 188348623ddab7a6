"""Structured outputs: compile latency, per-step constraint cost vs step time, validity.

    python -m pagedserve.bench.structured [--model default] [--parts compile,mask,validity,tools]
        [--batch-sizes 1,8,32,64] [--output-len 32] [--samples 8]

compile:  backend start (tokenizer info, once per engine), then per schema of the suite
          the first compile (a cache miss, through the thread pool) and a cached request.
mask:     B requests with a JSON schema vs the same B unconstrained (ignore_eos, same
          lengths), same run: mean step time of each, and inside the constrained run the
          time spent filling the bitmask (engine core) and applying it (model runner).
validity: the model answers chat prompts under each schema (plus regex / choice) with
          temperature 0.7: share of outputs that parse and validate (jsonschema).
tools:    tool_choice "required" and a named function, enforced as the server does: share
          of calls whose arguments validate against the function's parameters.
Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA_SUITE = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "role", "address"],
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 3,
            },
            "total": {"type": "number", "minimum": 0, "maximum": 1000},
        },
        "required": ["items", "total"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "location": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 0,
                "maxItems": 4,
            },
        },
        "required": ["title", "date", "location", "tags"],
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "temperature_c", "conditions", "humidity"],
    },
}
PROMPTS = {
    "person": "Describe a fictional user of our website as JSON.",
    "order": "Give me a sample shop order as JSON.",
    "event": "Give me an upcoming conference event as JSON.",
    "weather": "Report today's weather in Paris as JSON.",
}


def part_compile(model: str) -> dict:
    from pagedserve.executor.loader import resolve_model_path
    from pagedserve.sampling_params import StructuredOutputsParams
    from pagedserve.structured_outputs import StructuredOutputManager
    from pagedserve.tokenizer import load_tokenizer

    path = resolve_model_path(model)
    tok = load_tokenizer(path)
    m = StructuredOutputManager(lambda: tok, len(tok))
    t = time.perf_counter()
    _ = m.backend
    init = time.perf_counter() - t
    first, cached = {}, {}
    for name, schema in SCHEMA_SUITE.items():
        for d in (first, cached):
            t = time.perf_counter()
            r = m.new_request(StructuredOutputsParams(json=schema), [tok.eos_token_id])
            r.wait()
            d[name] = round((time.perf_counter() - t) * 1e3, 2)
    m.shutdown()
    return {
        "part": "compile",
        "backend_init_ms": round(init * 1e3, 1),
        "first_compile_ms": first,
        "cached_ms": cached,
        "first_compile_median_ms": statistics.median(first.values()),
        "cached_median_ms": statistics.median(cached.values()),
    }


def _timed(fn, acc: list):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc.append(time.perf_counter() - t)

    return wrapper


def _run(llm, prompts, params) -> dict:
    eng = llm.engine
    steps = []
    for i, p in enumerate(prompts):
        eng.add_request(f"s{time.monotonic_ns()}-{i}", p, params)
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    return steps


def part_mask(llm, batch_sizes: list[int], output_len: int) -> list[dict]:
    import pagedserve.executor.model_runner as mr
    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

    core = llm.engine.engine_core
    prompts = ["Report today's weather in Paris as JSON."] * max(batch_sizes)
    so = StructuredOutputsParams(json=SCHEMA_SUITE["weather"])
    plain = SamplingParams(max_tokens=output_len, temperature=0.7, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=output_len, temperature=0.7, ignore_eos=True, structured_outputs=so
    )
    _run(llm, prompts[:2], constrained)  # warm: backend, compile, kernels
    fill, apply = [], []
    orig_apply = mr.apply_structured_output_bitmask
    mr.apply_structured_output_bitmask = _timed(orig_apply, apply)
    mgr = core.structured_outputs
    orig_attach = mgr.attach_bitmask
    mgr.attach_bitmask = _timed(orig_attach, fill)
    rows = []
    try:
        for b in batch_sizes:
            res = {}
            for label, params in (("plain", plain), ("constrained", constrained), ("plain2", plain)):
                fill.clear()
                apply.clear()
                steps = _run(llm, prompts[:b], params)
                decode = steps[1:]  # the first step is the prefill
                res[label] = statistics.mean(decode)
                if label == "constrained":
                    n = len(steps)
                    res["fill"] = sum(fill) / n
                    res["apply"] = sum(apply) / n
            base = (res["plain"] + res["plain2"]) / 2
            rows.append(
                {
                    "part": "mask",
                    "batch": b,
                    "step_ms_plain": round(base * 1e3, 2),
                    "step_ms_constrained": round(res["constrained"] * 1e3, 2),
                    "fill_ms_per_step": round(res["fill"] * 1e3, 3),
                    "apply_ms_per_step": round(res["apply"] * 1e3, 3),
                    "mask_share_of_step": round((res["fill"] + res["apply"]) / res["constrained"], 4),
                    "step_overhead_vs_plain": round(res["constrained"] / base - 1, 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        mr.apply_structured_output_bitmask = orig_apply
        mgr.attach_bitmask = orig_attach
    return rows


def part_validity(llm, samples: int, any_whitespace: bool = True) -> dict:
    import re

    import jsonschema

    from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

    results = {}
    cases = [
        (name, StructuredOutputsParams(json=s, disable_any_whitespace=not any_whitespace), PROMPTS[name])
        for name, s in SCHEMA_SUITE.items()
    ]
    cases.append(
        (
            "regex_phone",
            StructuredOutputsParams(regex=r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}"),
            "Give me a US phone number.",
        )
    )
    cases.append(
        (
            "choice",
            StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
            "Sentiment of: 'I love this phone!'",
        )
    )
    total = ok = 0
    for name, so, prompt in cases:
        msgs = [[{"role": "user", "content": prompt}]] * samples
        params = [
            SamplingParams(max_tokens=300, temperature=0.7, seed=i, structured_outputs=so)
            for i in range(samples)
        ]
        outs = llm.chat(msgs, params, use_tqdm=False)
        good, reasons, example = 0, {}, None
        for o in outs:
            c = o.outputs[0]
            reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
            try:
                if so.json is not None:
                    jsonschema.validate(json.loads(c.text), so.json)
                elif so.regex is not None:
                    assert re.fullmatch(so.regex, c.text)
                else:
                    assert c.text in so.choice
                good += 1
            except Exception:
                pass
            example = example or c.text
        results[name] = {"valid": good, "of": len(outs), "finish": reasons, "example": example[:200]}
        total += len(outs)
        ok += good
    return {"part": "validity", "any_whitespace": any_whitespace, "valid": ok, "of": total, "cases": results}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a restaurant table",
            "parameters": {
                "type": "object",
                "properties": {
                    "restaurant": {"type": "string", "maxLength": 30},
                    "people": {"type": "integer", "minimum": 1, "maximum": 12},
                    "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                },
                "required": ["restaurant", "people", "time"],
            },
        },
    },
]


def part_tools(llm, samples: int) -> dict:
    """tool_choice "required" and named, as the server runs them (hermes tools prompt for a
    template without tools, the forced JSON schema): share of calls whose arguments parse and
    validate against the function's parameters."""
    import jsonschema

    from pagedserve.sampling_params import SamplingParams
    from pagedserve.server.tool_calls import (
        check_tools,
        forced_structured_outputs,
        parse_forced,
        tools_system_prompt,
    )

    questions = ["What's the weather like in Lyon?", "Book a table for 4 at Chez Paul at 19:30."]
    res = {}
    for choice in ("required", {"type": "function", "function": {"name": "book_table"}}):
        functions, norm = check_tools(TOOLS, choice)
        so = forced_structured_outputs(functions, norm)
        params = {f["name"]: f["parameters"] for f in functions}
        msgs = [
            [{"role": "system", "content": tools_system_prompt(functions)}, {"role": "user", "content": q}]
            for q in questions
            for _ in range(samples // len(questions))
        ]
        sps = [
            SamplingParams(max_tokens=300, temperature=0.7, seed=i, structured_outputs=so)
            for i in range(len(msgs))
        ]
        good = total = 0
        for o in llm.chat(msgs, sps, use_tqdm=False):
            calls = parse_forced(o.outputs[0].text, norm)
            total += 1
            try:
                assert calls
                for c in calls:
                    jsonschema.validate(json.loads(c.arguments), params[c.name])
                good += 1
            except Exception:
                pass
        res["required" if choice == "required" else "named"] = {"valid": good, "of": total}
    return {"part": "tools", **res}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--parts", default="compile,mask,validity")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if "compile" in parts:
        print(json.dumps(part_compile(args.model)), flush=True)
    if {"mask", "validity", "tools"} & set(parts):
        from pagedserve import LLM

        sizes = [int(x) for x in args.batch_sizes.split(",")]
        llm = LLM(args.model, max_num_seqs=max(sizes + [8]))
        if "validity" in parts:
            print(json.dumps(part_validity(llm, args.samples)), flush=True)
        if "tools" in parts:
            print(json.dumps(part_tools(llm, args.samples)), flush=True)
        if "mask" in parts:
            part_mask(llm, sizes, args.output_len)


if __name__ == "__main__":
    main()
