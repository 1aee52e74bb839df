"""Resident memory of a server's process tree (API server, engine core, workers), over time.

`RssSampler(pid)` samples, every `interval_s` in a thread, the RSS of the process `pid` and of all
its descendants (psutil), beside a caller-supplied progress figure (requests done), and
`growth_per_1k(samples, skip)` fits a line through (requests done, total RSS) after a warm-up:
the slope a leak shows up in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RssSample:
    elapsed_s: float
    requests_done: int
    rss_by_process: dict[str, int]  # "name[pid]" -> bytes

    @property
    def total(self) -> int:
        return sum(self.rss_by_process.values())


def process_tree_rss(pid: int) -> dict[str, int]:
    """RSS in bytes of `pid` and each of its descendants, keyed "name[pid]"."""
    import psutil

    root = psutil.Process(pid)
    rss = {}
    for proc in [root] + root.children(recursive=True):
        try:
            rss[f"{proc.name()}[{proc.pid}]"] = proc.memory_info().rss
        except psutil.NoSuchProcess:  # a helper process that just exited
            continue
    return rss


class RssSampler:
    """Samples `process_tree_rss(pid)` every `interval_s` until stopped (use as a context)."""

    def __init__(self, pid: int, progress: Callable[[], int], interval_s: float = 2.0):
        self.pid, self.progress, self.interval_s = pid, progress, interval_s
        self.samples: list[RssSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._start = time.monotonic()

    def sample(self) -> RssSample:
        sample = RssSample(time.monotonic() - self._start, self.progress(), process_tree_rss(self.pid))
        self.samples.append(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def growth_per_1k(samples: list[RssSample], skip_requests: int) -> float:
    """Least-squares slope of total RSS (MiB) per 1000 requests done, over the samples taken after
    `skip_requests` requests (allocator and cache warm-up)."""
    import numpy as np

    kept = [s for s in samples if s.requests_done >= skip_requests]
    if len({s.requests_done for s in kept}) < 2:
        raise ValueError(f"need samples at two or more progress points after {skip_requests} requests")
    done = np.array([s.requests_done for s in kept], dtype=np.float64)
    mib = np.array([s.total for s in kept], dtype=np.float64) / 2**20
    return float(np.polyfit(done, mib, 1)[0] * 1000.0)
