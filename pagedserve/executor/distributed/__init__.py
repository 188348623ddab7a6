"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

`parallel_state`: the process group and the collectives the model calls (no-ops at one rank);
`sharding`: which slice of each checkpoint tensor a rank holds (Megatron layout);
`shm_ring`: the one-node broadcast of each step's SchedulerOutput (shared-memory ring);
`worker`: one rank's loop (and the headless entry point for ranks on other machines);
`multiproc_executor`: the Executor that starts the ranks and talks to them.
"""
