"""executor/cpp_build.py: builds keyed by content (any checkout finds them), atomic, never
wedged by a build that was killed (issue 31: an interrupted first start hung every later one)."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedserve.executor import cpp_build

# A plain CPython extension: it compiles in about a second (no torch headers).
TINY = textwrap.dedent(
    """
    #include <Python.h>
    #define STR2(x) #x
    #define STR(x) STR2(x)
    #define CAT2(a, b) a##b
    #define CAT(a, b) CAT2(a, b)
    static PyObject* answer(PyObject* self, PyObject* args) { return PyLong_FromLong(ANSWER); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
    static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), NULL, -1, methods};
    PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&mod); }
    """
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def write_source(folder, answer: int):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "answer.h").write_text(f"#define ANSWER {answer}\n")
    src = folder / "tiny.cpp"
    src.write_text('#include "answer.h"\n' + TINY)
    return str(src), str(folder / "answer.h")


def entries(cache):
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_build_found_again_from_another_checkout_and_rebuilt_when_edited(cache, tmp_path, capfd):
    src, hdr = write_source(tmp_path / "checkout_a", 42)
    assert cpp_build.load_extension("tiny", [src], headers=(hdr,)).answer() == 42
    assert "building CPU kernels: tiny" in capfd.readouterr().err
    # the same bytes at another path: the same entry, no build
    src_b, hdr_b = write_source(tmp_path / "checkout_b", 42)
    assert cpp_build.load_extension("tiny", [src_b], headers=(hdr_b,)).answer() == 42
    assert "building" not in capfd.readouterr().err
    assert len(entries(cache)) == 1
    # an edited header is part of the key: a new build, never the stale one
    write_source(tmp_path / "checkout_b", 7)
    assert cpp_build.load_extension("tiny", [src_b], headers=(hdr_b,)).answer() == 7
    assert len(entries(cache)) == 2


HOLD_AND_DIE = """
import os, sys, time
from pagedserve.executor import cpp_build
real_build = cpp_build._build
def slow_build(*a, **kw):
    os.makedirs(a[3] + ".tmp-half-done", exist_ok=True)  # what a killed compiler leaves
    print("building", flush=True)
    time.sleep(120)
cpp_build._build = slow_build
cpp_build.load_extension("tiny", [sys.argv[1]], headers=(sys.argv[2],))
"""


def test_a_build_killed_midway_does_not_wedge_the_next_start(cache, tmp_path, caplog):
    """The first start is SIGKILLed while it builds (holding the build's turn); a second
    start meanwhile waits, says so, and builds once the first is gone; a third finds it."""
    src, hdr = write_source(tmp_path / "src", 5)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_DIE, src, hdr], stdout=subprocess.PIPE, env=dict(os.environ), text=True
    )
    try:
        assert child.stdout.readline().strip() == "building"
        import threading

        got = {}
        t = threading.Thread(target=lambda: got.setdefault("m", cpp_build.load_extension("tiny", [src], headers=(hdr,))))
        with caplog.at_level("WARNING", logger="pagedserve.executor.cpp_build"):
            t.start()
            time.sleep(1.0)
            assert t.is_alive()  # its turn comes after the first builder's
            assert f"pid {child.pid}" in caplog.text
            child.send_signal(signal.SIGKILL)
            t.join(60)
        assert not t.is_alive() and got["m"].answer() == 5
    finally:
        child.kill()
        child.wait()
    assert cpp_build.load_extension("tiny", [src], headers=(hdr,)).answer() == 5
    assert len(entries(cache)) == 1  # the dead builder's half-done directory is gone too


def test_a_failed_build_leaves_nothing_behind(cache, tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(Exception):  # noqa: B017 (torch's build error type)
        cpp_build.load_extension("bad", [str(bad)])
    assert entries(cache) == []


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_build_all_reports_every_module():
    """`make setup`'s step: every kernel module is found (built by it, or an earlier start)."""
    flags = pathlib.Path("/proc/cpuinfo").read_text().split() if os.path.exists("/proc/cpuinfo") else []
    avx2 = "avx2" in flags and "fma" in flags  # the LoRA kernels' floor (below it: the PyTorch path)
    built = cpp_build.build_all()
    assert built == {"quant": True, "fused_ops": True, "attention": True, "lora": avx2, "moe": True}
