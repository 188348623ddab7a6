"""The disk tier's bytes: block files round-trip bit-exact for every KV dtype and block
size, the index survives a restart, the LRU bound holds, a torn or foreign file is never
served, I/O errors disable the tier instead of raising."""

import errno
import os

import pytest
import torch

from pagedserve.executor.kv_offload_store import KVBlockStore, KVOffloadConnector, kv_fingerprint

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _caches(dtype, block_size, num_blocks=6, layers=3, heads=2, head_dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, head_dim)
    return [
        tuple((torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(2)) for _ in range(layers)
    ]


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_round_trip_bit_exact(tmp_path, dtype, block_size):
    src = _caches(dtype, block_size)
    fp = kv_fingerprint(dtype=str(dtype), block_size=block_size)
    conn = KVOffloadConnector(KVBlockStore(str(tmp_path), fp, 1 << 30), src)
    keys = [bytes([i]) * 16 for i in range(3)]
    assert conn.save(list(zip(keys, [1, 4, 2]))) == 3
    assert conn.drain(10)
    dst = _caches(dtype, block_size, seed=1)  # other contents; a restart: a new store reads the files
    conn2 = KVOffloadConnector(KVBlockStore(str(tmp_path), fp, 1 << 30), dst)
    assert all(conn2.contains(k) for k in keys)
    conn2.load(7, keys, [5, 3, 1])
    assert conn2.drain(10)
    (res,) = conn2.poll()
    assert res.job_id == 7 and all(p is not None for p in res.payloads)
    for (sk, sv), (dk, dv) in zip(src, dst):
        for s, d in ((sk, dk), (sv, dv)):
            for a, b in ((1, 5), (4, 3), (2, 1)):
                assert torch.equal(_bits(s[a]), _bits(d[b]))
    assert torch.equal(_bits(dst[0][0][0]), _bits(_caches(dtype, block_size, seed=1)[0][0][0]))
    conn.shutdown(1)
    conn2.shutdown(1)


def test_fingerprint_namespaces_and_lru(tmp_path):
    caches = _caches(torch.float32, 8)
    a = KVBlockStore(str(tmp_path), kv_fingerprint(model="a"), 1 << 30)
    b = KVBlockStore(str(tmp_path), kv_fingerprint(model="b"), 1 << 30)
    conn = KVOffloadConnector(a, caches)
    key = b"k" * 16
    conn.save([(key, 1)])
    conn.drain(10)
    assert a.contains(key) and not b.contains(key)  # another model's namespace is empty
    # a file copied into the wrong namespace is refused by its header's fingerprint
    os.link(a._path(key), b._path(key))
    assert b.get(key) is None and b.num_corrupt == 1
    # LRU bound: room for two blocks
    size = a.index[key]
    small = KVBlockStore(str(tmp_path / "small"), kv_fingerprint(model="a"), 2 * size)
    c2 = KVOffloadConnector(small, caches)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, k in enumerate(keys):
        c2.save([(k, i + 1)])
        c2.drain(10)
        if i == 1:
            assert small.get(keys[0]) is not None  # touch: keys[1] is now the least recent
    assert set(small.index) == {keys[0], keys[2]} and small.bytes_used <= 2 * size
    assert len(os.listdir(small.dir)) == 2
    conn.shutdown(1)
    c2.shutdown(1)


def test_torn_and_corrupt_writes_are_never_served(tmp_path):
    caches = _caches(torch.bfloat16, 16)
    fp = kv_fingerprint(x=1)
    store = KVBlockStore(str(tmp_path), fp, 1 << 30)
    conn = KVOffloadConnector(store, caches)
    k1, k2 = b"1" * 16, b"2" * 16
    conn.save([(k1, 1), (k2, 2)])
    conn.drain(10)
    conn.shutdown(1)
    # a crash between write and publish leaves only a temporary file: never indexed
    with open(store._path(b"3" * 16) + ".123.tmp", "wb") as f:
        f.write(b"partial")
    # a file cut short (torn) and one with a flipped payload byte
    with open(store._path(k1), "r+b") as f:
        f.truncate(os.path.getsize(store._path(k1)) - 10)
    with open(store._path(k2), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    again = KVBlockStore(str(tmp_path), fp, 1 << 30)
    assert set(again.index) == {k1, k2}
    assert again.get(k1) is None and again.get(k2) is None
    assert again.num_corrupt == 2 and len(again) == 0 and not os.path.exists(again._path(k1))


def test_io_errors_disable_the_tier(tmp_path, monkeypatch):
    caches = _caches(torch.float32, 8)
    store = KVBlockStore(str(tmp_path), kv_fingerprint(x=2), 1 << 30)
    conn = KVOffloadConnector(store, caches)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_file", full)
    conn.save([(b"a" * 16, 1)])
    conn.drain(10)
    assert not conn.enabled and conn.counters.errors == 1 and "disk full" in conn.counters.disabled_reason
    assert conn.save([(b"b" * 16, 2)]) == 0 and not conn.contains(b"a" * 16)
    conn.shutdown(1)


def test_replicas_share_a_namespace(tmp_path):
    """Two stores on one namespace (data-parallel replicas) writing the same blocks while a
    third reads: a reader sees a whole, verified block or a miss, never a torn one; a
    block one replica published is found by another that started before it."""
    import threading

    caches = _caches(torch.float32, 16, num_blocks=9)
    fp = kv_fingerprint(x=3)
    stores = [KVBlockStore(str(tmp_path), fp, 1 << 30) for _ in range(3)]
    conns = [KVOffloadConnector(s, caches) for s in stores[:2]]
    keys = [bytes([i]) * 16 for i in range(8)]
    want = {k: conns[0].gather([i + 1]).numpy().tobytes() for i, k in enumerate(keys)}
    bad = []

    def read():
        for _ in range(200):
            for k in keys:
                p = stores[2].get(k) if stores[2].contains(k) else None
                if p is not None and p != want[k]:
                    bad.append(k)

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(5):
        for c in conns:
            c.save([(k, i + 1) for i, k in enumerate(keys)])
        for c in conns:
            c.drain(10)
            c.store.index.clear()  # write them again: the files are replaced under the reader
    reader.join()
    assert bad == [] and stores[2].num_corrupt == 0
    assert all(stores[2].contains(k) and stores[2].get(k) == want[k] for k in keys)
    assert not [n for n in os.listdir(stores[0].dir) if n.endswith(".tmp")]
    for c in conns:
        c.shutdown(1)
