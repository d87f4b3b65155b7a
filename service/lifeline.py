"""The processes ``rnnserve --workers N`` starts die with it, however it ends.

On SIGTERM the supervisor stops its HTTP workers and the engine itself; killed (``kill -9``, the
OOM killer) it cannot, and its children lived on: the workers kept the port bound and answered
503 for ever, and a restarted server could not bind it. So each child asks for
:func:`die_with_parent` as it starts: on Linux the kernel sends it SIGTERM when the supervisor
dies (``prctl(PR_SET_PDEATHSIG)``), and a thread that watches the parent's pid does the same
elsewhere, or where the parent died before the request was made. SIGTERM is the graceful stop:
the child finishes what it holds, as on an orderly shutdown.

Standard library only: an HTTP worker imports it before anything else of the server's.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0


def parent_pid() -> int:
    """The pid of the process that started this one (``multiprocessing`` knows it even after
    that process has died; ``os.getppid()`` then names whoever adopted this one)."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        return parent.pid
    return os.getppid()


def parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies; False where it
    cannot (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Receive ``signum`` once the parent process is gone: from the kernel, and from a thread
    that polls the parent's pid (the fallback, and the check for a parent already gone)."""
    parent = parent_pid()
    parent_death_signal(signum)
    watch = threading.Thread(
        target=_signal_when_gone, args=(parent, signum), name="rnnserve-parent-watch", daemon=True
    )
    watch.start()


def _signal_when_gone(parent: int, signum: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    log.error("the rnnserve parent process (%d) is gone; stopping", parent)
    os.kill(os.getpid(), signum)
