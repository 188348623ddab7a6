"""The executor seam: the engine talks to the model only through this interface.

`UniProcExecutor` runs the ModelRunner in the engine's process. Because requests,
outputs and configs are plain picklable messages, an executor that runs the runner in a
worker thread or process (or several, for tensor parallelism over torch.distributed)
implements the same three calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.engine.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.model_config import ModelConfig


class Executor(ABC):
    model_config: ModelConfig

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 (optional hook)
        pass


class UniProcExecutor(Executor):
    def __init__(
        self,
        model_path: str,
        model_config: ModelConfig,
        dtype: str,
        device: str,
        seed: int,
        load_format: str = "auto",
        enforce_eager: bool = False,
        quantization: str | None = None,
    ) -> None:
        from pagedserve.executor.model_runner import ModelRunner

        self.model_config = model_config
        self.runner = ModelRunner(
            model_path,
            model_config,
            dtype=dtype,
            device=device,
            seed=seed,
            load_format=load_format,
            enforce_eager=enforce_eager,
            quantization=quantization,
        )
        self.dtype = self.runner.dtype
        self.device = self.runner.device

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def profile_num_kv_blocks(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, block_size: int
    ) -> int:
        return self.runner.profile_num_kv_blocks(gpu_memory_utilization, max_num_batched_tokens, block_size)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.runner.capture_cuda_graphs(max_num_seqs, max_model_len)
