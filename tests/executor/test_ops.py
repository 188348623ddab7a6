"""The fused C++ ops (pagedserve.executor.ops) against their PyTorch references.

The kernels are built once per machine for the ISA the CPU has (-march=native; vector code
16 lanes wide with AVX-512, 8 with AVX2, 4 otherwise), so each machine tests its own path;
`test_isa` records which one ran. Without a compiler the module is None and every test here
skips: the model then runs the references themselves.
"""

import pytest
import torch

from pagedserve.executor import ops

K = ops.load()
pytestmark = pytest.mark.skipif(K is None, reason="fused C++ ops did not build on this machine")

DTYPES = [torch.float32, torch.bfloat16]


def _ulp_close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    else:  # one bf16 rounding step apart at most
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2)


def test_isa():
    try:
        with open("/proc/cpuinfo") as fh:
            flags = fh.read()
    except OSError:
        flags = ""
    isa = K.isa()
    if "avx512f" in flags:
        assert isa == "avx512"
    elif " avx2" in flags:
        assert isa == "avx2"
    assert isa in ("avx512", "avx2", "sse4", "generic")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_add_rms_norm(dtype, rows):
    torch.manual_seed(rows)
    e = 576
    x, res, w = torch.randn(rows, e, dtype=dtype), torch.randn(rows, e, dtype=dtype), torch.randn(e, dtype=dtype)
    ref_y, ref_h = ops.add_rms_norm_ref(x, res, w, 1e-5)
    xk, rk = x.clone(), res.clone()
    K.add_rms_norm_(xk, rk, w, 1e-5)
    assert torch.equal(rk, ref_h)  # the residual sum is exact
    _ulp_close(xk, ref_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype):
    torch.manual_seed(0)
    big = torch.randn(5, 100, dtype=dtype)
    x = big[:, :64]  # row stride 100
    w = torch.randn(64, dtype=dtype)
    _ulp_close(K.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), dtype)


def _rope_inputs(t, h, k, d, dtype):
    qkv = torch.randn(t, (h + 2 * k) * d, dtype=dtype)
    pos = torch.arange(t) * 37 + 5
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    fr = pos.float()[:, None] * inv[None]
    emb = torch.cat((fr, fr), -1)
    return qkv, emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 7, 64])
def test_rotary_bit_exact(dtype, t):
    torch.manual_seed(t)
    h, k, d = 9, 3, 64
    qkv, cos, sin = _rope_inputs(t, h, k, d, dtype)
    q, kk, v = qkv.split([h * d, k * d, k * d], -1)
    ref_q = ops.rotate_ref(q.reshape(t, h, d), cos, sin)
    ref_k = ops.rotate_ref(kk.reshape(t, k, d), cos, sin)
    ref_v = v.clone()
    K.rotary_(qkv, cos, sin, h, k, d)
    q, kk, v = qkv.split([h * d, k * d, k * d], -1)
    assert torch.equal(q.reshape(t, h, d), ref_q)  # same roundings as eager PyTorch
    assert torch.equal(kk.reshape(t, k, d), ref_k)
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kv_dtype", [None, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
)  # None: the model's
def test_rotary_cache_writes_kv(dtype, kv_dtype):
    torch.manual_seed(1)
    t, h, k, d, nb, bs = 5, 4, 2, 32, 6, 4
    kv_dtype = kv_dtype or dtype
    qkv, cos, sin = _rope_inputs(t, h, k, d, dtype)
    qkv[0] *= 1000  # float8: past e4m3fn's 448 (saturates) and into e5m2's coarse range
    qkv[1] *= 1e-3  # float8 subnormals
    ref = qkv.clone()
    K.rotary_(ref, cos, sin, h, k, d)
    kc, vc = torch.zeros(nb, bs, k, d, dtype=kv_dtype), torch.zeros(nb, bs, k, d, dtype=kv_dtype)
    slots = torch.tensor([4, 9, 10, 23, 5])
    K.rotary_cache_(qkv, cos, sin, h, k, d, kc, vc, slots)
    assert torch.equal(qkv, ref)
    _, rk, rv = ref.split([h * d, k * d, k * d], -1)
    # a narrower cache holds what torch's rounding (.to) gives
    def bits(x):  # compared as stored (float8 has no equality kernels)
        return x.view(torch.uint8) if x.dtype.itemsize == 1 else x

    assert torch.equal(bits(kc.view(-1, k, d)[slots]), bits(rk.reshape(t, k, d).to(kv_dtype)))
    assert torch.equal(bits(vc.view(-1, k, d)[slots]), bits(rv.reshape(t, k, d).to(kv_dtype)))
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not bits(kc.view(-1, k, d)[untouched]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 1000, 6])  # vector body + tail, tail only
def test_silu_and_mul(dtype, width):
    torch.manual_seed(width)
    gu = torch.randn(9, 2 * width, dtype=dtype) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # clamped exp range, zero
    _ulp_close(K.silu_and_mul(gu), ops.silu_and_mul_ref(gu), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_argmax(dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 49152 + 3, dtype=dtype)
    x[0, 100] = x[0, 40000] = 50.0  # a tie: the first index wins
    if rows > 1:
        x[1, 7] = float("nan")  # NaN is the maximum, as in torch.argmax
        x[2, -1] = 1e4  # in the scalar tail
    assert torch.equal(K.argmax_rows(x), x.argmax(dim=-1))


def test_dispatch_falls_back_off_cpu_kernels(monkeypatch):
    x = torch.randn(3, 8, dtype=torch.float16)  # not a kernel dtype: the reference runs
    w = torch.ones(8, dtype=torch.float16)
    assert ops.kernels_for(x) is None
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6))
    assert torch.equal(ops.argmax(x.float()), x.float().argmax(-1))


def test_model_fused_matches_reference():
    """A whole tiny model, fused ops on and off: the same greedy tokens, logits within 1e-5."""
    from pagedserve.executor.attention import get_attention_backend
    from pagedserve.executor.attention.backend import AttentionMetadata
    from pagedserve.executor.model_config import ModelConfig
    from pagedserve.executor.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 3,
            "vocab_size": 300,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, get_attention_backend("torch")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    t, bs = 12, 16
    ids = torch.randint(0, 300, (t,))
    meta = AttentionMetadata(
        num_reqs=1,
        num_decodes=0,
        query_start_loc=torch.tensor([0, t]),
        seq_lens=torch.tensor([t]),
        block_tables=torch.tensor([[1]]),
        slot_mapping=torch.arange(bs, bs + t),
        max_query_len=t,
        max_seq_len=t,
        max_decode_seq_len=0,
        query_start_loc_list=[0, t],
        seq_lens_list=[t],
    )
    outs = []
    for fused in (True, False):
        model.use_fused_ops = fused
        kv = [(torch.zeros(2, bs, 2, 16), torch.zeros(2, bs, 2, 16)) for _ in range(3)]
        with torch.inference_mode():
            outs.append(model.compute_logits(model(ids, torch.arange(t), kv, meta)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_decode_loop_equals_layer_forward(dtype):
    """Decode-only CPU steps, and a step of short queries only (speculative verification),
    through the model's lean loop (one loop over the layers' kernels, attention straight
    from the fused QKV rows) give the same logits to the bit, and the same KV cache, as the
    layers' own forward."""
    from pagedserve.executor.attention import get_attention_backend
    from pagedserve.executor.attention.backend import AttentionMetadata
    from pagedserve.executor.model_config import ModelConfig
    from pagedserve.executor.models.llama import LlamaForCausalLM

    if ops.load() is None or get_attention_backend("auto").decode_from_qkv is None:
        pytest.skip("C++ kernels could not be built here")
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "num_hidden_layers": 3,
            "vocab_size": 300,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 512,
        }
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg, get_attention_backend("auto")).eval().to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    bs, nb, lens = 16, 40, [5, 70, 200]  # 200: the context is split over the threads
    tables = torch.arange(1, 1 + 3 * 13).view(3, 13)
    caches = [(torch.randn(nb, bs, 2, 16).to(dtype), torch.randn(nb, bs, 2, 16).to(dtype)) for _ in range(3)]
    outs = []
    for lean in (True, False):
        model.use_lean_decode = lean
        model._plan = None
        kv = [(k.clone(), v.clone()) for k, v in caches]
        logits = []
        for step in range(3):
            seq = torch.tensor([n + step for n in lens])
            slots = torch.tensor([int(tables[r, (n - 1) // bs]) * bs + (n - 1) % bs for r, n in enumerate(seq.tolist())])
            meta = AttentionMetadata(
                3, 3, torch.arange(4), seq, tables, slots, 1, int(seq.max()), int(seq.max()), [0, 1, 2, 3], seq.tolist()
            )
            ids = torch.tensor([7 + step, 100, 299])
            with torch.inference_mode():
                logits.append(model.compute_logits(model(ids, seq - 1, kv, meta)))
        # a verification step: requests with 5 and 3 query tokens over their cached contexts
        qlens, seq = [5, 3], [lens[1] + 3 + 5, lens[2] + 3 + 3]
        pos = [p for q, s in zip(qlens, seq) for p in range(s - q, s)]
        rows = [r for r, q in enumerate(qlens) for _ in range(q)]
        slots = torch.tensor([int(tables[r + 1, p // bs]) * bs + p % bs for r, p in zip(rows, pos)])
        meta = AttentionMetadata(
            2, 0, torch.tensor([0, 5, 8]), torch.tensor(seq), tables[1:], slots, 5, max(seq), 0, [0, 5, 8], seq
        )
        with torch.inference_mode():
            logits.append(model.compute_logits(model(torch.arange(8) * 7, torch.tensor(pos), kv, meta))[:3])
        outs.append((torch.cat(logits), kv))
        assert bool(model.__dict__.get("_plan")) == lean  # the lean loop ran (or not)
    assert torch.equal(outs[0][0], outs[1][0])
    for (k1, v1), (k2, v2) in zip(outs[0][1], outs[1][1]):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.skipif(K is None, reason="C++ ops could not be built here")
@pytest.mark.parametrize("rows,vocab", [(1, 49152 + 3), (9, 1001), (3, 10), (2, 63)])
def test_sample_rows_matches_inverse_cdf_reference(rows, vocab):
    from pagedserve.executor.sampler import sample_from_probs, sampling_probs

    """The fused temperature sampler picks the sampler's reference token (softmax, cumsum,
    searchsorted) for the same uniforms, never a -inf (masked) token, and at u = 1 the
    last live token of the row."""
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    agree = total = 0
    for trial in range(20):
        x = torch.randn(rows, vocab, generator=g) * 3
        x[0, : vocab // 3] = float("-inf")  # a grammar-style mask
        temp = torch.rand(rows, generator=g) + 0.3
        u = 1 - torch.rand(rows, generator=g)
        if trial == 0:
            u[0] = 1.0
        got = K.sample_rows(x, temp, u)
        ref = sample_from_probs(sampling_probs(x, temp), u)
        agree += int((got == ref).sum())
        total += rows
        assert bool(torch.isfinite(x[torch.arange(rows), got]).all())  # never a masked token
        if trial == 0:
            live = torch.nonzero(torch.isfinite(x[0])).max()
            assert int(got[0]) == int(live)
    assert agree >= total - 1  # a draw on a CDF boundary may round the other way


@pytest.mark.skipif(K is None, reason="C++ ops could not be built here")
def test_sample_rows_and_argmax_read_bf16_logits_as_their_float_values():
    """bf16 logits (a bf16 model's, no conversion pass) sample and argmax exactly the tokens of
    their float32 copy: the kernels widen each value exactly and then run the same arithmetic."""
    g = torch.Generator().manual_seed(7)
    for rows, vocab in ((64, 49152), (3, 1001), (1, 37)):
        x = (torch.randn(rows, vocab, generator=g) * 4).bfloat16()
        x[0, : vocab // 4] = float("-inf")
        temp = torch.rand(rows, generator=g) + 0.3
        u = 1 - torch.rand(rows, generator=g)
        assert torch.equal(K.sample_rows(x, temp, u), K.sample_rows(x.float(), temp, u))
        assert torch.equal(K.argmax_rows(x), K.argmax_rows(x.float()))
