"""The C allocator's settings for a CPU engine's steps (glibc malloc; elsewhere nothing).

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
