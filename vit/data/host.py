"""What this machine has for the data: the memory a new allocation can take."""

from __future__ import annotations

import contextlib
from pathlib import Path


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes a new allocation can take: the kernel's MemAvailable, capped by a cgroup v2 limit.

    Free pages alone (sysconf's AVPHYS) leave out the page cache, which reading a dataset fills and
    the kernel gives back on demand: after one pass over a folder they can read near zero.
    """
    available = None
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            used = int((cgroup / "memory.current").read_text()) - int(stat.get("inactive_file", 0))
            in_group = max(int(limit) - used, 0)
            available = in_group if available is None else min(available, in_group)
    return available
