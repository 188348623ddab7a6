"""The engine core: the scheduler and what it owns (KV blocks, requests, the step loop).

Layer two of three. It sees token ids only (tokens and text belong to the front end in
`pagedserve.engine` and above) and talks to the model only through the executor seam
(`pagedserve.executor.executor.Executor`):

  engine_core.py     EngineCore: schedule -> execute -> update, once per step
  core_proc.py       the busy loop behind ZMQ (a child process or a thread)
  scheduler.py       iteration-level scheduling under a token budget; preemption
  policies.py        waiting-queue orders and preemption victims
  kv_cache_manager.py, block_pool.py   paged KV blocks: allocation, prefix cache, ref counts
  request.py         a request as the scheduler sees it
  spec_decode.py, ngram_proposer.py    speculative decoding's scheduling side
  admission.py       whether a request can ever run (shared with the input processor)
  snapshot.py        the live view's raw state, taken between steps
"""
