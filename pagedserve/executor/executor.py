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
        self, model_path: str, model_config: ModelConfig, dtype: str, device: str, seed: int
    ) -> None:
        from pagedserve.executor.model_runner import ModelRunner

        self.model_config = model_config
        self.runner = ModelRunner(model_path, model_config, dtype=dtype, device=device, seed=seed)
        self.dtype = self.runner.dtype
        self.device = self.runner.device

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.runner.kv_bytes_per_block(block_size)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
