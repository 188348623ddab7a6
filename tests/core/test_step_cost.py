"""The step-time model (core/step_cost.py): features, the online fit's convergence, its
window, and the prompt tokens a step may take within a time."""

import random

from pagedserve.core.step_cost import FEATURES, OnlineStepCost, features_of, step_features

TRUE = {  # seconds per feature of a made-up CPU
    "const": 0.01, "decode_rows": 0.003, "decode_ctx_k": 0.001, "prefill_100": 0.1, "prefill_attn_1e5": 0.09,
    "prefill_over_128_100": 0.0, "prefill_over_256_100": 0.0,
}


def seconds(feats, coef=TRUE, noise=0.0, rng=None):
    t = sum(coef[k] * v for k, v in zip(FEATURES, feats))
    return t * (1 + noise * rng.uniform(-1, 1)) if rng else t


def random_step(rng):
    """A step's rows: some decodes, maybe a prefill chunk at some context."""
    rows = [(1, rng.randint(10, 3000)) for _ in range(rng.randint(0, 20))]
    if rng.random() < 0.5:
        rows.append((rng.choice([64, 128, 200, 384, 512]), rng.randint(0, 2500)))
    return rows or [(1, 5)]


def test_features_of_rows_and_of_totals_agree():
    rows = [(1, 100), (1, 2900), (300, 1000), (40, 0)]
    attn = 300 * (1000 + 150) + 40 * 20
    assert step_features(rows) == features_of(2, 3000, 340, attn)
    assert step_features([[0, 1, 100], [1, 300, 1000]]) == step_features([(1, 100), (300, 1000)])  # step-log rows


def test_online_fit_converges_and_is_not_ready_before_enough_prefill_steps():
    rng = random.Random(0)
    m = OnlineStepCost(min_steps=64, min_prefill_steps=16)
    for _ in range(200):  # decode-only steps: nothing known about prefill yet
        f = step_features([(1, 500)] * rng.randint(1, 8))
        m.observe(f, seconds(f))
    assert not m.ready
    for _ in range(600):
        f = step_features(random_step(rng))
        m.observe(f, seconds(f, noise=0.05, rng=rng))
    assert m.ready
    for _ in range(50):
        f = step_features(random_step(rng))
        assert abs(m.predict(f) - seconds(f)) < 0.05 * seconds(f) + 0.005


def test_the_window_follows_a_cpu_that_changed():
    rng = random.Random(1)
    m = OnlineStepCost(window=256, refit_every=16)
    slow = {**TRUE, "prefill_attn_1e5": 0.3}
    for coef in (TRUE, slow):
        for _ in range(400):
            f = step_features(random_step(rng))
            m.observe(f, seconds(f, coef))
    f = features_of(0, 0, 512, 512 * (2000 + 256))
    assert abs(m.predict(f) - seconds(f, slow)) < 0.01 * seconds(f, slow)


def fitted(coef=TRUE):
    rng = random.Random(2)
    m = OnlineStepCost()
    for _ in range(300):
        f = step_features(random_step(rng))
        m.observe(f, seconds(f, coef))
    return m


def test_prefill_within_is_the_most_tokens_that_keep_the_step_in_time():
    m = fitted()
    base = (10, 5000, 0, 0.0)
    for context in (0, 1000, 2500):
        n = m.prefill_within(0.5, base, context, 512)
        assert 0 < n < 512 and n % 16 == 0
        def at(k, context=context):
            return seconds(features_of(10, 5000, k, k * (context + k / 2)))

        assert at(n) <= 0.5 + 1e-6 < at(n + 16)
    assert m.prefill_within(0.5, base, 0, 512) > m.prefill_within(0.5, base, 2500, 512)  # late chunks: fewer
    assert m.prefill_within(60.0, base, 0, 300) == 300  # all of it fits: `most`, not a multiple of 16
    assert m.prefill_within(0.01, base, 0, 512) == 0  # not even 16 tokens fit


def test_one_slow_step_does_not_skew_the_fit_but_a_slower_cpu_is_followed():
    rng = random.Random(3)
    m = fitted()
    f = features_of(0, 0, 512, 512 * 256)
    before = m.predict(f)
    m.observe(step_features(random_step(rng)), 30.0)  # a 30 s pause of the process
    for _ in range(64):
        g = step_features(random_step(rng))
        m.observe(g, seconds(g))
    assert abs(m.predict(f) - before) < 0.02 * before
    slow = {k: 2 * v for k, v in TRUE.items()}
    for _ in range(2048):  # the CPU got 2x slower: each step's time is within the bound
        g = step_features(random_step(rng))
        m.observe(g, seconds(g, slow))
    assert abs(m.predict(f) - seconds(f, slow)) < 0.02 * seconds(f, slow)
