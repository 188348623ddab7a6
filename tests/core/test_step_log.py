"""core/step_log.py: `--step-log` writes one line per engine step with what it ran, in the
shape bench/mixed_sim.py fits its step-time model on."""

import json

from pagedserve import LLM, SamplingParams
from pagedserve.bench.mixed_sim import fit
from pagedserve.core.step_cost import OnlineStepCost, step_features
from pagedserve.core.step_log import StepLog


def test_an_engine_logs_every_step_it_runs(checkpoint, tmp_path, monkeypatch):
    """...and reports the same steps, with the same seconds, to the length-aware policy's
    step-time model (long_lane_step_ms)."""
    seen = []
    monkeypatch.setattr(OnlineStepCost, "observe", lambda self, feats, sec: seen.append((feats, sec)))
    path = tmp_path / "steps.jsonl"
    llm = LLM(
        checkpoint("llama"), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32,
        scheduling_policy="length_aware", short_request_tokens=40, step_log=str(path),
    )
    prompts = [[5 + i for i in range(50)], [7, 8, 9]]  # 50 tokens: chunked (budget 32, the long lane's cap)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.shutdown()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert all(len(row) == 3 for _, _, rows in lines for row in rows) and len(lines) >= 5
    # every token run is logged once: 53 prompt tokens and 3 decodes for each request
    assert sum(tokens for _, _, rows in lines for _, tokens, _ in rows) == 53 + 2 * 3
    decodes = [row for _, _, rows in lines for row in rows if row[1] == 1]
    assert len(decodes) == 6 and {row[2] for row in decodes} == {3, 4, 5, 50, 51, 52}  # cached tokens before it
    short = {row[0] for row in decodes if row[2] < 10}
    long = {row[0] for row in decodes if row[2] >= 50}
    assert short == {1} and long == {0}  # the length-aware lane of each
    assert [t for t, _, _ in lines] == sorted(t for t, _, _ in lines)
    assert fit([str(path)])["steps"] == len(lines)
    assert [f for f, _ in seen] == [step_features(rows) for _, _, rows in lines]
    assert [round(sec, 6) for _, sec in seen] == [sec for _, sec, _ in lines]


def test_rows_of_a_request_that_left_count_as_long(tmp_path):
    class Sr:
        def __init__(self, rid, n, c):
            self.req_id, self.token_ids, self.num_computed_tokens = rid, [0] * n, c

    class R:
        is_short = True

    log = StepLog(str(tmp_path / "s.jsonl"))
    assert log.rows([Sr("a", 1, 7), Sr("gone", 3, 0)], {"a": R()}) == [[1, 1, 7], [0, 3, 0]]
    log.write(0.25, [[1, 1, 7]])
    log.close()
    (line,) = (tmp_path / "s.jsonl").read_text().splitlines()
    assert json.loads(line)[1:] == [0.25, [[1, 1, 7]]]
