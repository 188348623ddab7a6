"""One writer, several readers on one machine: a ring of fixed-size chunks in shared memory
(vLLM's MessageQueue idea, simplified). The executor writes each step's pickled
SchedulerOutput once; every local worker reads it from the same pages.

Chunk layout: a 64-byte-aligned header, then `chunk_bytes` of payload.
    header[0]     written: 1 while the chunk holds an unread-by-someone message
    header[1]     more: the message continues in the next chunk (messages of any size)
    header[8:16]  payload length (little-endian uint64)
    header[16+r]  reader r's flag: 1 once it has read the chunk
Protocol (x86 keeps stores in order, and each flag byte has one writer): the writer waits
until a chunk is free (never written, or every reader's flag is 1), clears `written`,
writes the payload, clears the readers' flags, then sets `written`. Reader r takes the
chunk when `written` is 1 and its own flag is 0, copies the payload, sets its flag. Writer
and readers walk the chunks in the same order, so every reader sees every message once.

Waiting spins (yielding the CPU) for `spin_s`, then sleeps with a doubling backoff up to
1 ms, and 10 ms after a second without a message (an idle engine's ranks cost ~1% of a
core each instead of ~3%, measured); `on_wait` runs about every `check_s` while waiting
(liveness checks: it raises to stop waiting, e.g. when a reader process died).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory

HEADER = 64


class RingClosed(Exception):
    pass


class ShmRing:
    def __init__(
        self,
        num_readers: int,
        chunk_bytes: int = 1 << 20,
        num_chunks: int = 8,
        name: str | None = None,
        reader: int | None = None,
    ) -> None:
        """The writer creates the ring (name=None); reader r attaches to it by name."""
        if num_readers + 16 > HEADER:
            raise ValueError(f"at most {HEADER - 16} readers")
        self.num_readers, self.chunk_bytes, self.num_chunks = num_readers, chunk_bytes, num_chunks
        self.stride = HEADER + chunk_bytes
        self.reader = reader
        size = self.stride * num_chunks
        if name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=size)
            self.shm.buf[:size] = bytes(size)  # headers zero: nothing written
        else:
            # attached, not owned: the writer unlinks it. Spawned readers share the writer's
            # resource tracker, which holds the name once however often it is registered.
            self.shm = shared_memory.SharedMemory(name=name)
        self.buf = self.shm.buf
        self.seq = 0
        self.spin_s = 0.002
        self.check_s = 0.2

    @property
    def name(self) -> str:
        return self.shm.name

    def handle(self) -> tuple:
        """What a reader needs to attach: ShmRing(*handle, reader=r)."""
        return (self.num_readers, self.chunk_bytes, self.num_chunks, self.shm.name)

    # -- waiting ----------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], on_wait: Callable[[], None] | None, timeout: float | None) -> None:
        if ready():
            return
        start = last_check = time.monotonic()
        sleep = 0.0
        while not ready():
            now = time.monotonic()
            if now - start < self.spin_s:
                os.sched_yield()
                continue
            if on_wait is not None and now - last_check >= self.check_s:
                on_wait()
                last_check = now
            if timeout is not None and now - start > timeout:
                raise TimeoutError("shared-memory ring: timed out waiting")
            sleep = min(max(sleep * 2, 20e-6), 1e-3 if now - start < 1.0 else 1e-2)
            time.sleep(sleep)

    # -- writer -------------------------------------------------------------------------
    def _free(self, base: int) -> bool:
        buf = self.buf
        if not buf[base]:
            return True
        return all(buf[base + 16 + r] for r in range(self.num_readers))

    def enqueue(self, obj, on_wait: Callable[[], None] | None = None, timeout: float | None = None) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        cb, buf = self.chunk_bytes, self.buf
        n = max(1, -(-len(data) // cb))
        for j in range(n):
            base = (self.seq % self.num_chunks) * self.stride
            self._wait(lambda base=base: self._free(base), on_wait, timeout)
            piece = data[j * cb : (j + 1) * cb]
            buf[base] = 0
            buf[base + HEADER : base + HEADER + len(piece)] = piece
            buf[base + 1] = 1 if j < n - 1 else 0
            buf[base + 8 : base + 16] = struct.pack("<Q", len(piece))
            buf[base + 16 : base + 16 + self.num_readers] = bytes(self.num_readers)
            buf[base] = 1
            self.seq += 1

    # -- reader -------------------------------------------------------------------------
    def dequeue(self, on_wait: Callable[[], None] | None = None, timeout: float | None = None):
        r, buf, parts = self.reader, self.buf, []
        assert r is not None, "dequeue on the writer's end"
        while True:
            base = (self.seq % self.num_chunks) * self.stride
            flag = base + 16 + r
            self._wait(lambda base=base, flag=flag: buf[base] == 1 and buf[flag] == 0, on_wait, timeout)
            (length,) = struct.unpack("<Q", buf[base + 8 : base + 16])
            parts.append(bytes(buf[base + HEADER : base + HEADER + length]))
            more = buf[base + 1]
            buf[flag] = 1
            self.seq += 1
            if not more:
                return pickle.loads(b"".join(parts) if len(parts) > 1 else parts[0])

    def close(self, unlink: bool = False) -> None:
        self.buf = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
            self.shm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
