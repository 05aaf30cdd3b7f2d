"""Host-wide leases of sandbox uid ranges.

Every sandbox slot runs as its own unprivileged uid. Two live executors must never share one:
RLIMIT_NPROC is counted per uid, a uid's processes can signal each other, and the fallback
without PID namespaces kills everything of a slot's uid after each call. Ranges of any size are
leased in blocks of `BLOCK` uids; each block is held with an exclusive `flock` on its own lock
file for the executor's life. The kernel drops a lock when its holder dies, however it dies, so
a killed executor never strands its range, and overlapping requests of any sizes conflict
exactly where their blocks overlap. A range is also skipped while any process still runs under
one of its uids (leftovers of an executor that was killed, or uids someone else uses).

Searched from `UID_FLOOR` up (above ordinary accounts and the usual 65536 container maps),
below 2**31 (some tools mishandle larger uids; 2**32 - 1 means "no uid" to the kernel).
"""
from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os

BLOCK = 64
UID_FLOOR = 100_000
UID_CEILING = 2**31 - 1
LOCK_DIRS = ("/run/rstarjax-uids", "/tmp/rstarjax-uids")
_sequence = itertools.count()


@dataclasses.dataclass
class UidLease:
    base: int
    size: int
    fds: list[int]

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)  # closing the file drops its lock
        self.fds = []


def _lock_dir() -> str | None:
    for path in LOCK_DIRS:
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    return None


def live_uids() -> set[int]:
    """Real uids of every process on the host (as far as /proc shows them)."""
    uids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        uids.add(int(line.split()[1]))
                        break
        except OSError:
            continue
    return uids


def _try_blocks(directory: str, first: int, count: int) -> list[int] | None:
    fds = []
    for block in range(first, first + count):
        fd = os.open(os.path.join(directory, f"block-{block}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            for held in fds:
                os.close(held)
            return None
        fds.append(fd)
    return fds


def lease(size: int) -> UidLease:
    """`size` consecutive uids no other live executor on this host holds."""
    if size < 1:
        raise ValueError(f"a uid lease needs at least one uid, got {size}")
    count = -(-size // BLOCK)
    first, last = UID_FLOOR // BLOCK + 1, UID_CEILING // BLOCK - count
    directory = _lock_dir()
    if directory is None:
        # No writable lock directory (not root: uids are never dropped then). Stay unique within
        # the process and spread between processes.
        base = UID_FLOOR + ((os.getpid() * 1024 + next(_sequence)) * count * BLOCK) % (UID_CEILING - UID_FLOOR - size)
        return UidLease(base, size, [])
    busy = live_uids()
    block = first
    while block <= last:
        fds = _try_blocks(directory, block, count)
        if fds is not None:
            base = block * BLOCK
            if not any(base <= uid < base + size for uid in busy):
                return UidLease(base, size, fds)
            for fd in fds:
                os.close(fd)
        block += count
    raise RuntimeError(f"no free range of {size} sandbox uids between {UID_FLOOR} and {UID_CEILING}")
