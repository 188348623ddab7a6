"""Another commit's C++ sources in a scratch folder, to build its module beside the working
tree's in one process (attention_rev_ab.py, quant_rev_ab.py): the editable install always
imports the working tree, so an A/B of a kernel change needs the old sources built apart."""

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
