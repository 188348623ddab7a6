"""Speculative decoding building blocks: n-gram lookup and distribution-preserving verification."""

import numpy as np
import pytest
import torch

from pagedserve.core.ngram_proposer import NgramProposer
from pagedserve.executor.rejection_sampler import verify

# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def test_ngram_proposes_the_continuation_of_the_latest_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert p.propose(seq) == [4, 5, 9]  # "1 2 3" seen before, followed by 4 5 9
    assert p.propose([7, 8, 9]) == []  # no earlier occurrence
    assert p.propose(seq, k=1) == [4]
    # the longest n wins over a more recent shorter match
    seq = [5, 6, 7, 1, 6, 7, 2, 5, 6, 7]
    assert NgramProposer(k=1, min_n=2, max_n=3).propose(seq) == [1]
    assert NgramProposer(k=1, min_n=2, max_n=2).propose(seq) == [2]  # most recent "6 7"
    # a match at the very end proposes what there is
    assert NgramProposer(k=4, min_n=1, max_n=1).propose([3, 3]) == [3]
    with pytest.raises(ValueError):
        NgramProposer(k=0)


def _ngram_by_window_scan(toks, k, min_n, max_n):
    """The rule spelled out: for n from max_n down, the latest earlier window equal to the
    last n tokens; what followed it."""
    for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
        suffix = toks[len(toks) - n :]
        starts = [s for s in range(len(toks) - n) if toks[s : s + n] == suffix]
        if starts:
            return toks[starts[-1] + n : starts[-1] + n + k]
    return []


def test_ngram_matches_the_window_scan_rule():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        n_tok = int(rng.integers(0, 40))
        vocab = int(rng.integers(1, 6))  # small vocabularies: many overlapping matches
        toks = rng.integers(0, vocab, n_tok).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 7))
        got = NgramProposer(k, min_n, max_n).propose(toks)
        assert got == _ngram_by_window_scan(toks, k, min_n, max_n), (toks, k, min_n, max_n)


def test_greedy_verification_accepts_while_argmax_agrees():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([4, 7, 1, 2]):
        logits[i, t] = 5.0
    assert verify(logits, [4, 7, 3], greedy=True) == [4, 7, 1]  # third draft wrong: argmax instead
    assert verify(logits, [4, 7, 1], greedy=True) == [4, 7, 1, 2]  # all accepted + bonus
    assert verify(logits, [0, 7, 1], greedy=True) == [4]


def _chi2_ok(counts, probs, n):
    keep = probs * n >= 5
    expected = probs[keep] * n
    observed = counts[keep]
    if (~keep).any():  # fold the rare cells together
        expected = np.append(expected, probs[~keep].sum() * n)
        observed = np.append(observed, counts[~keep].sum())
    chi2 = float((((observed - expected) ** 2) / expected).sum())
    return chi2 < CHI2_001[len(expected) - 1], chi2


@pytest.mark.parametrize("draft", ["point", "distribution"])
def test_verification_preserves_the_target_distribution(draft):
    torch.manual_seed(0)
    V, k, n = 8, 2, 12_000
    target = torch.softmax(torch.randn(k + 1, V) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V) * 1.5, dim=-1) if draft == "distribution" else None
    g = torch.Generator().manual_seed(1)
    first = np.zeros(V)
    second_given_first = np.zeros(V)
    accepted = 0
    for _ in range(n):
        if q is None:
            d = [3, 5]
        else:
            d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        out = verify(target, d, q, greedy=False, generator=g)
        assert 1 <= len(out) <= k + 1
        first[out[0]] += 1
        accepted += len(out) - 1
        if len(out) >= 2:
            second_given_first[out[1]] += 1
    assert _chi2_ok(first, target[0].double().numpy(), n)[0]
    # when the first token came from an accepted draft, the next one is still ~ p_2
    m = int(second_given_first.sum())
    assert m > 500 and _chi2_ok(second_given_first, target[1].double().numpy(), m)[0]
    assert accepted > 0


def test_seeded_verification_reproduces():
    target = torch.softmax(torch.randn(3, 16), dim=-1)
    a = [verify(target, [1, 2], generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


# -- end to end ---------------------------------------------------------------------
from pagedserve import LLM, SamplingParams  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
KW = dict(dtype="float32", max_model_len=256)


def _prompts(n):
    # repetitive prompts: n-gram lookup finds matches, and a random model's greedy
    # continuation tends to repeat too
    return [{"prompt_token_ids": ([7, 8, 9, 10 + i, 11] * 6)[: 20 + i]} for i in range(n)]


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A different random model with the target's vocabulary (one layer, narrower)."""
    from tests.checkpoints import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("draft")), "llama", seed=5, num_hidden_layers=1, hidden_size=64, num_attention_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def near_draft(llama, tmp_path_factory):
    """The target with noise on its weights: it agrees with the target often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("near"))
    shutil.copytree(llama, out, dirs_exist_ok=True)
    path = f"{out}/model.safetensors"
    g = torch.Generator().manual_seed(3)
    weights = {k: v + 0.03 * torch.randn(v.shape, generator=g) for k, v in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    return out


def _spec(method: str, llama: str, draft: str | None = None) -> dict:
    if method == "ngram":
        return SPEC
    return {"method": "draft_model", "model": draft or llama, "num_speculative_tokens": 3}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("own", [True, False], ids=["target-as-draft", "small-draft"])
def test_greedy_tokens_identical_with_draft_model(llama, small_draft, n, own):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM(llama, num_kv_blocks=200, **KW).generate(_prompts(n), sp, use_tqdm=False)
    spec = {**_spec("draft_model", llama, None if own else small_draft), "max_batch_size": 8}
    llm = LLM(llama, num_kv_blocks=200, speculative_config=spec, **KW)
    out = llm.generate(_prompts(n), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in base]
    st = llm.get_stats()
    assert st.spec_num_drafts > 0 and st.kv_blocks_used == 0
    if own:  # the target guessing for itself: every guess is right
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
    else:
        assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens


def test_draft_guesses_are_the_drafts_own_greedy_continuation(llama, near_draft, monkeypatch):
    """The draft's K/V is kept incrementally (catch-up chunks, rollback past rejected
    guesses, shared block tables): each step's guesses must equal what the draft model
    says from scratch for the same sequence."""
    from pagedserve.executor.draft_model import DraftModelProposer

    seen = []
    orig = DraftModelProposer._propose

    def record(self, runner, todo):
        guesses = orig(self, runner, todo)
        for sr in todo:
            st = runner.requests[sr.req_id]
            seq = (st.prompt_token_ids + st.output_token_ids)[: sr.num_computed_tokens + 1]
            seen.append((seq, guesses[sr.req_id]))
        return guesses

    monkeypatch.setattr(DraftModelProposer, "_propose", record)
    spec = {**_spec("draft_model", llama, near_draft), "max_batch_size": 8}
    llm = LLM(llama, num_kv_blocks=200, speculative_config=spec, **KW)
    llm.generate(_prompts(3), SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)
    st = llm.get_stats()
    assert len(seen) >= 10 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # rollbacks happened
    ref = LLM(near_draft, num_kv_blocks=200, **KW)
    for seq, guesses in seen[:24]:
        (out,) = ref.generate(
            {"prompt_token_ids": seq}, SamplingParams(max_tokens=len(guesses), temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        assert out.outputs[0].token_ids == guesses


def test_draft_model_config_errors(llama, tmp_path):
    from tests.checkpoints import build_checkpoint

    with pytest.raises(ValueError, match="model"):
        LLM(llama, speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **KW)
    other = build_checkpoint(str(tmp_path / "v500"), "llama", vocab_size=500)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama, speculative_config={"model": other, "num_speculative_tokens": 2}, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(llama, tensor_parallel_size=2, speculative_config={"model": llama}, **KW)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_greedy_tokens_identical_with_ngram_speculation(llama, n):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM(llama, num_kv_blocks=200, **KW).generate(_prompts(n), sp, use_tqdm=False)
    llm = LLM(llama, num_kv_blocks=200, speculative_config={**SPEC, "max_batch_size": 8}, **KW)
    spec = llm.generate(_prompts(n), sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    st = llm.get_stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0
    assert st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert st.spec_mean_accepted_length > 1.0
    assert sum(st.spec_accepted_per_position) == st.spec_num_accepted_tokens
    assert st.kv_blocks_used == 0 and st.num_running == 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_preemption_stops_and_max_tokens(llama, method):
    sps = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop=stop)
        for m, stop in [(30, None), (7, None), (40, None), (25, None), (30, None), (18, None)]
    ]
    base_llm = LLM(llama, num_kv_blocks=200, **KW)
    base = base_llm.generate(_prompts(6), sps, use_tqdm=False)
    # stop strings taken from the reference text, so they occur mid-output
    texts = [o.outputs[0].text for o in base]
    stops = [t[len(t) // 2 : len(t) // 2 + 3] if len(t) > 8 else None for t in texts]
    sps = [SamplingParams(max_tokens=sp.max_tokens, temperature=0, ignore_eos=True, stop=s) for sp, s in zip(sps, stops)]
    base = base_llm.generate(_prompts(6), sps, use_tqdm=False)
    # a small cache: requests are preempted and recomputed while speculating
    spec = {**_spec(method, llama), "max_batch_size": 8}
    llm = LLM(llama, num_kv_blocks=14 if method == "ngram" else 10, block_size=8, speculative_config=spec, **KW)
    spec = llm.generate(_prompts(6), sps, use_tqdm=False)
    for a, b in zip(spec, base):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    st = llm.get_stats()
    assert st.num_preemptions > 0 and st.spec_num_drafts > 0
    assert st.kv_blocks_used == 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_abort_mid_speculation_frees_blocks(llama, method):
    llm = LLM(llama, num_kv_blocks=200, speculative_config=_spec(method, llama), **KW)
    eng = llm.engine
    eng.add_request("a", _prompts(1)[0], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert llm.get_stats().spec_num_drafts > 0
    eng.abort_request("a")
    assert llm.get_stats().kv_blocks_used == 0 and not eng.has_unfinished_requests()


def _chi2_crit(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at alpha = 0.001."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_tokens_keep_their_distribution_with_speculation(tmp_path, monkeypatch, method):
    """Temperature 1 with top-p: the token at each output position has the same
    distribution with and without speculation (a chi-square test of homogeneity). A random
    model's samples rarely repeat the prompt, so the proposer is made to guess every step
    (any guesses must leave the distribution unchanged); the draft model is another random
    model, so its greedy guesses are often rejected and the residual draws matter."""
    from pagedserve.core.ngram_proposer import NgramProposer
    from tests.checkpoints import build_checkpoint

    monkeypatch.setattr(NgramProposer, "propose", lambda self, toks, k=None: list(toks[-1 : -(k or self.k) - 1 : -1]))
    model = build_checkpoint(str(tmp_path / "v32"), "llama", vocab_size=32)  # few tokens: counts per cell
    draft = {**SPEC, "max_batch_size": 1024}
    if method == "draft_model":
        other = build_checkpoint(str(tmp_path / "d32"), "llama", seed=7, vocab_size=32)
        draft = {"model": other, "num_speculative_tokens": 3, "max_batch_size": 1024}
    n, pos = 600, 3
    prompt = {"prompt_token_ids": [7, 8, 9, 10, 11] * 8}
    sp = SamplingParams(n=n, max_tokens=pos + 1, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    runs = {}
    for name, spec in (("base", None), ("spec", draft)):
        llm = LLM(model, num_kv_blocks=1500, max_num_seqs=640, speculative_config=spec, **KW)
        (out,) = llm.generate(prompt, sp, use_tqdm=False)
        runs[name] = [c.token_ids for c in out.outputs]
        if spec:
            st = llm.get_stats()
            assert st.spec_num_drafts > n and st.spec_num_draft_tokens > st.spec_num_drafts
    for p in range(1, pos + 1):
        a = np.bincount([t[p] for t in runs["base"]], minlength=32).astype(float)
        b = np.bincount([t[p] for t in runs["spec"]], minlength=32).astype(float)
        tot = a + b
        keep = tot >= 10
        cols = [a[keep], b[keep]]
        if (~keep).any():
            cols = [np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())]
        table = np.stack(cols)
        table = table[:, table.sum(axis=0) > 0]
        expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        df = table.shape[1] - 1
        assert df >= 5 and chi2 < _chi2_crit(df), (p, chi2, df)


def test_spec_counters_in_prometheus_metrics():
    pytest.importorskip("prometheus_client")
    from pagedserve.messages import EngineStats
    from pagedserve.server.metrics import ServerMetrics

    stats = EngineStats(*([0] * 16), spec_num_drafts=5, spec_num_draft_tokens=12, spec_num_accepted_tokens=9,
                        spec_accepted_per_position=[5, 3, 1])
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert 'pagedserve:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0' in text


def test_step_model_replays_proposer_and_costs():
    """benchmarks/spec_step_model.py: the n-gram proposer replayed on fixed greedy outputs,
    a step verifying r rows costing 1 + c (r - 1) plain steps."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_step_model.py"
    spec = importlib.util.spec_from_file_location("spec_step_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prompt = list(range(5, 16))
    out = list(range(5, 13))  # copies the prompt's start
    # [14, 15] and [15, 5] unseen: two plain steps; then [5, 6] matches: 4 guesses, all
    # accepted (+1); the last token has no room for guesses: plain
    r = mod.replay([prompt], [out], k_max=4, c=0.5)
    assert (r["plain_steps"], r["verify_steps"], r["tokens"]) == (3, 1, 8)
    assert r["speedup"] == round(8 / (3 + 1 + 0.5 * 4), 3)


def test_adaptive_k_halves_on_misses_pauses_and_doubles_back():
    from pagedserve.config import SpeculativeConfig
    from pagedserve.core.request import Request
    from pagedserve.core.spec_decode import PAUSE_STEPS, SpecDecodeState
    from pagedserve.sampling_params import SamplingParams

    spec = SpecDecodeState(SpeculativeConfig(num_speculative_tokens=4))
    r = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0), max_tokens=100)
    assert spec.propose(r, 100) == [3, 1, 2]  # what followed the latest match (up to k = 4)
    spec.record(r, 4, 0)
    assert r.spec_k == 2
    spec.record(r, 2, 0)
    spec.record(r, 1, 0)  # a miss at k = 1: a pause
    assert r.spec_k == 1 and r.spec_pause == PAUSE_STEPS
    assert all(spec.propose(r, 100) is None for _ in range(PAUSE_STEPS))
    spec.record(r, 1, 1)
    spec.record(r, 2, 2)
    assert r.spec_k == 4
    assert spec.num_drafts == 5 and spec.num_accepted_tokens == 3 and spec.accepted_per_position[:2] == [2, 1]
    # never past max_tokens, and a penalised request is never speculative
    assert spec.propose(Request("s", [1, 2, 1, 2], SamplingParams(temperature=0), max_tokens=2), 100) == [1]
    pen = Request("p", [1, 2, 1, 2], SamplingParams(repetition_penalty=1.2), max_tokens=50)
    assert spec.propose(pen, 100) is None and pen.spec_k == -1
