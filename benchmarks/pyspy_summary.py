"""Summarize py-spy's raw (collapsed) stacks: the share of samples in which each function is
on the stack (inclusive) and at its top (self).

    python benchmarks/pyspy_summary.py STACKS.txt [--top 40]
"""

from __future__ import annotations

import argparse
import collections


def frame_name(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func file.py:12'."""
    func, _, where = frame.partition(" (")
    return f"{func} {where.rstrip(')').split('/')[-1]}"


def summarize(lines) -> tuple[int, collections.Counter, collections.Counter]:
    """(samples, inclusive counts, self counts) by frame name."""
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        names = [frame_name(f) for f in stack.split(";")]
        for name in set(names):
            inclusive[name] += n
        own[names[-1]] += n
    return total, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stacks")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.stacks) as f:
        total, inclusive, own = summarize(f)
    print("samples", total)
    for title, counts in (("inclusive", inclusive), ("self", own)):
        print("---", title)
        for name, n in counts.most_common(a.top):
            print(f"{100 * n / total:5.1f}% {name}")


if __name__ == "__main__":
    main()
