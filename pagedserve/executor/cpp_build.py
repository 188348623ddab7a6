"""The one way pagedserve builds its C++ kernels (torch's cpp_extension underneath).

`load_extension(name, sources, ...)` returns the compiled module, building it first if
no build of exactly these sources exists. Invariants:
  * **keyed by content**: the cache entry's name carries a hash of the sources' bytes,
    the flags, torch's version and, for `-march=native` builds, the CPU's flags; never
    their location, so any checkout or venv finds a build made from another, and an
    edited kernel is never served stale;
  * **atomic**: a build happens in a private directory (sources copied in) and is renamed
    into place only when complete; an interrupted build leaves no half entry behind;
  * **never wedged**: builders of one entry take turns on an flock, which the kernel
    drops when its holder dies (Ctrl-C, SIGKILL, a killed CI step), so a stale lock
    cannot exist; a waiter says whom and how long it has waited;
  * **visible**: a build logs "building CPU kernels: <name> (one time, ~N s)".

`python -m pagedserve.executor.cpp_build` builds every kernel module (`make setup` runs
it), so that no engine start compiles inside a timed run.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import time

from pagedserve import envs

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 10.0


def cpu_tag() -> str:
    """The CPU's architecture and flags, hashed: part of the key of `-march=native`
    builds, so a cache shared by different CPUs never loads code with instructions this
    one lacks."""
    flags = platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        flags += next((line for line in f if line.startswith("flags")), "")
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def build_key(sources: list[str], cflags: list[str], ldflags: list[str]) -> str:
    import torch

    h = hashlib.sha1()
    for path in sources:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    h.update(" ".join(cflags + ["|"] + ldflags).encode() + b"\0" + torch.__version__.encode())
    if "-march=native" in cflags:
        h.update(cpu_tag().encode())
    return h.hexdigest()[:12]


def cache_root() -> str:
    return os.path.join(envs.PAGEDSERVE_CACHE_DIR, "kernels")


def load_extension(
    name: str,
    sources: list[str],
    headers: tuple[str, ...] = (),
    cflags: tuple[str, ...] = ("-O3",),
    ldflags: tuple[str, ...] = (),
    expected_seconds: int = 30,
):
    """The compiled module of `sources` (the first one is compiled; `headers` are copied
    beside it and hashed too). Raises if it cannot be built; callers choose their fallback."""
    files = list(sources) + list(headers)
    key = build_key(files, list(cflags), list(ldflags))
    module = f"pagedserve_{name}_{key}"
    entry = os.path.join(cache_root(), module)
    so = os.path.join(entry, f"{module}.so")
    if not os.path.exists(so):
        os.makedirs(cache_root(), exist_ok=True)
        with _turn(entry + ".lock", name):
            if not os.path.exists(so):  # another process may have built it meanwhile
                _build(name, module, files, entry, list(cflags), list(ldflags), expected_seconds)
    return _import(module, so)


@contextlib.contextmanager
def _turn(lock_path: str, name: str):
    """Exclusive while held; released by the kernel if this process dies."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t0, next_log = time.monotonic(), 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if waited >= next_log:
                    owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    logger.warning(
                        "waiting for another process's build of the %s kernels (pid %s): %.0f s so far",
                        name, owner, waited,
                    )
                    next_log += WAIT_LOG_EVERY_S
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock


def _build(
    name: str, module: str, files: list[str], entry: str, cflags: list[str], ldflags: list[str], expected: int
) -> None:
    from torch.utils.cpp_extension import load as torch_build

    sys.stderr.write(f"pagedserve: building CPU kernels: {name} (one time, ~{expected} s)\n")
    t0 = time.perf_counter()
    for stale in glob.glob(glob.escape(entry) + ".tmp-*"):  # left by a builder that died (we hold the turn)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".tmp-", dir=os.path.dirname(entry))
    try:
        copies = []
        for path in files:
            copies.append(os.path.join(tmp, os.path.basename(path)))
            shutil.copyfile(path, copies[-1])
        torch_build(
            name=module,
            sources=[copies[0]],
            extra_include_paths=[tmp],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=tmp,
            verbose=False,
        )
        if os.path.exists(entry):  # a build that left no .so (never by this code): replace it
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s in %.1f s", module, time.perf_counter() - t0)


def _import(module: str, so: str):
    if module in sys.modules:
        return sys.modules[module]
    import torch  # noqa: F401 (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(module, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[module] = mod
    return mod


def build_all() -> dict[str, bool]:
    """Build (or find) every kernel module; {name: usable}. The fallbacks stay as at run
    time: a module that cannot be built leaves its PyTorch path."""
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.executor.attention import cpu_kernels
    from pagedserve.executor.lora import load_kernels as lora_load
    from pagedserve.executor.ops import load as ops_load
    from pagedserve.executor.ops import moe_gemm
    from pagedserve.executor.quant import kernels as quant_kernels

    loads = {
        "quant": quant_kernels.try_load, "fused_ops": ops_load, "attention": cpu_kernels.load, "lora": lora_load,
        "moe": moe_gemm.load,
    }
    # one compiler process each (the GIL is free while they run)
    with ThreadPoolExecutor(max_workers=min(len(loads), os.cpu_count() or 1)) as pool:
        done = {name: pool.submit(load) for name, load in loads.items()}
    return {name: f.result() is not None for name, f in done.items()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if envs.PAGEDSERVE_NO_CPP_KERNELS:
        print("pagedserve: PAGEDSERVE_NO_CPP_KERNELS is set: no C++ kernels built")
        return 0
    t0 = time.perf_counter()
    built = build_all()
    missing = [k for k, ok in built.items() if not ok]
    print(
        f"pagedserve: CPU kernels ready in {time.perf_counter() - t0:.1f} s"
        + (f" (unavailable, PyTorch paths used instead: {', '.join(missing)})" if missing else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
