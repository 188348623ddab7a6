"""The executor seam: the engine core talks to the model only through this interface.

Life cycle, driven by the engine core (`core/engine_core.py`), which never reaches past it:
  1. construction loads the model;
  2. `kv_bytes_per_block()` and `determine_available_kv_memory()` size the KV cache
     (the core turns bytes into blocks, in one place for CPU and GPU);
  3. `initialize_kv_cache(num_blocks, block_size)`;
  4. `compile_or_warm_up(...)` (CUDA graph capture on a GPU; oneDNN primitives built on a CPU);
  5. `execute_model(SchedulerOutput) -> ModelRunnerOutput`, once per step;
  6. `shutdown()`.
`UniProcExecutor` runs the ModelRunner in the core's process. Requests, outputs and
configs are plain picklable messages, so an executor with worker processes implements the
same calls: `executor/distributed/multiproc_executor.py` (tensor parallelism over
torch.distributed, one ModelRunner per rank; the engine core picks it for
tensor_parallel_size > 1).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from pagedserve.config import EngineConfig
from pagedserve.executor.model_config import ModelConfig
from pagedserve.executor.quant.copy_budget import CopyPolicy
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    model_config: ModelConfig
    dtype_name: str  # the activation dtype actually used ("float32", "bfloat16", ...)
    device: str

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int) -> int: ...

    @abstractmethod
    def determine_available_kv_memory(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """Bytes the KV cache may take when the user did not say."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def check_health(self) -> None:  # noqa: B027 (optional)
        """Raise if the executor cannot run another step (e.g. a worker process died);
        called by the idle core loop about once a second."""

    def compile_or_warm_up(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> None:  # noqa: B027
        """After the KV cache exists: capture CUDA graphs, warm kernels up (optional)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def kv_offload_connector(self, offload_dir: str, capacity_bytes: int):
        """The disk KV tier's connector over this executor's KV tensors
        (executor/kv_offload_store.py), or None where this executor cannot offer one."""
        return None

    def shutdown(self) -> None:  # noqa: B027 (optional hook)
        pass

    def add_lora(self, lora_request) -> None:
        """Read and check a LoRA adapter (ValueError naming what is wrong)."""
        raise ValueError("this executor serves no LoRA adapters (start the engine with enable_lora).")

    def remove_lora(self, lora_int_id: int) -> bool:
        return False

    def prefetch_lora(self, lora_request) -> None:
        """Start reading an adapter off the step loop (default: read it now)."""
        self.add_lora(lora_request)

    def lora_ready(self, lora_int_id: int) -> bool:
        return True

    def lora_failures(self) -> dict[int, str]:
        """Adapters whose background read failed (id -> message); their requests are aborted."""
        return {}

    def wait_lora_loading(self, timeout: float) -> None:  # noqa: B027 (optional)
        pass


class UniProcExecutor(Executor):
    def __init__(
        self, config: EngineConfig, model_path: str, model_config: ModelConfig, device: str, pooler=None
    ) -> None:
        """`pooler`: a PoolerConfig for runner "pooling" (embeddings), else None."""
        from pagedserve.executor.model_runner import ModelRunner

        mc = config.model
        self.model_config = model_config
        # what makes this executor's K/V bytes what they are, beyond the runner's own view
        self.config_fingerprint = {
            "model_path": os.path.realpath(model_path),
            "load_format": mc.load_format,
            "seed": mc.seed if mc.load_format == "dummy" else None,
            "quantization": mc.quantization,
            "tp_rank": 0,
        }
        copies = CopyPolicy.of_engine(config, model_config)
        self.runner = ModelRunner(
            model_path,
            model_config,
            dtype=mc.dtype,
            device=device,
            seed=mc.seed,
            load_format=mc.load_format,
            enforce_eager=mc.enforce_eager,
            quantization=mc.quantization,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            kv_cache_prefault=config.cache.kv_cache_prefault,
            block_size=config.cache.block_size,
            drafter_factory=draft_model_factory(config.speculative, copies),
            pooler=pooler,
            lora=config.lora,
            weight_copies=copies,
        )
        self.dtype_name = str(self.runner.dtype).removeprefix("torch.")
        self.device = str(self.runner.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def determine_available_kv_memory(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        return self.runner.determine_available_kv_memory(gpu_memory_utilization, max_num_batched_tokens)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def compile_or_warm_up(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> None:
        if self.runner.device.type == "cuda":
            self.runner.capture_cuda_graphs(max_num_seqs, max_model_len)
        else:
            self.runner.warm_up_cpu(max_num_batched_tokens, max_num_seqs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def kv_offload_connector(self, offload_dir: str, capacity_bytes: int):
        return self.runner.kv_offload_connector(offload_dir, capacity_bytes, self.config_fingerprint)

    def add_lora(self, lora_request) -> None:
        if self.runner.lora is None:
            super().add_lora(lora_request)
        self.runner.lora.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.lora is not None and self.runner.lora.remove_lora(lora_int_id)

    def prefetch_lora(self, lora_request) -> None:
        if self.runner.lora is None:
            super().add_lora(lora_request)
        self.runner.lora.prefetch(lora_request)

    def lora_ready(self, lora_int_id: int) -> bool:
        return self.runner.lora is None or self.runner.lora.ready(lora_int_id)

    def lora_failures(self) -> dict[int, str]:
        return self.runner.lora.take_failures() if self.runner.lora is not None else {}

    def wait_lora_loading(self, timeout: float) -> None:
        if self.runner.lora is not None:
            self.runner.lora.wait_loading(timeout)


def draft_model_factory(spec, weight_copies: CopyPolicy | None = None):
    """The ModelRunner's drafter_factory for speculative method "draft_model" (else None); a
    packed draft keeps the weight copies `weight_copies` allows (the engine's policy: it loads
    after the target's copies, before the KV cache that policy reserves for)."""
    if spec is None or spec.method != "draft_model":
        return None
    from pagedserve.executor.draft_model import DraftModelProposer

    return lambda target, dtype, device, backend: DraftModelProposer(
        spec.model, target, dtype, device, backend, spec.quantization, weight_copies
    )
