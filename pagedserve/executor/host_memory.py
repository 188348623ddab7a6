"""The host's memory for a CPU engine: the C allocator's settings for its steps (glibc malloc;
elsewhere nothing), and how much memory is left to take (`available_bytes`, cgroup-aware).

A step allocates its activations afresh (a 2,048-token step of SmolLM2 makes ~12 MB
tensors). glibc serves blocks over its mmap threshold (128 KB at first, raised on the fly
up to 32 MB) with fresh mmaps and returns freed memory at the top of the heap to the OS
past its trim threshold, so each step faults its pages in again: ~13% of an embedding
server's core time went to the kernel clearing pages (clear_page_erms) on an AMX Xeon, the
served embeddings 4,557-4,798 -> 5,137-5,315 prompt tok/s with the settings below
(BENCHMARKS section 34). vLLM's CPU guide preloads tcmalloc for the same reason; this
needs nothing installed. Blocks of 32 MB and more (glibc's largest mmap threshold: a bigger
model's activations, an MoE step's expert products) would still be mapped afresh each time: the
main arena maps none (M_MMAP_MAX 0), so they come from the heap as well (a 2,048 x 8,192 bf16
product, 32 MiB out, 72 -> 59 ms on an AMX Xeon VM, BENCHMARKS section 38); other threads'
arenas still map what their heaps cannot hold.

Invariants: at most once per process; only where the C library is glibc; never on a
GPU engine; PAGEDSERVE_NO_MALLOC_TUNING=1 leaves the allocator alone. Memory a step frees
stays in the process for the next step: the RSS keeps the peak of the largest step served so
far (a one-off long prompt's too), as with tcmalloc. What loading freed (checkpoint copies,
weights dropped after packing) is handed back once the model is built (`release_free_memory`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

from pagedserve import envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for the setting (HEAP_MAX / 2 on 64-bit)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim in practice
SETTINGS = {  # name: (mallopt parameter, value)
    "M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    "M_MMAP_MAX": (M_MMAP_MAX, 0),  # the main arena maps nothing: blocks of 32 MB and more too
}


@functools.cache
def keep_freed_memory() -> bool:
    """Blocks of every size from the main thread's heap, and freed memory kept for reuse
    (no page faults in later steps); True when every setting was taken."""
    if envs.PAGEDSERVE_NO_MALLOC_TUNING:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # glibc only (musl has neither the symbol nor these knobs)
    except (OSError, AttributeError):
        return False
    refused = [name for name, (param, value) in SETTINGS.items() if libc.mallopt(param, value) != 1]
    if refused:
        logger.warning("pagedserve: glibc refused %s; steps may fault their pages in again", ", ".join(refused))
    return not refused


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim(0), which also
    releases whole free pages inside the heap): once, after loading, whose temporaries the
    settings above would otherwise keep resident for the life of the process."""
    if keep_freed_memory():
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def available_bytes(proc: str = "/proc", cgroup_fs: str = "/sys/fs/cgroup") -> int:
    """Memory this process may still take without swapping or being killed: the kernel's
    MemAvailable (free memory plus the page cache it can drop), bounded by the memory cgroup's
    limit less its working set (usage less inactive file pages, as `docker stats` and the
    kubelet count it) in a container: cgroup v2 at every level from the process's group up,
    v1 through the group's hierarchical limit. Without /proc/meminfo: the physical memory."""
    try:
        avail = _meminfo_kib(f"{proc}/meminfo")["MemAvailable"] * 1024
    except (OSError, KeyError, ValueError):  # not Linux (or before 3.14): the physical memory
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit, used in _cgroup_limits(proc, cgroup_fs):
        avail = min(avail, max(limit - used, 0))
    return avail


def _meminfo_kib(path: str) -> dict[str, int]:
    with open(path) as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip()}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str) -> dict[str, int]:
    text = _read(path) or ""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}


def _cgroup_limits(proc: str, cgroup_fs: str) -> list[tuple[int, int]]:
    """(limit, working set) of each memory cgroup level that has a limit."""
    text = _read(f"{proc}/self/cgroup") or ""
    out = []
    for line in text.splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: every level from the group up to the root
            d = f"{cgroup_fs}/{path.strip('/')}".rstrip("/")
            while d.startswith(cgroup_fs):
                limit = _read(f"{d}/memory.max")
                current = _read(f"{d}/memory.current")
                if limit and limit != "max" and current:
                    out.append((int(limit), int(current) - _stat(f"{d}/memory.stat").get("inactive_file", 0)))
                d = d.rpartition("/")[0]
        elif "memory" in controllers.split(","):  # v1: the group, or the root where it is mounted so
            for d in (f"{cgroup_fs}/memory/{path.strip('/')}".rstrip("/"), f"{cgroup_fs}/memory"):
                stat = _stat(f"{d}/memory.stat")
                usage = _read(f"{d}/memory.usage_in_bytes")
                if usage is not None and "hierarchical_memory_limit" in stat:
                    limit = stat["hierarchical_memory_limit"]
                    if limit < 1 << 60:  # v1 says "no limit" with a page-rounded 2^63
                        out.append((limit, int(usage) - stat.get("total_inactive_file", 0)))
                    break
    return out
