"""CPU seconds used by a process, or by a process and its descendants, read from ``/proc``."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) used so far by process ``pid``; None if unknown.

    Read from ``/proc/<pid>/stat`` (Linux), so a benchmark can say what a request costs the
    server, not only how long it took.
    """
    fields = _stat_fields(pid)
    if fields is None:
        return None
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (proc(5)'s field 3 onwards)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: count fields from its closing parenthesis
    return stat[stat.rindex(")") + 2 :].split()


def process_tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by process ``pid`` and every live descendant; None if unknown.

    For a server of several processes (``rnnserve --workers N``: the supervisor, the engine and
    the N workers). Each process counts its own user + system time (all threads) plus that of
    the children it has waited for (``cutime`` + ``cstime``), so a descendant that exits and is
    reaped between two readings is not lost from the second: its time moves to its parent's
    figure. Descendants are found by their parent ids in ``/proc/*/stat`` (Linux).
    """
    parents: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields is None:  # gone since the listing
            continue
        child = int(entry.name)
        parents.setdefault(int(fields[1]), []).append(child)  # field 4: the parent's id
        times[child] = sum(int(f) for f in fields[11:15])  # fields 14-17: utime .. cstime
    if pid not in times:
        return None
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += times.get(p, 0)
        todo += parents.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")
