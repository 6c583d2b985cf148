"""Facts of the host: the CPU cores this process may really use (its affinity mask, capped by a
cgroup CPU quota: a container limited to 2 CPUs on a 64-core host may use 2, whatever
os.cpu_count() says), and its resident memory."""

from __future__ import annotations

import math
import os

CGROUP_V2_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_limit(v2_max: str = CGROUP_V2_MAX, v1_quota: str = CGROUP_V1_QUOTA,
                     v1_period: str = CGROUP_V1_PERIOD) -> int | None:
    """Whole CPUs the cgroup quota allows (rounded up), or None without a quota."""
    line = _read(v2_max)
    if line is not None:
        quota, _, period = line.partition(" ")
        if quota != "max" and period:
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    quota, period = _read(v1_quota), _read(v1_period)
    if quota is not None and period is not None and int(quota) > 0:
        return max(1, math.ceil(int(quota) / int(period)))
    return None


def available_cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, limit) if limit else cores)


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux), or None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
