"""Tiny random-weight checkpoints, written with transformers at test time (nothing is downloaded)."""

from __future__ import annotations

import json
import os

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paged attention splits the KV cache into blocks. "
    "Continuous batching schedules every iteration. 你好，世界！今天天气很好。 Emoji: 🚀🔥😀👍🏽 "
    "def f(x):\n    return x * 2\n\nimport numpy as np\nprint('hello world')\n"
) * 20

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# odd shapes: hidden 96 with head_dim 32, 3:1 GQA, vocab no multiple of 64
ARCH_KWARGS = {
    "llama": dict(cls="LlamaConfig", tie_word_embeddings=False),
    "llama_tied_llama3rope": dict(
        cls="LlamaConfig",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "mistral": dict(cls="MistralConfig", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", tie_word_embeddings=False, head_dim=40),
    # heads that divide by 2 (tensor parallelism): a single KV head (replicated over the
    # ranks) with the odd vocabulary of 1001 (padded to 2 x 501); 2 KV heads (split)
    "llama_tp": dict(cls="LlamaConfig", tie_word_embeddings=False, hidden_size=128, num_attention_heads=4),
    "qwen2_tp": dict(
        cls="Qwen2Config", tie_word_embeddings=True, hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    ),
    # mixture of experts: expert counts that do not divide the 2 threads, top-k 1 and 2, a
    # shared expert, a dense layer among sparse ones, OLMoE's full-width q/k norms and clamp
    "mixtral": dict(cls="MixtralConfig", tie_word_embeddings=False, num_local_experts=5, num_experts_per_tok=2,
                    intermediate_size=64, sliding_window=None),
    # widths that are multiples of 64 (2I = 128, H = 128): the brgemm experts (ops/moe_gemm.py)
    "mixtral_wide": dict(cls="MixtralConfig", tie_word_embeddings=False, num_local_experts=5, num_experts_per_tok=2,
                         intermediate_size=64, sliding_window=None, hidden_size=128, num_attention_heads=4),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", tie_word_embeddings=False, num_hidden_layers=3, num_experts=7,
                      num_experts_per_tok=1, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                      mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", tie_word_embeddings=True, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=40, norm_topk_prob=True, head_dim=40),
    "olmoe": dict(cls="OlmoeConfig", tie_word_embeddings=False, num_experts=5, num_experts_per_tok=3,
                  intermediate_size=48, norm_topk_prob=False, clip_qkv=2.0, num_key_value_heads=3,
                  pad_token_id=1),
    # sliding windows: smaller than a block, spanning several blocks (8 / 16)
    "mistral_w5": dict(cls="MistralConfig", tie_word_embeddings=False, sliding_window=5),
    "mistral_w40": dict(cls="MistralConfig", tie_word_embeddings=False, sliding_window=40),
    # Gemma 2: alternating sliding (window 12) / global layers, soft caps small enough to
    # matter, a query_pre_attn_scalar unlike head_dim
    "gemma2": dict(cls="Gemma2Config", num_hidden_layers=3, sliding_window=12, attn_logit_softcapping=1.5,
                   final_logit_softcapping=2.0, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh"),
    # Gemma 3: 3 sliding (window 10) : 1 global, local rope base 10k, global 50k scaled x2
    "gemma3": dict(cls="Gemma3TextConfig", num_hidden_layers=4, sliding_window=10, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint; LongRoPE with a short original
    # length (48) so prompts cross it, and a sliding window as Phi-3-mini's configs have
    "phi3": dict(cls="Phi3Config", tie_word_embeddings=False, pad_token_id=0, sliding_window=30,
                 original_max_position_embeddings=48,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.02 * i for i in range(16)],
                                  "long_factor": [1.0 + 0.3 * i for i in range(16)],
                                  "original_max_position_embeddings": 48}),
    # tensor parallelism over experts' intermediate (48 / 2, shared 80 / 2), a dense layer,
    # 2 KV heads, and sliding layers (KV cache groups on each rank)
    "qwen2_moe_tp": dict(cls="Qwen2MoeConfig", tie_word_embeddings=False, hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=3, num_experts=5, num_experts_per_tok=2,
                         moe_intermediate_size=48, shared_expert_intermediate_size=80, mlp_only_layers=[2],
                         use_sliding_window=True, sliding_window=12,
                         layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "qwen3_tp": dict(cls="Qwen3Config", tie_word_embeddings=False, head_dim=40, num_attention_heads=4, num_key_value_heads=2),
}


def build_tokenizer(out_dir: str, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    import transformers

    kw = dict(ARCH_KWARGS[arch])
    cls = getattr(transformers, kw.pop("cls"))
    params = dict(
        vocab_size=1001,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=2,
    )
    params.update(kw)
    params.update(overrides)
    cfg = cls(**params)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits differ visibly
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


def load_hf(model_dir: str, dtype=torch.float32):
    import transformers

    # Attention scores with a soft cap (Gemma 2) need the eager attention: transformers 5.17
    # picked sdpa by default and silently dropped the cap (other greedy tokens on an H200),
    # 5.25 refuses the pair
    with open(os.path.join(model_dir, "config.json")) as f:
        softcap = json.load(f).get("attn_logit_softcapping")
    kw = {"attn_implementation": "eager"} if softcap else {}
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
    return m.eval()
