"""Files a run writes that a kill (SIGKILL, an out-of-memory kill, power loss) must not leave
half-written for the next run, ``rstarjax.report``, export or eval to read:

* a whole file (a summary, a dataset, eval results) is written to ``PATH.tmp`` and renamed
  over ``PATH`` (``write_atomic``): a reader finds the old contents or the new, never a part;
* an append-only JSONL log (``metrics.jsonl``, the filter's progress) torn by a kill mid-line
  is cut back to its last whole line before anything is appended (``cut_torn_tail``): the next
  line would otherwise be glued onto the torn one, one unreadable line that loses the record
  appended with it.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)


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
