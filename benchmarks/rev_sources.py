"""What the A/B scripts of a kernel change share (attention_rev_ab.py, quant_rev_ab.py): another
commit's C++ sources in a scratch folder, to build its module beside the working tree's in one
process (the editable install always imports the working tree), and a bf16 engine to swap the
modules in."""

from __future__ import annotations

import os
import subprocess
import tempfile


def sources_at(rev: str, folders: list[str]) -> tuple[str, list[str]]:
    """(scratch root, the repository paths written under it): every file `folders` held at `rev`."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = subprocess.run(["git", "-C", here, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    git = ["git", "-C", root]  # paths below are the repository's
    tmp = tempfile.mkdtemp(prefix=f"rev_{rev}_")
    files = subprocess.run([*git, "ls-tree", "--name-only", rev, *(f"{d}/" for d in folders)],
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        dst = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(subprocess.run([*git, "show", f"{rev}:{rel}"], capture_output=True, check=True).stdout)
    return tmp, files


def bf16_engine(model_path: str, max_num_seqs: int):
    """(engine, its core, its model) of a bf16 LLM without prefix caching."""
    from pagedserve import LLM

    eng = LLM(model_path, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=max_num_seqs).engine
    ec = eng.engine_core
    return eng, ec, getattr(ec, "engine_core", ec).executor.runner.model
