"""A synthetic front end: busy-loops BUSY_MS every PERIOD_MS on whichever CPU the OS gives it,
to measure what another process's bursts cost an engine step (BENCHMARKS section 68):

    python benchmarks/cpu_burst.py 6 50 &
    .venv/bin/python benchmarks/decode_step_ab.py --model M --batches 64
    kill %1
"""

import sys
import time


def main() -> None:
    busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        time.sleep(max(0.0, period - busy))


if __name__ == "__main__":
    main()
