"""The bytes of the KV cache's second tier: a directory of block files on local disk, and
the connector that copies blocks' K/V (every layer, in the cache's dtype) between the KV
tensors and that store. The core (core/kv_offload.py) decides which blocks go and come
back; this module only moves bytes.

Store layout: `<dir>/<namespace>/<key hex>.kv`, one file per block, where the namespace is
a fingerprint of everything that makes K/V bytes what they are (the model's files, dtype,
KV dtype, block size, tensor-parallel rank, layout; `kv_fingerprint`): another model or
setting starts an empty namespace, so a store is never read by the wrong model. A file is
a header (magic, fingerprint, key, payload length, crc32 of the payload) and the payload.
Writes go to a temporary file that is renamed into place (atomic on POSIX): a crash in
the middle of a write leaves a `.tmp` file nobody reads (swept at start); a reader checks
magic, fingerprint, key, length and checksum, and a bad entry is dropped and counted.
Several processes (data-parallel replicas) may share a namespace: they only ever publish
whole files by rename, and a file another replica evicted is a miss.

The index (key -> bytes, LRU order) is rebuilt from the directory at start, oldest mtime
first, so a restarted server gets hits at once; `capacity_bytes` bounds the files this
process knows of (LRU eviction by unlink). Any I/O error but a missing file (a full disk,
EIO, a read-only directory) disables the tier with one log line: the engine goes on
without it, no request fails.

Threads: one background thread writes and reads; the step loop only copies tensors (to a
host buffer at eviction, back into fresh blocks when a read completed), never touches the
disk. On a GPU the same connector copies device <-> host (`.cpu()` / `.to(device)`), so a
host-memory tier between HBM and disk fits under the same interface (`HostTier` slot: not
built in this version; the CPU path is the tested one).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

MAGIC = b"PSKVBLK1"
FORMAT_VERSION = 1
# magic, fingerprint (16), key length, key (32, padded), payload length, crc32
_HEADER = struct.Struct("<8s16sB32sQI")
SUFFIX = ".kv"


def kv_fingerprint(**parts) -> str:
    """A 32-hex-digit name for the namespace of one model + settings (sorted key=value)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"pagedserve-kv-v{FORMAT_VERSION}".encode())
    for k in sorted(parts):
        h.update(f"\0{k}={parts[k]!r}".encode())
    return h.hexdigest()


def model_files_identity(model_path: str) -> str:
    """config.json's content hash plus every weight file's name, size and mtime: a changed
    checkpoint under the same path (a new fine-tune) is another model."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(os.path.join(model_path, "config.json"), "rb") as f:
            h.update(f.read())
        for name in sorted(os.listdir(model_path)):
            if name.endswith((".safetensors", ".bin", ".gguf", ".pt")):
                st = os.stat(os.path.join(model_path, name))
                h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        h.update(os.path.realpath(model_path).encode())
    return h.hexdigest()


class KVBlockStore:
    """Block files of one namespace with an LRU index bounded by `capacity_bytes`. Thread
    safety: the index is guarded by a lock (the writer thread and the step loop's
    `contains` share it); file I/O runs outside it."""

    def __init__(self, root: str, fingerprint: str, capacity_bytes: int) -> None:
        self.fingerprint = fingerprint
        self.fp_bytes = bytes.fromhex(fingerprint)
        self.dir = os.path.join(root, fingerprint)
        self.capacity_bytes = capacity_bytes
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self.bytes_used = 0
        self.lock = threading.Lock()
        self.num_corrupt = 0  # entries dropped for a bad header or checksum
        self.num_evicted = 0
        os.makedirs(self.dir, exist_ok=True)
        self._rebuild_index()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    def _rebuild_index(self) -> None:
        entries = []
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(".tmp"):  # an unpublished write (a crash or another replica's)
                    try:
                        if time.time() - e.stat().st_mtime > 60:
                            os.unlink(e.path)
                    except OSError:
                        pass
                    continue
                if not e.name.endswith(SUFFIX):
                    continue
                try:
                    key, st = bytes.fromhex(e.name[: -len(SUFFIX)]), e.stat()
                except (ValueError, OSError):
                    continue
                entries.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(entries):
            self.index[key] = size
            self.bytes_used += size
        self._evict_over(0)

    # -- index ----------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Known here, or published meanwhile by another process sharing the namespace
        (one stat, only for keys this process does not know)."""
        with self.lock:
            if key in self.index:
                return True
        try:
            size = os.stat(self._path(key)).st_size
        except OSError:
            return False
        self._add(key, size)
        return True

    def __len__(self) -> int:
        return len(self.index)

    def _add(self, key: bytes, size: int) -> None:
        with self.lock:
            old = self.index.pop(key, None)
            if old is not None:
                self.bytes_used -= old
            self.index[key] = size
            self.bytes_used += size
        self._evict_over(0)

    def _drop(self, key: bytes, unlink: bool = True) -> None:
        with self.lock:
            size = self.index.pop(key, None)
            if size is not None:
                self.bytes_used -= size
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))

    def _evict_over(self, incoming: int) -> None:
        """Unlink least recently used files until `incoming` more bytes fit."""
        while True:
            with self.lock:
                if not self.index or self.bytes_used + incoming <= self.capacity_bytes:
                    return
                key, size = self.index.popitem(last=False)
                self.bytes_used -= size
                self.num_evicted += 1
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))

    # -- files ------------------------------------------------------------------------
    def put(self, key: bytes, payload) -> int:
        """Publish one block file atomically; returns the bytes written (0: not stored,
        larger than the whole store). OSError propagates (the connector disables the tier)."""
        data = memoryview(payload).cast("B")
        size = _HEADER.size + data.nbytes
        if size > self.capacity_bytes:
            return 0
        self._evict_over(size)
        header = _HEADER.pack(MAGIC, self.fp_bytes, len(key), key.ljust(32, b"\0"), data.nbytes, zlib.crc32(data))
        final = self._path(key)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        self._write_file(tmp, header, data)
        os.replace(tmp, final)  # publish: readers see the whole file or none
        self._add(key, size)
        return size

    def _write_file(self, path: str, header: bytes, data) -> None:
        try:
            with open(path, "wb") as f:
                f.write(header)
                f.write(data)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def get(self, key: bytes) -> bytes | None:
        """The payload, verified; None for a miss or a bad entry (dropped and counted).
        OSError other than a missing file propagates."""
        try:
            with open(self._path(key), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            self._drop(key, unlink=False)  # another replica evicted it
            return None
        payload = self._verify(key, raw)
        if payload is None:
            self.num_corrupt += 1
            logger.warning("KV offload: dropped a bad block file %s (torn or corrupt)", self._path(key))
            self._drop(key)
            return None
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)
        return payload

    def _verify(self, key: bytes, raw: bytes) -> bytes | None:
        if len(raw) < _HEADER.size:
            return None
        magic, fp, klen, kpad, n, crc = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size :]
        if magic != MAGIC or fp != self.fp_bytes or kpad[:klen] != key or n != len(payload):
            return None
        return payload if zlib.crc32(payload) == crc else None


@dataclass
class OffloadCounters:
    """What the connector did (read by the engine's stats)."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    saves_dropped: int = 0  # the write queue was over its byte bound
    read_failures: int = 0  # a block that was indexed but could not be served
    errors: int = 0  # I/O errors (the first one disables the tier)
    disabled_reason: str | None = None


@dataclass
class LoadResult:
    job_id: int
    payloads: list  # per key: bytes (verified) or None
    block_ids: list[int] = field(default_factory=list)


class KVOffloadConnector:
    """Copies blocks between the KV tensors (`kv_caches`: per layer (K, V), layers sharing
    a pair counted once) and a KVBlockStore, with one background I/O thread. Call from the
    step loop: `save`, `load`, `poll` (returns finished loads after copying them into
    their blocks), `shutdown`."""

    def __init__(self, store: KVBlockStore, kv_caches, max_pending_bytes: int = 512 << 20) -> None:
        self.store = store
        seen, tensors = set(), []
        for k, v in kv_caches:
            for t in (k, v):
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)
        self.tensors = tensors
        t0 = tensors[0]
        self.block_shape = tuple(t0.shape[1:])
        self.dtype = t0.dtype
        self.device = t0.device
        self.tensor_block_bytes = t0[0].numel() * t0.element_size()
        self.block_bytes = self.tensor_block_bytes * len(tensors)
        self.counters = OffloadCounters()
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.enabled = True
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        # key -> its copied-out bytes until the write is published: served from here meanwhile
        self._pending: dict[bytes, torch.Tensor] = {}
        self._cancelled: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kv-offload-io", daemon=True)
        self._thread.start()

    # -- step loop side -------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.enabled and (key in self._pending or self.store.contains(key))

    def save(self, entries: list[tuple[bytes, int]]) -> int:
        """Copy the blocks (key, block id) out now (before their slots are reused) and
        queue their writes; blocks the store holds or is writing are skipped. Returns
        the number queued."""
        if not self.enabled:
            return 0
        todo = [(k, b) for k, b in entries if k not in self._pending and k not in self.store.index]
        room = max(0, (self.max_pending_bytes - self.pending_bytes) // self.block_bytes)
        if len(todo) > room:
            self.counters.saves_dropped += len(todo) - room
            todo = todo[:room]
        if not todo:
            return 0
        buf = self.gather([b for _, b in todo])
        with self._idle:
            self.pending_bytes += len(todo) * self.block_bytes
        for i, (k, _) in enumerate(todo):
            self._pending[k] = buf[i]
            self._submit(("save", k, buf[i]))
        return len(todo)

    def load(self, job_id: int, keys: list[bytes], block_ids: list[int]) -> None:
        """Queue reads of `keys` into `block_ids` (already allocated, held by the caller)."""
        self._submit(("load", job_id, list(keys), list(block_ids)))

    def cancel(self, job_id: int) -> None:
        """Forget a queued load: its bytes are never copied in (its blocks may be reused)."""
        self._cancelled.add(job_id)

    def poll(self) -> list[LoadResult]:
        """Finished loads, their verified payloads already copied into their blocks
        (cancelled ones are dropped)."""
        out = []
        while True:
            try:
                res = self._done.get_nowait()
            except queue.Empty:
                return out
            if res.job_id in self._cancelled:
                self._cancelled.discard(res.job_id)
                continue
            good = [(b, p) for b, p in zip(res.block_ids, res.payloads) if p is not None]
            if good:
                self.scatter([b for b, _ in good], [p for _, p in good])
            out.append(res)

    def busy(self) -> bool:
        """Writes or reads are queued or running on the I/O thread."""
        return self._outstanding > 0

    def wait_for_io(self, timeout: float) -> None:
        """Block up to `timeout` seconds until some I/O finishes (an idle loop's nap)."""
        with self._idle:
            if self._outstanding:
                self._idle.wait(timeout)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write and read is done (True) or `timeout` passes."""
        end = time.monotonic() + timeout
        with self._idle:
            while self._outstanding and time.monotonic() < end:
                self._idle.wait(end - time.monotonic())
            return not self._outstanding

    def shutdown(self, timeout: float = 30.0) -> None:
        self.drain(timeout)
        self._jobs.put(None)
        self._thread.join(timeout=1.0)

    # -- tensors ----------------------------------------------------------------------
    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """[n, block_bytes] uint8 on the host: block i's K and V of every layer."""
        n, nt = len(block_ids), len(self.tensors)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = torch.empty((n, nt, self.tensor_block_bytes), dtype=torch.uint8)
        for j, t in enumerate(self.tensors):
            # as bytes: any dtype (fp8 has no index kernels on every device)
            out[:, j] = t.view(torch.uint8).index_select(0, ids).reshape(n, -1).cpu()
        return out.view(n, -1)

    def scatter(self, block_ids: list[int], payloads: list[bytes]) -> None:
        n, nt = len(block_ids), len(self.tensors)
        buf = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(n, nt, self.tensor_block_bytes)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for j, t in enumerate(self.tensors):
            raw = t.view(torch.uint8)
            raw.index_copy_(0, ids, buf[:, j].reshape(n, *raw.shape[1:]).to(self.device))

    # -- the I/O thread ---------------------------------------------------------------
    def _submit(self, job) -> None:
        with self._idle:
            self._outstanding += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "save":
                    self._do_save(job[1], job[2])
                else:
                    self._do_load(*job[1:])
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _do_save(self, key: bytes, data: torch.Tensor) -> None:
        try:
            if self.enabled:
                t0 = time.perf_counter()
                n = self.store.put(key, data.numpy())
                if n:
                    self.counters.blocks_written += 1
                    self.counters.bytes_written += n
                    self.counters.write_seconds += time.perf_counter() - t0
        except OSError as e:
            self._disable(e)
        finally:
            self._pending.pop(key, None)
            with self._idle:
                self.pending_bytes -= self.block_bytes

    def _do_load(self, job_id: int, keys: list[bytes], block_ids: list[int]) -> None:
        payloads: list = []
        t0 = time.perf_counter()
        for key in keys:
            p = None
            pending = self._pending.get(key)
            if pending is not None:  # still being written: its bytes are here
                p = pending.numpy().tobytes()
            elif self.enabled:
                try:
                    p = self.store.get(key)
                except OSError as e:
                    self._disable(e)
            if p is not None and len(p) != self.block_bytes:
                p = None
            if p is None:
                self.counters.read_failures += 1
            else:
                self.counters.blocks_read += 1
                self.counters.bytes_read += len(p)
            payloads.append(p)
        self.counters.read_seconds += time.perf_counter() - t0
        self._done.put(LoadResult(job_id, payloads, block_ids))

    def _disable(self, e: OSError) -> None:
        self.counters.errors += 1
        if self.enabled:
            self.enabled = False
            what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "I/O error"
            self.counters.disabled_reason = f"{what}: {e}"
            logger.error("KV offload tier disabled (%s); serving goes on without it", self.counters.disabled_reason)
