"""envs.py is the one module that reads pagedserve's environment variables."""

import pathlib
import re

import pytest

import pagedserve
from pagedserve import envs

ROOT = pathlib.Path(pagedserve.__file__).parent


def test_no_module_reads_a_pagedserve_variable_itself():
    bad = []
    for path in ROOT.rglob("*.py"):
        if path.name == "envs.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*PAGEDSERVE_", line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert bad == []


def test_every_variable_used_is_declared_and_documented():
    used = set()
    for path in ROOT.rglob("*.py"):
        used |= set(re.findall(r"\benvs\.(PAGEDSERVE_\w+)", path.read_text()))
    assert used <= set(envs.VARIABLES)
    assert all(v.doc for v in envs.VARIABLES.values())


def test_values_are_read_when_accessed(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_NO_FUSED_OPS", "1")
    assert envs.PAGEDSERVE_NO_FUSED_OPS is True
    monkeypatch.setenv("PAGEDSERVE_NO_FUSED_OPS", "0")
    assert envs.PAGEDSERVE_NO_FUSED_OPS is False
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", "3")
    assert envs.PAGEDSERVE_NUM_THREADS == 3
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "/somewhere")
    assert envs.PAGEDSERVE_CACHE_DIR == "/somewhere"
    with pytest.raises(AttributeError):
        _ = envs.PAGEDSERVE_NOT_A_VARIABLE
