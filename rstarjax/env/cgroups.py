"""Budgets for a call's processes together: memory, process count and CPU time, through cgroups.

Per-process rlimits bound each process of a call, not the call: 32 processes of 1 GiB each are
allowed by them. Each sandbox slot therefore gets a cgroup, and every process of a call is
born in it: the slot's forker (see forker.py) joins it once, and children inherit their
parent's cgroup, so no process is ever moved per call and none can leave (moving needs write
access to a root-owned `cgroup.procs`).

* Memory (`memory.max` / `memory.limit_in_bytes`; files in the call's tmpfs count too) and
  processes (`pids.max`) are enforced by the kernel.
* CPU time is accounted by the kernel (`cpu.stat` / `cpuacct.usage`) and enforced by the
  worker, which kills a call whose processes together used more than `call_cpus` x its timeout
  CPU-seconds. The CPU *controller* is not used: it schedules each cgroup as one entity, so all
  sandboxes together would weigh as much as one thread of the trainer or of any neighbour
  (measured: half the throughput on a shared 2-core machine), and real-time workers could not
  live below it.

Where: cgroup v2 where memory and pids can be delegated to a subtree (the trainer's cgroup must
be the root of the hierarchy or have them in `cgroup.subtree_control` already: a v2 cgroup
holding processes cannot hand controllers to children); else cgroup v1 where those controllers
are mounted as v1 hierarchies (hybrid hosts, like the development machine and CI of this
project; CPU time from a cpuacct hierarchy that is not co-mounted with cpu); else none (no
root, a read-only cgroupfs): then only the per-process limits apply and
`isolation["call_budget"]` says "rlimits" (see docs/code_env.md, "Threat model").

Layout: <trainer's cgroup>/rstarjax-<pid>-<n>/w<worker>s<slot>, made by the trainer at start
(`CgroupTree.create`) and removed at close, after killing whatever is still inside. Only the
standard library is imported: workers and forkers use `join`, `start_memory_window`,
`memory_events` and `cpu_seconds`.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time

V1, V2, NONE = "cgroup-v1", "cgroup-v2", "rlimits"
_PREFIX = "rstarjax-"


@dataclasses.dataclass(frozen=True)
class CallBudget:
    memory_bytes: int  # all processes of a call, page cache and tmpfs included
    pids: int  # processes and threads of a call, its forker included


def slot_name(worker: int, slot: int) -> str:
    return f"w{worker}s{slot}"


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the filesystem, type, super options) of every mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields, tail = left.split(), right.split()
            out.append((_unescape(fields[4]), _unescape(fields[3]), tail[0], set(tail[2].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller ("" for v2) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _join_path(mount: str, root: str, path: str) -> str:
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return os.path.join(mount, path.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _v2_parent() -> str | None:
    """The trainer's v2 cgroup, if memory and pids can be enabled for a subtree of it."""
    own = _own_cgroups()
    mount = next(((m, r) for m, r, kind, _ in _mounts() if kind == "cgroup2"), None)
    if mount is None or "" not in own:
        return None
    parent = _join_path(mount[0], mount[1], own[""])
    try:
        available = set(_read(os.path.join(parent, "cgroup.controllers")).split())
        if not {"memory", "pids"} <= available:
            return None
        enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
        wanted = {"memory", "pids"}
        if not wanted <= enabled:
            _write(os.path.join(parent, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted - enabled))
    except OSError:
        return None
    return parent


def _v1_parents() -> dict[str, str] | None:
    """Controller -> the trainer's v1 cgroup directory, for memory, pids and (where it is not
    co-mounted with the cpu controller) cpuacct."""
    own = _own_cgroups()
    parents = {}
    for mount, root, kind, options in _mounts():
        if kind != "cgroup":
            continue
        for controller in ("memory", "pids", "cpuacct"):
            if controller == "cpuacct" and "cpu" in options:
                continue
            if controller in options and controller in own and controller not in parents:
                parents[controller] = _join_path(mount, root, own[controller])
    if "memory" not in parents or "pids" not in parents:
        return None
    if not all(os.access(os.path.join(p, "cgroup.procs"), os.W_OK) for p in parents.values()):
        return None
    return parents


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_members(directory: str, timeout: float = 5.0) -> bool:
    """SIGKILL every process in the cgroup `directory` until it is empty (a process may still be
    forking when the first signal lands). True when empty."""
    procs = os.path.join(directory, "cgroup.procs")
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = [int(p) for p in _read(procs).split()]
        except OSError:
            return True  # gone already
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _remove_dir(directory: str, timeout: float = 5.0) -> None:
    """rmdir a cgroup, waiting for dying members to leave it (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            kill_members(directory, 0.5)
            time.sleep(0.02)


@dataclasses.dataclass
class CgroupTree:
    """One executor's cgroups: `roots` holds its directory in each hierarchy (one for v2)."""

    kind: str
    roots: list[str]
    memory_root: str  # where memory.* files live (the v2 root or the v1 memory one)
    cpu_root: str | None  # where the CPU time is (the v2 root, a v1 cpuacct one, or none)

    @classmethod
    def create(cls, name: str, slots: list[str], budget: CallBudget) -> "CgroupTree | None":
        """Make the executor's cgroups with one child per slot, or None when the host offers none."""
        parent = _v2_parent()
        if parent is not None:
            root = os.path.join(parent, name)
            tree = cls(V2, [root], root, root)
        else:
            parents = _v1_parents()
            if parents is None:
                return None
            roots = list(dict.fromkeys(os.path.join(p, name) for p in parents.values()))  # co-mounted: once
            cpu = os.path.join(parents["cpuacct"], name) if "cpuacct" in parents else None
            tree = cls(V1, roots, os.path.join(parents["memory"], name), cpu)
        try:
            for root in tree.roots:
                _remove_stale_siblings(os.path.dirname(root))
                os.makedirs(root, exist_ok=True)
            if tree.kind == V2:
                _write(os.path.join(tree.roots[0], "cgroup.subtree_control"), "+memory +pids")
            for slot in slots:
                tree._make_slot(slot, budget)
        except OSError:
            tree.remove()
            return None
        return tree

    def _make_slot(self, slot: str, budget: CallBudget) -> None:
        for root in self.roots:
            directory = os.path.join(root, slot)
            os.makedirs(directory, exist_ok=True)
            files = set(os.listdir(directory))
            settings = [  # (file, value): the first found of each group is written
                ("memory.max", str(budget.memory_bytes)), ("memory.swap.max", "0"),
                ("memory.limit_in_bytes", str(budget.memory_bytes)),
                ("memory.memsw.limit_in_bytes", str(budget.memory_bytes)),
                ("pids.max", str(budget.pids)),
            ]
            for filename, value in settings:
                if filename in files:
                    _write(os.path.join(directory, filename), value)

    def slot_dirs(self, slot: str) -> list[str]:
        return [os.path.join(root, slot) for root in self.roots]

    def wire(self) -> dict:
        """What a worker needs, as plain data for the zygote's config."""
        return {"kind": self.kind, "roots": self.roots, "memory_root": self.memory_root, "cpu_root": self.cpu_root}

    def kill_all(self) -> None:
        for root in self.roots[:1]:  # every process of a call is in every hierarchy: one suffices
            kill_tree(root)

    def remove(self) -> None:
        self.kill_all()
        for root in self.roots:
            try:
                slots = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
            except OSError:
                slots = []
            for directory in slots:
                _remove_dir(directory)
            _remove_dir(root)


def kill_tree(root: str) -> None:
    """Kill every process in `root` and its child cgroups."""
    try:
        _write(os.path.join(root, "cgroup.kill"), "1")  # v2, Linux >= 5.14: the whole subtree at once
    except OSError:
        pass
    try:
        children = [e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for directory in children + [root]:
        kill_members(directory)


def _remove_stale_siblings(parent: str) -> None:
    """Remove the trees of executors whose process is gone (killed without closing)."""
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for entry in entries:
        try:
            pid = int(entry.name[len(_PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            kill_tree(entry.path)
            for sub in [e.path for e in os.scandir(entry.path) if e.is_dir(follow_symlinks=False)]:
                _remove_dir(sub, 1.0)
            _remove_dir(entry.path, 1.0)


def tree_name(sequence: int) -> str:
    return f"{_PREFIX}{os.getpid()}-{sequence}"


# --------------------------------------------------------------------------------------------
# worker side


def join(directories: list[str]) -> None:
    """Move the calling process into these cgroups (one per hierarchy)."""
    for directory in directories:
        _write(os.path.join(directory, "cgroup.procs"), "0")


# The largest charge one page fault makes: a PMD-sized folio (2 MiB with 4 KiB pages; a page
# table holds page_size / 8 entries). A charge that the limit refuses leaves the usage less
# than this below the limit.
_LARGEST_CHARGE = os.sysconf("SC_PAGE_SIZE") ** 2 // 8

_V1_PEAKS = (("memory.max_usage_in_bytes", "memory.limit_in_bytes"),
             ("memory.memsw.max_usage_in_bytes", "memory.memsw.limit_in_bytes"))


@dataclasses.dataclass(frozen=True)
class MemoryEvents:
    """Counters of one cgroup's memory, read at two moments to tell what happened in between.

    A process of the cgroup is also OOM-killed when a limit above it runs out (the trainer's
    container, the host): the kernel then picks a sandbox first (oom_score_adj 1000) and counts
    the kill on the sandbox's cgroup too. So a kill alone does not say that the call exceeded
    its own budget; a kill while its own limit ran out does."""

    oom_kills: int  # processes of this cgroup the kernel killed for memory, whichever limit ran out
    own_limit_hits: int  # times this cgroup's own limit ran out (see memory_events)

    def own_limit_killed_since(self, before: "MemoryEvents") -> bool:
        """Since `before`, did the kernel kill a process here while this cgroup's own limit ran out?"""
        return self.oom_kills > before.oom_kills and self.own_limit_hits > before.own_limit_hits


def _counters(path: str) -> dict[str, int]:
    """A flat keyed file ("key value" lines) as numbers; {} when unreadable."""
    out = {}
    try:
        for line in _read(path).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def _number(path: str) -> int | None:
    try:
        return int(_read(path))
    except (OSError, ValueError):
        return None  # e.g. memsw files where swap is not accounted


def peak_reached_limit(peak: int | None, limit: int | None) -> bool:
    """Did a usage peak come as close to a limit as only a refused charge leaves it?"""
    return peak is not None and limit is not None and peak > limit - _LARGEST_CHARGE


def memory_events(kind: str, memory_dir: str) -> MemoryEvents:
    """The OOM kills and own-limit hits of the cgroup `memory_dir` so far.

    v2: `oom_kill` and `oom` of memory.events; `oom` counts the OOMs whose limit was this
    cgroup's own (events propagate to ancestors only, and a slot has no children).
    v1: `oom_kill` of memory.oom_control. v1 counts no OOMs by limit, and its memory.failcnt
    counts nothing here (Linux 6.x keeps it for the memory counter only, while the memsw
    counter, which has the same limit, is charged first and refuses first); so a usage peak
    at the limit since `start_memory_window` stands in, as one hit."""
    if kind == V2:
        events = _counters(os.path.join(memory_dir, "memory.events"))
        return MemoryEvents(events.get("oom_kill", 0), events.get("oom", 0))
    hit = any(peak_reached_limit(_number(os.path.join(memory_dir, peak)), _number(os.path.join(memory_dir, limit)))
              for peak, limit in _V1_PEAKS)
    return MemoryEvents(_v1_oom_kills(memory_dir), int(hit))


def _v1_oom_kills(memory_dir: str) -> int:
    return _counters(os.path.join(memory_dir, "memory.oom_control")).get("oom_kill", 0)


def start_memory_window(kind: str, memory_dir: str) -> MemoryEvents:
    """The counters from which what happens next is judged (`own_limit_killed_since`). v1: its
    usage peaks start again from the current usage (the kernel's reset), so no hit yet. After
    every call: a few file operations (about 20 us each), which is why nothing else is read."""
    if kind == V2:
        return memory_events(kind, memory_dir)
    for peak, _ in _V1_PEAKS:
        try:
            _write(os.path.join(memory_dir, peak), "0")
        except OSError:
            pass
    return MemoryEvents(_v1_oom_kills(memory_dir), 0)


def cpu_seconds(kind: str, cpu_dir: str) -> float:
    """CPU time used by every process that ever ran in this cgroup."""
    try:
        if kind == V1:
            return int(_read(os.path.join(cpu_dir, "cpuacct.usage"))) / 1e9
        for line in _read(os.path.join(cpu_dir, "cpu.stat")).splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    return 0.0
