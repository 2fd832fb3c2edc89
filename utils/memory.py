"""How much memory a process may take: the least of the memory available and the room under its container's limits
(cgroup v2 or v1), shared by the processes on its machine; and handing back what it freed."""

import ctypes
from pathlib import Path
from typing import NamedTuple

from utils.general import LOCAL_WORLD_SIZE

MEMORY_SHARE = 0.8  # of the memory available at start-up that the caches of a machine's processes may take
NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63 (rounded to pages)


class Budget(NamedTuple):
    """Bytes one process's cache may take, and what they were derived from (for the error that refuses a cache)."""

    nbytes: float  # MEMORY_SHARE of room, divided by processes
    room: int  # bytes: the least of MemAvailable and the room under the cgroup's limit
    source: str  # which of the two room is
    processes: int  # processes on this machine, each holding a cache of its own


def memory_budget(meminfo="/proc/meminfo", cgroup="/sys/fs/cgroup", self_cgroup="/proc/self/cgroup",
                  processes=None):
    """The Budget of one process's cache: MEMORY_SHARE of the least of the memory available (MemAvailable, which
    counts the page cache as free, as it is: the kernel drops it when asked) and the room left under this process's
    cgroup limits, divided among the processes on this machine (each holds its own cache; by default torchrun's
    LOCAL_WORLD_SIZE); None where neither can be read (not Linux)."""
    rooms = [(room, source) for room, source in ((mem_available(meminfo), "of memory available"),
                                                 (cgroup_room(cgroup, self_cgroup), "left under the container's "
                                                                                    "memory limit"))
             if room is not None]
    if not rooms:
        return None
    room, source = min(rooms, key=lambda pair: pair[0])
    room, processes = max(room, 0), max(int(processes or LOCAL_WORLD_SIZE), 1)
    return Budget(MEMORY_SHARE * room / processes, room, source, processes)


def mem_available(meminfo="/proc/meminfo"):
    """MemAvailable of meminfo in bytes (None where it cannot be read)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_room(cgroup="/sys/fs/cgroup", self_cgroup="/proc/self/cgroup"):
    """Bytes this process's memory cgroup and its ancestors leave under their limits, the least of them (cgroup
    v2, else v1); None where no limit is set or none can be read."""
    v2_path, v1_path = cgroup_paths(self_cgroup)
    rooms = [room for room in (cgroup_level_room(folder, "memory.max", "memory.current", "inactive_file")
                               for folder in levels(Path(cgroup), v2_path))
             if room is not None]
    if not rooms:
        rooms = [room for room in (cgroup_level_room(folder, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                     "total_inactive_file")
                                   for folder in levels(Path(cgroup) / "memory", v1_path))
                 if room is not None]
    return min(rooms) if rooms else None


def cgroup_paths(self_cgroup):
    """(v2 path, v1 memory path) of this process's cgroups, from /proc/self/cgroup ('/' where unknown)."""
    v2_path, v1_path = "/", "/"
    try:
        for line in Path(self_cgroup).read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2_path = path
            elif "memory" in controllers.split(","):
                v1_path = path
    except (OSError, ValueError):
        pass
    return v2_path, v1_path


def levels(root, path):
    """root/path and each of its parents up to root. Inside a container the path may name the host's hierarchy,
    which root does not hold: those levels are skipped, and root itself is the container's own cgroup."""
    parts = [part for part in path.strip("/").split("/") if part]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def cgroup_level_room(folder, limit_file, usage_file, inactive_key):
    """Bytes one cgroup leaves under its limit (None where it has none or its files cannot be read). Its usage
    counts the page cache; the inactive part of it, which the kernel reclaims before it runs out, is room (as
    container runtimes count a working set)."""
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= NO_LIMIT:
            return None
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    return int(limit) - max(usage - cgroup_stat(folder / "memory.stat", inactive_key), 0)


def cgroup_stat(stat_file, key):
    """One value of a cgroup's memory.stat (0 where it cannot be read)."""
    try:
        for line in Path(stat_file).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def size_text(nbytes):
    """A byte count as people read it (B, KiB, MiB or GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def release_freed_memory():
    """Hand the memory freed so far back to the system (glibc's malloc_trim). Listing a data set frees some tens
    of bytes an image between allocations that live on, which glibc otherwise keeps in the process: listing 320,000
    files held 90 bytes an image, 34 once trimmed (the file list's own; benchmarks/scale.py --only startup measures
    the whole start-up). Nothing happens where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # no C library to load, or another one than glibc
        pass
