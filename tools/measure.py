"""What the command lines measure with: percentiles of timings and the process's resident memory.

Owns: ``percentile`` (nearest rank over the sorted values, the one definition every bench and
the load test print) and ``rss_bytes`` (``VmRSS`` from /proc). Knows nothing about engines.
"""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * (len(ordered) - 1) + 0.5)))]


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
