"""Mixture-of-experts layers and the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

Routing (transformers' order): router logits in the model dtype, softmax in float32, top-k;
renormalised over the k (Mixtral always; the others when `norm_topk_prob`); Mixtral keeps
the weights in float32 for the product, the others cast them to the model dtype. Qwen2-MoE
adds a shared expert (a dense MLP) under a sigmoid gate.

Experts are stacked per layer: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
A step's (token, choice) pairs are sorted by expert, so each active expert runs one pair of
products over all of its tokens: its weights are read once per step, idle experts not at
all, and nothing is computed for an expert a token did not choose. On CUDA the same in
Triton with fixed shapes (ops/triton_moe.py), which CUDA graphs capture: the CPU path reads
each expert's row count on the host.

Tensor parallelism: within experts (each rank holds every expert's 1/N slice of I, as a
dense MLP is split; the router is replicated), so every rank does the same share of every
token's work whatever the routing, and the block's output is summed by the one all-reduce
a dense MLP already needs. Sharding by expert would need an all-to-all of tokens and
leaves ranks idle when routing is skewed, for little gain at these expert counts (8-128).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor import ops
from pagedserve.executor.distributed import sharding
from pagedserve.executor.distributed.parallel_state import tp_all_reduce
from pagedserve.executor.distributed.sharding import TPLayout
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.models.llama import MLP, LlamaForCausalLM, act_and_mul


class Router(nn.Module):
    """A bias-free [out, H] projection that is not an nn.Linear, so that quantization at load
    (quantize_linears) and the float kernels leave routing exactly as trained."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedExperts(nn.Module):
    """Float experts (w13, w2), or packed ones: per expert a QuantLinear for gate/up (two
    parts) and one for down (`q13`, `q2`), from a GGUF's blocks or quantized at load
    (int8 / int4), run by executor/quant's kernels; or, on a CPU, float experts on oneDNN's
    pre-packed weights (`p13`, `p2`) or, in bf16 where PyTorch's brgemm packs it, on the
    micro-kernel's blocks (`b13`, `b2`: every expert in one call per product). Exactly one
    form is held; the float tensors are dropped once another is made."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.q13: nn.ModuleList | None = None
        self.q2: nn.ModuleList | None = None
        self.p13: list[torch.Tensor] | None = None  # oneDNN's pre-packed float experts (pack_onednn)
        self.p2: list[torch.Tensor] | None = None
        self.b13: torch.Tensor | None = None  # the brgemm micro-kernel's blocks (pack_brgemm)
        self.b2: torch.Tensor | None = None

    def _packed_layers(self) -> None:
        from pagedserve.executor.quant.layers import QuantLinear

        if self.q13 is None:
            e, h, i = self.num_experts, self.hidden, self.intermediate
            self.q13 = nn.ModuleList(QuantLinear(h, [i, i]) for _ in range(e))
            self.q2 = nn.ModuleList(QuantLinear(i, [h]) for _ in range(e))

    def set_packed(self, e: int, part: int, w) -> None:
        """Part 0 (gate), 1 (up) or 2 (down) of expert e, packed (or float rows of a packed layer)."""
        self._packed_layers()
        if part == 2:
            self.q2[e].set_part(0, w)
        else:
            self.q13[e].set_part(part, w)

    def quantize(self, quantize) -> bool:
        """Pack every expert with `quantize` (formats.QUANTIZERS); False (left float) when a
        dimension is not a multiple of the 32-element blocks."""
        if self.hidden % 32 or self.intermediate % 32:
            return False
        for e in range(self.num_experts):
            i = self.intermediate
            self.set_packed(e, 0, quantize(self.w13[e, :i]))
            self.set_packed(e, 1, quantize(self.w13[e, i:]))
            self.set_packed(e, 2, quantize(self.w2[e]))
        self.drop_float()
        return True

    def pack_onednn(self) -> bool:
        """Float experts on oneDNN's pre-packed weights (onednn_linear: 1.3-1.9x F.linear at
        the 1-32 rows an expert sees a decode step); the plain tensors are then dropped."""
        from pagedserve.executor import onednn_linear as od

        w = self.w13
        if self.q13 is not None or w.device.type != "cpu" or w[0].numel() < od.MIN_ELEMENTS or not od.available(w.dtype):
            return False
        self.p13 = [od.pack_weight(self.w13[e]) for e in range(self.num_experts)]
        self.p2 = [od.pack_weight(self.w2[e]) for e in range(self.num_experts)]
        self._drop_plain()
        return True

    def pack_brgemm(self) -> bool:
        """bf16 experts on PyTorch's brgemm micro-kernel (ops/moe_gemm.py: every expert of
        the layer in one call per product); the plain tensors are then dropped."""
        from pagedserve.executor.ops import moe_gemm

        if self.q13 is not None or not (moe_gemm.can_pack(self.w13) and moe_gemm.can_pack(self.w2)):
            return False
        self.b13, self.b2 = moe_gemm.pack(self.w13), moe_gemm.pack(self.w2)
        self._drop_plain()
        return True

    def _expert(self, e: int, seg: torch.Tensor, kern) -> torch.Tensor:
        """Expert e's MLP over its rows."""
        if self.q13 is not None:
            return self.q2[e].forward(act_and_mul(self.q13[e].forward(seg), kern))
        if self.p13 is not None:
            from pagedserve.executor.onednn_linear import packed_linear

            return packed_linear(act_and_mul(packed_linear(seg, self.p13[e], None), kern), self.p2[e], None)
        return F.linear(act_and_mul(F.linear(seg, self.w13[e]), kern), self.w2[e])

    def drop_float(self) -> None:
        """After packing: the float tensors are not used (nor kept in memory)."""
        if self.q13 is not None:
            self._drop_plain()

    def _drop_plain(self) -> None:
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kern=None) -> torch.Tensor:
        """x [T, H], the routing weights and expert ids [T, k] -> sum_j weights[t, j] *
        expert_{ids[t, j]}(x[t]), [T, H]."""
        k = ids.shape[1]
        moe_kernels = ops.moe_kernels_for(x) if self.q13 is None and self.w13.numel() else None
        if moe_kernels is not None:  # CUDA: fixed shapes, no host reads (CUDA graphs)
            ys = moe_kernels.experts(x, self.w13, self.w2, ids, lambda gu: act_and_mul(gu, kern))
            return self._weighted_sum(ys, weights, x.dtype)
        if x.shape[0] == 1 and self.b13 is None:  # batch-1 decode: no sort or gathers, the same sums
            pairs = torch.cat([self._expert(e, x, kern) for e in ids[0].tolist()]).view(1, k, -1)
            return self._weighted_sum(pairs, weights, x.dtype)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        ys = self._grouped(x.index_select(0, order // k), counts, kern)  # rows: each pair's token
        # back to (token, choice) order by a gather (a scatter-add is ~30 ms for two rows on
        # a busy 2-core machine: OpenMP waits), then each token's k outputs weighted and summed;
        # on the brgemm path in one C++ pass (moe_gemm.combine: the same roundings)
        inv = torch.argsort(order)
        if self.b13 is not None:
            from pagedserve.executor.ops.moe_gemm import combine

            return combine(ys, inv, weights)
        return self._weighted_sum(ys.index_select(0, inv).view(x.shape[0], k, -1), weights, x.dtype)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor, kern) -> torch.Tensor:
        """Rows grouped by expert (counts[e] rows of expert e, in expert order) through their
        experts: in one call per product on the brgemm blocks, else expert by expert."""
        if self.b13 is not None:
            from pagedserve.executor.ops.moe_gemm import experts_mm

            offsets = torch.zeros(self.num_experts + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=offsets[1:])
            return experts_mm(act_and_mul(experts_mm(xs, offsets, self.b13), kern), offsets, self.b2)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                ys[start : start + n] = self._expert(e, xs[start : start + n], kern)
                start += n
        return ys

    @staticmethod
    def _weighted_sum(pairs: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """pairs [T, k, H] (each token's k expert outputs) -> [T, H] weighted by weights [T, k]."""
        w = weights[..., None]
        pairs = (pairs.float() * w).to(dtype) if w.dtype != dtype else pairs * w
        return pairs.sum(dim=1)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPLayout) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.weights_fp32 = cfg.router_weights_fp32
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // tp.size)
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, tp, shared // tp.size, reduce=False) if shared else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1) if shared else None
        self.tp_size = tp.size

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], expert ids [T, k])."""
        logits = self.gate.forward(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights if self.weights_fp32 else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor, kern=None) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts.forward(x, weights, ids, kern)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate.forward(x))
            out = out + gate * self.shared_expert.forward(x, kern)
        return tp_all_reduce(out) if self.tp_size > 1 else out


# checkpoint expert tensors: per expert (HF's files: Mixtral's w1/w3/w2, the others'
# gate/up/down_proj) or stacked (transformers 5's own layout: gate_up_proj [E, 2I, H],
# down_proj [E, H, I])
_PER_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED_EXPERTS = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


class MoeForCausalLM(LlamaForCausalLM):
    """Llama-style attention (Qwen2-MoE's q/k/v bias, Qwen3-MoE's and OLMoE's q/k norms: config
    flags) over SparseMoeBlocks (dense MLPs in Qwen-MoE's `mlp_only_layers`)."""

    def _make_mlp(self, cfg: ModelConfig, tp: TPLayout, i: int) -> nn.Module:
        return SparseMoeBlock(cfg, tp) if cfg.is_moe_layer(i) else MLP(cfg, tp)

    def _checkpoint_tensors(self, weights):
        for name, tensor in super()._checkpoint_tensors(weights):
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor

    def _load_tensor(self, name: str, tensor, params: dict, loaded: set[str]) -> None:
        m = _PER_EXPERT.match(name)
        if m is not None:
            return self._load_expert(m.group(1), int(m.group(2)), _PART[m.group(3)], tensor, params, loaded)
        m = _STACKED_EXPERTS.match(name)
        if m is None:
            return super()._load_tensor(name, tensor, params, loaded)
        if m.group(2) == "down_proj":
            for e in range(tensor.shape[0]):
                self._load_expert(m.group(1), e, 2, tensor[e], params, loaded)
            return None
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            self._load_expert(m.group(1), e, 0, tensor[e, :half], params, loaded)
            self._load_expert(m.group(1), e, 1, tensor[e, half:], params, loaded)
        return None

    def _load_expert(self, layer: str, e: int, part: int, w, params: dict, loaded: set[str]) -> None:
        """Part 0 (gate), 1 (up) or 2 (down) of expert e of `layer`, this rank's slice
        (packed GGUF blocks go to the experts' QuantLinears)."""
        target = f"{layer}.mlp.experts.{'w2' if part == 2 else 'w13'}"
        param = params.get(target)
        if param is None or e >= param.shape[0]:
            raise ValueError(f"checkpoint expert {e} of {layer} matches no parameter of {self.config.architecture}")
        w = sharding.shard_row(w, self.tp) if part == 2 else sharding.shard_column(w, self.tp)
        if not isinstance(w, torch.Tensor):
            self.get_submodule(f"{layer}.mlp.experts").set_packed(e, part, w)
            loaded.add(f"{target}#{e}.{part}")
            return
        if part == 2:
            dst = param[e]
        else:
            n = param.shape[1] // 2
            dst = param[e].narrow(0, part * n, n)
        if dst.shape != w.shape:
            raise ValueError(f"{layer} expert {e}: checkpoint shape {tuple(w.shape)} != {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(w)
        loaded.add(f"{target}#{e}.{part}")

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        for mod in self.modules():
            if isinstance(mod, FusedExperts):
                mod.drop_float()

    def _expected_keys(self, params: dict) -> set[str]:
        out = set()
        for key in super()._expected_keys(params):
            name = key.split("#")[0]
            if name.endswith(".experts.w13") or name.endswith(".experts.w2"):
                parts = (2,) if name.endswith("w2") else (0, 1)
                out.update(f"{name}#{e}.{p}" for e in range(params[name].shape[0]) for p in parts)
            else:
                out.add(key)
        return out
