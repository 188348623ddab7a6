"""LoRA adapters: the per-request handle (vLLM's `LoRARequest`) and PEFT adapter files.

Neutral (imports nothing from the layers): the front end validates an adapter here before
a request is queued (a ValueError, or a 400 on the server, naming what is wrong), and the
executor loads its tensors from here (executor/lora.py stacks them into resident slots).

A PEFT LoRA directory holds `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, rank_pattern / alpha_pattern) and `adapter_model.safetensors` with, per
targeted module, `...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]. The delta of a module is x @ A^T @ B^T * scale, scale = alpha / r (rsLoRA: alpha /
sqrt(r)). q/k/v land on our fused qkv_proj, gate/up on gate_up_proj.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

# PEFT target name -> (our fused module, its part index)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """One adapter for one request (vLLM's class and names). `lora_int_id` (>= 1) names
    the adapter inside the engine: requests with the same id share its weights and its
    prefix-cache blocks; a different id never shares KV blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string.")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must be a non-empty path.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class BaseDims:
    """The base model's projection shapes a LoRA adapter must match."""

    hidden: int
    q_out: int  # heads * head_dim
    kv_out: int  # KV heads * head_dim
    intermediate: int
    num_layers: int
    dense_mlp: bool = True  # MLP targets need dense layers (no mixture of experts)

    @classmethod
    def of(cls, cfg) -> BaseDims:
        """From an executor ModelConfig (duck-typed: this module imports no layer)."""
        return cls(
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            not getattr(cfg, "num_experts", 0),
        )

    def shape(self, target: str) -> tuple[int, int]:
        """(out, in) of a PEFT target module."""
        h = self.hidden
        return {
            "q_proj": (self.q_out, h),
            "k_proj": (self.kv_out, h),
            "v_proj": (self.kv_out, h),
            "o_proj": (h, self.q_out),
            "gate_proj": (self.intermediate, h),
            "up_proj": (self.intermediate, h),
            "down_proj": (h, self.intermediate),
        }[target]


@dataclass
class PEFTAdapter:
    """A checked adapter. `modules[(layer, target)] = (A [r, in], B [out, r], scale)`
    (float32 tensors; None before `load_tensors`), `rank`: the largest r."""

    name: str
    path: str
    rank: int
    modules: dict[tuple[int, str], tuple] = field(default_factory=dict)


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {what}")


def read_adapter_config(name: str, path: str) -> dict:
    """adapter_config.json of a PEFT LoRA directory, checked for what we cannot serve."""
    if not os.path.isdir(path):
        raise _refuse(name, f"lora_path {path!r} is not a directory.")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise _refuse(name, f"missing {CONFIG_FILE} in {path!r}.")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise _refuse(name, f"missing {WEIGHTS_FILE} in {path!r} (only safetensors adapters are read).")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _refuse(name, f"{CONFIG_FILE} is not readable JSON ({e}).") from None
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise _refuse(name, f"peft_type {cfg.get('peft_type')!r} is not LORA.")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(cfg.get(key, ok)) != ok:
            raise _refuse(name, f"{key}={cfg.get(key)!r} is not supported.")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, f"bias={cfg.get('bias')!r} is not supported (only 'none').")
    if cfg.get("modules_to_save"):
        raise _refuse(name, f"modules_to_save={cfg['modules_to_save']!r} is not supported.")
    if "r" not in cfg or "lora_alpha" not in cfg:
        raise _refuse(name, f"{CONFIG_FILE} needs 'r' and 'lora_alpha'.")
    return cfg


def _pattern(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_peft_adapter(name: str, path: str, dims: BaseDims, max_rank: int, tensors: bool = True) -> PEFTAdapter:
    """Read and check a PEFT adapter against the base model: every tensor a LoRA A/B of a
    q/k/v/o/gate/up/down projection of an existing layer, of the base's shapes, rank <=
    `max_rank`. `tensors=False` reads shapes only (the file's header: the front end's check)."""
    from safetensors import safe_open

    cfg = read_adapter_config(name, path)
    found: dict[tuple[int, str], dict] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        names = f.keys()  # safe_open is no mapping
        for key in names:
            m = _KEY.search(key)
            if m is None or m.group(2) not in TARGETS:
                raise _refuse(name, f"tensor {key!r} is not a LoRA A/B of q/k/v/o/gate/up/down_proj.")
            layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= dims.num_layers:
                raise _refuse(name, f"tensor {key!r}: the base model has {dims.num_layers} layers.")
            if TARGETS[target][0] in ("gate_up_proj", "down_proj") and not dims.dense_mlp:
                raise _refuse(name, f"tensor {key!r}: MLP targets need a dense MLP (this base has experts).")
            shape = tuple(f.get_slice(key).get_shape())
            found.setdefault((layer, target), {})[ab] = (key, shape, f.get_tensor(key) if tensors else None)
    if not found:
        raise _refuse(name, f"{WEIGHTS_FILE} holds no LoRA weights.")
    adapter = PEFTAdapter(name, path, 0)
    for (layer, target), ab in sorted(found.items()):
        adapter.modules[(layer, target)] = _check_module(name, cfg, dims, max_rank, layer, target, ab)
        adapter.rank = max(adapter.rank, adapter.modules[(layer, target)][3])
    return adapter


def _check_module(name, cfg, dims: BaseDims, max_rank: int, layer: int, target: str, ab: dict):
    """(A, B, scale, r) of one module, its shapes checked against the base."""
    if set(ab) != {"A", "B"}:
        raise _refuse(name, f"layer {layer} {target}: lora_A and lora_B must both be present.")
    (ka, sa, a), (kb, sb, b) = ab["A"], ab["B"]
    r = sa[0] if len(sa) == 2 else -1
    out, inp = dims.shape(target)
    if len(sa) != 2 or len(sb) != 2 or sa[1] != inp or sb != (out, r):
        raise _refuse(
            name,
            f"wrong base shape at {ka!r} {sa} / {kb!r} {sb}: the base model's {target} of layer {layer} "
            f"needs lora_A (r, {inp}) and lora_B ({out}, r).",
        )
    module = f"model.layers.{layer}.{'self_attn' if target in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{target}"
    want_r = int(_pattern(cfg.get("rank_pattern"), module, cfg["r"]))
    if r != want_r:
        raise _refuse(name, f"{ka!r} has rank {r}, adapter_config.json says {want_r}.")
    if r > max_rank:
        raise _refuse(name, f"rank {r} is over max_lora_rank={max_rank} (raise --max-lora-rank).")
    alpha = float(_pattern(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return a, b, scale, r


class LoRAChecker:
    """The front end's check of a request's adapter before it is queued: the engine serves
    adapters, the files are a PEFT LoRA of this base (shapes read from the file header),
    the rank is within max_lora_rank, one id names one path. Results are kept per id."""

    def __init__(self, enabled: bool, max_rank: int, dims: BaseDims) -> None:
        self.enabled, self.max_rank, self.dims = enabled, max_rank, dims
        self.checked: dict[int, str] = {}  # lora_int_id -> path

    def check(self, req) -> None:
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}.")
        if not self.enabled:
            raise ValueError(f"lora_request {req.lora_name!r} given, but the engine runs without enable_lora.")
        known = self.checked.get(req.lora_int_id)
        if known == req.lora_path:
            return
        if known is not None:
            raise ValueError(f"lora_int_id {req.lora_int_id} is already adapter {known!r}, not {req.lora_path!r}.")
        load_peft_adapter(req.lora_name, req.lora_path, self.dims, self.max_rank, tensors=False)
        self.checked[req.lora_int_id] = req.lora_path

    def forget(self, lora_int_id: int) -> None:
        self.checked.pop(lora_int_id, None)
