"""The CPU engine's allocator settings (executor/host_memory.py): a step's large tensors,
freed and made again, reuse the process's memory instead of faulting fresh pages in."""

import os
import subprocess
import sys

import pytest

from pagedserve.executor import host_memory

PROBE = """
import resource, sys, torch
SIZES = [int(x) for x in sys.argv[1:]]
from pagedserve.executor import host_memory
print(host_memory.keep_freed_memory())
def step(mb):  # a step's activations of a few sizes, alive together, touched, then freed
    xs = []
    for size in (mb, mb // 2, mb * 3 // 4):
        xs.append(torch.empty(size << 20, dtype=torch.uint8).fill_(1))
for mb in SIZES[:2]:
    step(mb)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mb in SIZES * 2:  # steps of other sizes, as chunked prefill makes them
    step(mb)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(sizes=(8, 24, 12, 16, 24, 8), **env) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, sizes)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_freed_step_memory_is_reused_without_page_faults():
    tuned, faults = _faults(PAGEDSERVE_NO_MALLOC_TUNING="0")
    if tuned != "True":
        pytest.skip("this C library is not glibc")
    untuned_flag, untuned = _faults(PAGEDSERVE_NO_MALLOC_TUNING="1")
    assert untuned_flag == "False"
    touched = sum(2.25 * mb for mb in (8, 24, 12, 16, 24, 8) * 2) * (1 << 20) / 4096  # 4 KB pages
    if untuned < touched / 100:  # e.g. transparent huge pages always on: a fault brings 2 MB
        pytest.skip(f"{untuned} page faults without the setting: too few to tell the two apart here")
    assert faults < untuned / 4  # kept: the same memory serves the next step (glibc alone maps
    # or trims it and faults it in again: 14.5k-60k faults here, against 1.5k)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_blocks_over_glibcs_largest_mmap_threshold_come_from_the_heap():
    """Blocks of 40-64 MB (over the 32 MB that M_MMAP_THRESHOLD can reach: a big model's
    activations) are kept too, not mapped and faulted in again at every step."""
    tuned, faults = _faults((64, 40, 64), PAGEDSERVE_NO_MALLOC_TUNING="0")
    if tuned != "True":
        pytest.skip("this C library is not glibc")
    one_block = (40 << 20) // 4096
    _, untuned = _faults((64, 40, 64), PAGEDSERVE_NO_MALLOC_TUNING="1")
    if untuned < 4 * one_block:  # e.g. transparent huge pages always on: a fault brings 2 MB
        pytest.skip(f"{untuned} page faults without the settings: too few to tell the two apart here")
    # mapped afresh (glibc's thresholds alone, or no settings): ~130k faults here; kept: 0, or
    # ~6.6k in one run of three (a heap layout where brk cannot grow in place)
    assert faults < untuned / 8, (faults, untuned)


def test_the_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NO_MALLOC_TUNING", "1")
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()


def _fake_host(tmp_path, cgroup_line: str, files: dict[str, str], mem_available_kib: int = 8 << 20):
    """A /proc and a cgroup file system with the given files (path under the cgroup root: text)."""
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {2 * mem_available_kib} kB\nMemAvailable:   {mem_available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        (fs / rel).parent.mkdir(parents=True, exist_ok=True)
        (fs / rel).write_text(text)
    return str(proc), str(fs)


def test_available_bytes_is_mem_available_without_a_cgroup_limit(tmp_path):
    proc, fs = _fake_host(tmp_path, "0::/", {"memory.current": "123\n"})
    assert host_memory.available_bytes(proc, fs) == (8 << 30)
    v1 = {"memory/memory.usage_in_bytes": "5", "memory/memory.stat": "hierarchical_memory_limit 9223372036854771712\n"}
    proc, fs = _fake_host(tmp_path / "v1", "4:memory:/", v1)
    assert host_memory.available_bytes(proc, fs) == (8 << 30)


def test_available_bytes_under_a_cgroup_v2_limit_at_any_level(tmp_path):
    """The tightest level counts, its working set being usage less inactive file pages."""
    gib = 1 << 30
    files = {
        "kubepods/memory.max": str(6 * gib),  # the parent: 6 GiB, 2 GiB in use + 1 GiB cache
        "kubepods/memory.current": str(3 * gib),
        "kubepods/memory.stat": f"anon 1\ninactive_file {gib}\n",
        "kubepods/pod1/memory.max": "max",
        "kubepods/pod1/memory.current": str(3 * gib),
    }
    proc, fs = _fake_host(tmp_path, "0::/kubepods/pod1", files)
    assert host_memory.available_bytes(proc, fs) == 4 * gib
    files["kubepods/pod1/memory.max"] = str(3 * gib + gib // 2)  # the group's own, tighter
    proc, fs = _fake_host(tmp_path / "b", "0::/kubepods/pod1", files)
    assert host_memory.available_bytes(proc, fs) == gib // 2
    proc, fs = _fake_host(tmp_path / "c", "0::/kubepods/pod1", files, mem_available_kib=1 << 18)
    assert host_memory.available_bytes(proc, fs) == gib // 4  # the host's own is less


def test_available_bytes_under_a_cgroup_v1_limit(tmp_path):
    gib = 1 << 30
    stat = f"hierarchical_memory_limit {4 * gib}\ntotal_inactive_file {gib}\n"
    files = {"memory/docker/abc/memory.usage_in_bytes": str(2 * gib), "memory/docker/abc/memory.stat": stat}
    proc, fs = _fake_host(tmp_path, "12:memory:/docker/abc", files)
    assert host_memory.available_bytes(proc, fs) == 3 * gib
    # the group's path not mounted in the container: its root is the group
    files = {"memory/memory.usage_in_bytes": str(2 * gib), "memory/memory.stat": stat}
    proc, fs = _fake_host(tmp_path / "b", "12:memory:/docker/abc", files)
    assert host_memory.available_bytes(proc, fs) == 3 * gib


def test_available_bytes_without_meminfo_is_the_physical_memory(tmp_path):
    (tmp_path / "self").mkdir()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert host_memory.available_bytes(str(tmp_path), str(tmp_path / "none")) == physical


def test_available_bytes_here_is_positive_and_at_most_the_total():
    total = host_memory._meminfo_kib("/proc/meminfo")["MemTotal"] * 1024
    assert 0 < host_memory.available_bytes() <= total
