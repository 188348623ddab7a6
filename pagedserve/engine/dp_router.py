"""Data parallelism's router: which engine-core replica gets a request.

"prefix" (the default): hash the prompt's first full blocks with the KV cache manager's
own chained block hash (`block_pool.extend_block_hashes`, same block size, same cache
salt), and send the request to the replica that was last sent the longest of those
prefixes: its prefix cache most likely still holds them. A bounded LRU map
`block hash -> replica`, updated on every routing decision, stands for the replicas'
caches (the front end never asks them). No match, a prompt shorter than one block, or a
matching replica that is more than `balance_slack` requests busier than the least loaded
one: the least loaded replica (fewest requests in flight, ties broken in turn). The slack
is small on purpose: a split costs one prefill of the prefix on the other replica, after
which both hold it, whereas a large slack would pin a single hot system prompt (every
request of an application) to one replica.

"round_robin": replica 0, 1, ..., M-1, 0, ... whatever the prompt (the baseline).

"length" (the seed's "serve short and long requests apart"): a request whose expected
work (prompt + expected output tokens, given by the caller) is under `short_tokens` goes
to the short replicas [0, M // 2), the others to the long ones [M // 2, M) (with M = 1,
all to replica 0); within its set the least loaded. While the other set is idle (no
request in flight there) a class may use every replica (no replica idles). A prefix hit
still wins, as under "prefix", wherever the prefix lives.

Under "prefix" and "length" a request of a LoRA adapter with no prefix hit goes where that
adapter's last request went (its weights are resident there), unless that replica is more
than `balance_slack` requests busier than the least loaded one ("adapter").

Invariants: `route` returns an index in [0, M); the map never holds more than
`max_entries` hashes; the hashes equal `Request.block_hashes` for the same tokens and
salt (tests/engine/test_data_parallel.py checks it against the KV cache manager).
"""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.core.block_pool import extend_block_hashes

PREFIX, LOAD, ROUND_ROBIN, SHORT, LONG, ADAPTER = "prefix", "load", "round_robin", "short", "long", "adapter"  # why a request went where


class DPRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "prefix",
        *,
        max_prefix_blocks: int = 64,
        max_entries: int = 1 << 16,
        balance_slack: int = 4,
        short_tokens: int = 512,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        if policy not in ("prefix", "round_robin", "length"):
            raise ValueError(f"dp routing must be 'prefix', 'round_robin' or 'length', got {policy!r}.")
        self.short_tokens = short_tokens
        self.unavailable: set[int] = set()  # replicas not to route to (policy "length": their class falls back)
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.policy = policy
        self.max_prefix_blocks = max_prefix_blocks  # hash at most this many leading blocks
        self.max_entries = max_entries
        self.balance_slack = balance_slack
        self.owner: OrderedDict[bytes, int] = OrderedDict()  # block hash -> replica, LRU first
        self.adapter_home: OrderedDict[int, int] = OrderedDict()  # LoRA id -> replica of its last request
        self._turn = 0

    def block_hashes(self, token_ids: list[int], cache_salt: str | None = None, lora_id: int = 0) -> list[bytes]:
        """The chained hashes of the first full blocks of `token_ids` (at most
        `max_prefix_blocks`), exactly as the KV cache manager computes them (keyed by the
        LoRA adapter too, so an adapter's requests follow its cached prefixes)."""
        return extend_block_hashes([], token_ids, self.block_size, cache_salt, self.max_prefix_blocks, lora_id)

    def route(
        self, token_ids: list[int], cache_salt: str | None, loads: list[int], work: int | None = None, lora_id: int = 0
    ) -> tuple[int, str]:
        """(replica, reason) for a prompt; `loads[i]`: requests in flight on replica i;
        `work`: its expected tokens (policy "length"). Records the choice (the chosen
        replica now holds, or will hold, this prefix)."""
        n = self.num_replicas
        if self.policy == "round_robin":
            self._turn = (self._turn + 1) % n
            return (self._turn - 1) % n, ROUND_ROBIN
        hashes = self.block_hashes(token_ids, cache_salt, lora_id)
        if self.policy == "length":
            least, reason = self._by_length(loads, len(token_ids) if work is None else work)
        else:
            least, reason = self._least_loaded(loads), LOAD
        choice = least
        for h in reversed(hashes):  # the longest prefix first
            r = self.owner.get(h)
            if r is not None:
                if loads[r] <= loads[least] + self.balance_slack:
                    choice, reason = r, PREFIX
                break
        home = self.adapter_home.get(lora_id) if lora_id else None
        usable = home is not None and home not in self.unavailable
        if reason != PREFIX and usable and loads[home] <= loads[least] + self.balance_slack:
            choice, reason = home, ADAPTER
        if lora_id:
            self.adapter_home[lora_id] = choice
            self.adapter_home.move_to_end(lora_id)
            if len(self.adapter_home) > self.max_entries:
                self.adapter_home.popitem(last=False)
        owner = self.owner
        for h in hashes:
            owner[h] = choice
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
        return choice, reason

    def _by_length(self, loads: list[int], work: int) -> tuple[int, str]:
        """The least loaded replica of the request's class set (every replica while the
        other set is idle), and the class."""
        n = self.num_replicas
        split = n // 2
        short = work < self.short_tokens
        live = [i for i in range(n) if i not in self.unavailable]
        lo, hi = [i for i in live if i < split], [i for i in live if i >= split]
        mine, other = (lo, hi) if short else (hi, lo)
        if not mine or all(loads[i] == 0 for i in other):  # the set is gone, or the other one idles
            mine = live
        return self._least_loaded(loads, mine), SHORT if short else LONG

    def _least_loaded(self, loads: list[int], among: list[int] | None = None) -> int:
        """The least loaded replica (of `among`), ties broken in turn."""
        n, start = self.num_replicas, self._turn
        best = None
        for k in range(n):
            i = (start + k) % n
            if (among is None or i in among) and (best is None or loads[i] < loads[best]):
                best = i
        self._turn = (best + 1) % n  # the next tie goes to the next replica
        return best

    def forget(self) -> None:
        """The replicas' prefix caches were reset: nothing is known to be cached."""
        self.owner.clear()
