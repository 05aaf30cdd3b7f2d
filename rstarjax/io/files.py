"""Files a run writes that a kill (SIGKILL, an out-of-memory kill, power loss) must not leave
half-written for the next run, ``rstarjax.report``, export or eval to read:

* a whole file (a summary, a dataset, eval results) is written to ``PATH.tmp`` and renamed
  over ``PATH`` (``write_atomic``): a reader finds the old contents or the new, never a part;
* an append-only JSONL log (``metrics.jsonl``, the filter's progress) torn by a kill mid-line
  is cut back to its last whole line before anything is appended (``cut_torn_tail``): the next
  line would otherwise be glued onto the torn one, one unreadable line that loses the record
  appended with it;
* a directory read as one thing (an exported HuggingFace model) is written beside it and renamed
  into place once complete (``staged_dir``, ``new_staging`` + ``replace_dir``); the staging
  folders a kill leaves are found by their lock and removed by the next write.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or one in its chain is ENOSPC / EDQUOT (TensorStore reports them as text:
    ``No space left on device [os_error_code='28']``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if any(s in text for s in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT),
                                   f"os_error_code='{errno.ENOSPC}'", f"os_error_code='{errno.EDQUOT}'")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def write_atomic(path: str, text: str) -> None:
    """``text`` in ``path``, through ``PATH.tmp`` synced to disk then renamed over it (a crash
    before the rename leaves the old file; after it, the new one whole)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename: power loss must not leave an empty file
    os.replace(tmp, path)


def write_json_atomic(path: str, obj: Any, indent: int = 2) -> None:
    write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def write_jsonl_atomic(path: str, rows: Iterable[Mapping[str, Any]], ensure_ascii: bool = True) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in rows))


def _start_of_last_line(f, size: int, chunk: int = 1 << 16) -> int:
    """The offset just past the last newline of the binary file ``f`` of ``size`` bytes (0: none),
    read backwards in chunks (a log of many steps is not read whole)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        at = f.read(end - start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def cut_torn_tail(path: str) -> bool:
    """Make the JSONL file at ``path`` end with a whole line before it is appended to: a last
    line without its newline that is a whole JSON object gets the newline; one that is not (a
    record a kill cut short) is removed, with a warning. Returns whether it removed one."""
    if not os.path.exists(path):
        return False
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        start = _start_of_last_line(f, size)
        if start == size:  # empty, or ends with a newline
            return False
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)  # every record of these logs is an object
        except ValueError:  # (UnicodeDecodeError too: a kill can cut a character in two)
            whole = False
        if not whole:
            f.truncate(start)
            log.warning("%s: dropped its last line, %d bytes cut short (a run killed while writing it): %r",
                        path, len(tail), tail[:80])
            return True
        f.write(b"\n")
        return False


STAGING_INFIX = ".export-"  # .OUT.export-XXXX beside OUT, with its lock .OUT.export-XXXX.lock


@dataclasses.dataclass
class Staging:
    """The directory a directory ``OUT`` is written into beside it before it is renamed into place
    (``replace_dir``), and the lock file beside it that this process holds (``flock``) until
    ``close``: a later write of ``OUT`` finds the leftovers of one that was killed (SIGKILL, out of
    memory) by their lock no longer being held."""
    path: str
    lock_path: str
    fd: int

    def close(self) -> None:
        """Remove what is left of the staging (nothing once published), then the lock."""
        for leftover in (self.path, self.path + ".replaced"):
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            os.unlink(self.lock_path)
        except FileNotFoundError:
            pass
        os.close(self.fd)


def _staging_prefix(out_dir: str) -> tuple[str, str]:
    out = os.path.abspath(out_dir)
    return os.path.dirname(out), f".{os.path.basename(out)}{STAGING_INFIX}"


def remove_abandoned_stagings(out_dir: str) -> list[str]:
    """Remove the staging directories that killed writes of ``out_dir`` left beside it (an export's
    is a whole model copy, hidden by its leading dot) and return them. One whose lock a live export
    holds is kept; a lock is taken before its directory is made and unlinked after it is
    removed, so a staging directory without its lock file is abandoned too."""
    parent, prefix = _staging_prefix(out_dir)
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return []
    locked = {n[:-len(".lock")] for n in names if n.endswith(".lock")}
    removed = []

    def remove(stem: str) -> None:
        for name in (stem, stem + ".replaced"):
            if name in names:
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                removed.append(os.path.join(parent, name))

    for stem in sorted(locked):
        try:
            fd = os.open(os.path.join(parent, stem + ".lock"), os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live export
            remove(stem)
            os.unlink(os.path.join(parent, stem + ".lock"))
        finally:
            os.close(fd)
    for stem in sorted({n.removesuffix(".replaced") for n in names if not n.endswith(".lock")} - locked):
        remove(stem)
    if removed:
        log.warning("removed %d folder(s) left beside %s by a write (an export) that was killed: %s", len(removed),
                    out_dir, ", ".join(os.path.basename(r) for r in removed))
    return removed


def _locked_staging(parent: str, prefix: str) -> Staging:
    """A new staging directory under a lock this process holds (checked still to be the file at
    its path: a concurrent cleaner may have taken and unlinked it between its creation and our
    flock, so then try again)."""
    while True:
        fd, lock_path = tempfile.mkstemp(prefix=prefix, suffix=".lock", dir=parent)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                path = lock_path[:-len(".lock")]
                os.mkdir(path)
                return Staging(path, lock_path, fd)
        except FileNotFoundError:
            pass
        os.close(fd)


def new_staging(out_dir: str) -> Staging:
    """A locked staging directory beside ``out_dir`` (its parent made), after removing what
    killed writes of ``out_dir`` left there. ``OSError`` when the parent cannot be written."""
    parent, prefix = _staging_prefix(out_dir)
    os.makedirs(parent, exist_ok=True)
    remove_abandoned_stagings(out_dir)
    return _locked_staging(parent, prefix)


def replace_dir(staging: str, out_dir: str) -> bool:
    """Rename the complete directory ``staging`` to ``out_dir``, replacing what was there (the
    caller has checked it may); returns whether a non-empty directory was replaced. Renames
    within one directory, so ``out_dir`` is the old one or the new one whole, never a mix (a
    kill between the two renames leaves no ``out_dir`` and the old one as ``STAGING.replaced``,
    removed by the next write)."""
    old, replaced = None, os.path.isdir(out_dir) and bool(os.listdir(out_dir))
    if os.path.isdir(out_dir):
        old = staging + ".replaced"
        os.rename(out_dir, old)
    try:
        os.rename(staging, out_dir)
    except OSError:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return replaced


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
    """``with staged_dir(OUT) as d:`` write the files into ``d``; when the block ends without an
    exception, ``d`` replaces ``OUT`` whole (a kill or an error leaves ``OUT`` as it was): for a
    directory another program reads as one thing (a HuggingFace model: shards, index, tokenizer)."""
    staging = new_staging(out_dir)
    try:
        yield staging.path
        replace_dir(staging.path, out_dir)
    finally:
        staging.close()
