"""Length-aware scheduling end to end: the same greedy tokens as FCFS offline; through the
server a short request's first token is not held behind a long prompt's prefill (it is,
under FCFS: the control); SLO attainment is counted in /metrics."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.frontend.llm import LLM  # noqa: E402
from tests.server.test_server import MODEL, Server, metric  # noqa: E402

KW = dict(dtype="float32", num_kv_blocks=400, max_model_len=2048)


def test_length_aware_gives_fcfs_tokens(checkpoint):
    path = checkpoint("llama")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 900 + 5 for j in range(n)]} for i, n in enumerate([700, 9, 300, 17, 60])]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (20, 8, 12, 30, 5)]
    params[1] = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)  # learned length
    outs = {}
    for policy in ("fcfs", "length_aware"):
        llm = LLM(path, scheduling_policy=policy, max_num_batched_tokens=64, **{**KW, "max_model_len": 1024})
        outs[policy] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert outs["fcfs"] == outs["length_aware"]


def first_token_times(url: str, long_prompt: list[int], short_prompt: list[int]) -> tuple[float, float]:
    """Send the long request, wait until it runs, then the short one; the wall time of each
    one's first streamed token."""
    times = {}

    def stream(name, prompt, max_tokens):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] is not None:
                    times.setdefault(name, time.monotonic())

    long_t = threading.Thread(target=stream, args=("long", long_prompt, 4))
    long_t.start()
    deadline = time.time() + 30
    while not metric(url, "pagedserve:num_requests_running"):
        assert time.time() < deadline
        time.sleep(0.01)
    stream("short", short_prompt, 4)
    long_t.join(120)
    return times["long"], times["short"]


@pytest.mark.parametrize("policy", ["fcfs", "length_aware"])
def test_a_short_request_is_not_held_behind_a_long_prefill(checkpoint, policy, monkeypatch):
    # +10 ms per step: the long prefill (60 steps of 32 tokens) lasts > 0.6 s, so the short
    # request always arrives while it runs (on a fast CPU it could arrive in its last step,
    # where both first tokens come out of the same step and the order is a coin toss)
    monkeypatch.setenv("PAGEDSERVE_TEST_SLOW_ENGINE", "0:0.01")
    s = Server(checkpoint("llama"), engine_kw={"scheduling_policy": policy, "max_num_batched_tokens": 32})
    try:
        long_prompt = [(3 * j) % 900 + 5 for j in range(1900)]
        t_long, t_short = first_token_times(s.url, long_prompt, [11, 12, 13])
        if policy == "length_aware":
            assert t_short < t_long  # admitted in the short lane while the long prefill goes on
        else:
            assert t_short >= t_long - 0.01  # FCFS: behind the whole prefill (the control)
    finally:
        s.stop()


def test_slo_attainment_is_counted(checkpoint):
    s = Server(checkpoint("llama"), engine_kw={"scheduling_policy": "length_aware"}, default_slo={"ttft_ms": 60_000})
    try:
        def complete(**extra):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra}
            assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200

        complete()  # the server's default: ttft 60 s, met
        complete(slo={"ttft_ms": 60_000, "tpot_ms": 1e-6, "name": "strict"})  # tpot missed
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "slo": {"ttft_ms": -1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo"
        text = httpx.get(s.url + "/metrics").text

        def count(kind, cls, target):
            for line in text.splitlines():
                if line.startswith(f"pagedserve:slo_{kind}_total{{") and f'slo_class="{cls}"' in line and f'target="{target}"' in line:
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        assert count("attained", "ttft60000", "ttft") == 1
        assert count("attained", "strict", "ttft") == 1 and count("missed", "strict", "tpot") == 1
        assert count("missed", "ttft60000", "ttft") == 0
    finally:
        s.stop()
