"""Kernel isolation: namespaces and mounts, for the zygote (once) and for each sandbox.

Zygote-wide, set up once before anything is forked (`setup_zygote`, then `confine_filesystem`
once the preloaded libraries are imported):
* a network namespace with only a down loopback: no TCP/UDP connection leaves it;
* an IPC namespace: whatever System V or POSIX IPC object exists dies with the executor (model
  code cannot create any: see seccomp.py);
* a mount namespace whose root is FRESH (`enter_fresh_root`, default-deny as nsjail and
  bubblewrap set it up): an empty tmpfs, pivot_root'ed to, that shows read-only only what the
  interpreter needs (the system's programs and shared libraries under /usr, the Python prefix
  and the import paths, the few rstarjax.env files the zygote imported), a private /tmp,
  /dev/shm and /proc, five device nodes, and the executor's own cgroup directories. Nothing
  else of the host is there: not /data, /mnt, /opt, /srv, /home, /root, nor the checkout, nor
  the rest of /tmp, wherever datasets, checkpoints or the checkout live. Where the kernel
  refuses it, the older view: every host mount read-only, /tmp covered (`confine_host_view`),
  reported as `fresh_root` False (RL then refuses to start, see `require_confined`).
* Without root, an unprivileged user namespace first (as bubblewrap does) gives the zygote the
  right to do all of the above (`enter_user_namespace`); sandboxes then drop every capability.

Per sandbox, by the flags it is cloned with (see forker.py) and `mount_call_filesystems`:
* a PID namespace (the sandbox is its PID 1: everything it starts dies with it) with its own
  /proc, which shows the call's processes and nothing of the host;
* a mount namespace with two fresh size-limited tmpfs: its own /tmp holding its working
  directory (also HOME and TMPDIR; in the fresh root, see `call_tmp_binds`; elsewhere the
  working directory alone) and /dev/shm. A call cannot fill another's space, and everything it
  wrote is gone with its last process: there is nothing to clean up.

Only the standard library is imported (the zygote loads this module).
"""
from __future__ import annotations

import ctypes
import os
import sys
import sysconfig

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x2000, 0x4000, 0x40000
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 0x400, 0x800, 0x200000, 0x1000000
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
# Left writable: kernel interfaces (writes need root or are per-process), device nodes.
KEEP_WRITABLE = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "devtmpfs", "devpts"})
CALL_INODES = 65536  # files + directories per call tmpfs

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_names = {name: ctypes.create_string_buffer(name.encode()) for name in ("rj-zygote", "rj-worker", "rj-forker", "rj-sandbox")}


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    """prctl(option, arg2, arg3, 0, 0); returns 0 or -1 (errno in ctypes.get_errno())."""
    return _prctl(option, arg2, arg3, 0, 0)


def set_process_name(name: str) -> None:
    """What `ps` and `top` show for this process: rj-zygote, rj-worker, rj-forker, rj-sandbox."""
    prctl(PR_SET_NAME, ctypes.addressof(_names[name]))


def libc_call(name: str, *args) -> int:
    """Call a libc function; returns 0 or the errno (never raises)."""
    rc = getattr(_libc, name)(*args)
    return 0 if rc == 0 else (ctypes.get_errno() or -1)


def mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None = None) -> int:
    return libc_call("mount", source, target.encode(), fstype, flags, data)


# --------------------------------------------------------------------------------------------
# zygote-wide


def setup_zygote(config: dict) -> dict:
    """Cut the network, privatise the mount namespace; report what the kernel allowed. The file
    system view itself is confined later (`confine_filesystem`), once the zygote's imports are
    done."""
    info = {"isolate": bool(config.get("isolate", True)), "root": os.geteuid() == 0, "userns": False,
            "netns": False, "ipcns": False, "mountns": False, "fresh_root": False, "private_tmp": False,
            "host_readonly": False}
    if not config.get("isolate", True):
        return info
    if not info["root"]:
        info["userns"] = enter_user_namespace()
    info["netns"] = libc_call("unshare", CLONE_NEWNET) == 0
    info["ipcns"] = libc_call("unshare", CLONE_NEWIPC) == 0
    if not ((info["root"] or info["userns"]) and libc_call("unshare", CLONE_NEWNS) == 0):
        return info
    # nothing we mount reaches the host
    info["mountns"] = mount(b"none", "/", None, MS_REC | MS_PRIVATE) == 0
    return info


def confine_filesystem(config: dict, info: dict) -> dict:
    """The zygote's file system view, for itself and every process it forks: the fresh root, or
    where the kernel refuses it, the host read-only with /tmp covered."""
    if not info.get("mountns"):
        return info
    try:
        info["exposed"] = enter_fresh_root(config)
        info["fresh_root"] = info["private_tmp"] = True
    except OSError as exc:
        info["fresh_root_refused"] = str(exc)
        info.update(confine_host_view(config))
    os.makedirs(config["workdir_root"], mode=0o755, exist_ok=True)  # each call mounts its own tmpfs here
    info["host_readonly"] = make_host_readonly(keep_writable=KEEP_WRITABLE_PATHS if info["fresh_root"] else
                                               (("/tmp",) if info["private_tmp"] else ()))
    return info


def confine_host_view(config: dict) -> dict:
    """The fallback view (no fresh root): /tmp and /var/tmp covered by empty root-owned tmpfs (a
    checkout or virtualenv below /tmp bound back so that it stays importable), the interpreter
    made readable where it lives in a closed home directory."""
    ok = True
    for path, size in (("/tmp", config["tmp_bytes"]), ("/var/tmp", 1 << 20)):
        if os.path.isdir(path):
            keep = open_children_holding(path, code_roots())
            mounted = mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=%d,mode=0755" % size) == 0
            ok &= mounted and bind_back(path, keep)
    return {"private_tmp": ok, "exposed": expose_python_tree()}


# --------------------------------------------------------------------------------------------
# the fresh root (default-deny)

# Programs and shared libraries (and the merged-/usr links to them): what `python` and the
# programs a call may start (subprocess, sh) load. Datasets do not live here.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # the dynamic loader's cache; time.localtime
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
# Writable in the fresh root (all else is read-only): the private /tmp (workers' per-call
# directories where calls cannot mount their own), /dev/shm, the device nodes.
KEEP_WRITABLE_PATHS = ("/tmp", "/dev/shm") + tuple(f"/dev/{n}" for n in DEV_NODES)
MNT_DETACH = 2
ROOT_BYTES = 8 << 20  # the root tmpfs: directories, device nodes, the copied files
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41}


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def checkout_root() -> str:
    """The directory holding the rstarjax package (an editable install's checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def imported_package_files() -> list[str]:
    """The rstarjax source files this process imported: all of the checkout a sandbox may see."""
    package = os.path.join(checkout_root(), "rstarjax")
    files = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "rstarjax" or name.startswith("rstarjax.")) and path:
            path = os.path.realpath(path)
            if _within(path, package) and os.path.isfile(path):
                files.add(path)
    return sorted(files)


def interpreter_dirs() -> list[str]:
    """Where the interpreter itself lives: its prefixes, its executable, its stdlib and
    site-packages."""
    paths = [sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    return paths + [sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]


def fresh_root_dirs(interpreter: list[str], import_dirs: list[str]) -> list[str]:
    """Host directories the fresh root shows read-only, outermost only: the system's programs and
    libraries, the `interpreter`'s directories and the import path (`import_dirs`), except an
    import directory that holds the checkout (an editable install or PYTHONPATH may point
    there, or above it: the checkout's data and checkpoints, and its neighbours, stay out; its
    imported files are copied in one by one)."""
    checkout = checkout_root()
    wanted = set()
    for path in list(SYSTEM_PATHS) + interpreter + import_dirs:
        if os.path.islink(path) and os.path.dirname(path) == "/":
            continue  # a merged-/usr link, recreated as a link
        if os.path.isdir(path):
            for target in {os.path.abspath(path), os.path.realpath(path)}:
                if path in interpreter or not _within(checkout, target):
                    wanted.add(target)
    outer = []
    for path in sorted(wanted):
        if not any(_within(path, kept) for kept in outer):
            outer.append(path)
    return outer


def _pivot_root(new_root: str, put_old: str) -> None:
    rc = ctypes.CDLL(None, use_errno=True).syscall(ctypes.c_long(PIVOT_ROOT_SYSCALL[os.uname().machine]),
                                                  new_root.encode(), put_old.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")


def _must(err: int, what: str) -> None:
    if err:
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bind(source: str, root: str, target: str, readonly: bool = True) -> None:
    """Bind host `source` at `target` inside the root being built; read-only at once, so that a
    later step can never create anything in a host directory."""
    inside = root + target
    if os.path.isdir(source):
        os.makedirs(inside, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
        os.close(os.open(inside, os.O_WRONLY | os.O_CREAT, 0o644))
    _must(mount(source.encode(), inside, None, MS_BIND | MS_REC), f"bind {source}")
    if readonly:
        _must(mount(None, inside, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV),
              f"read-only {source}")


def _copy(path: str, root: str) -> None:
    """A copy of host file `path` at the same path in the root being built (a few small files:
    copies keep the namespace's mount count, which every sandbox's clone and exit pay for, low)."""
    os.makedirs(os.path.dirname(root + path), mode=0o755, exist_ok=True)
    with open(path, "rb") as src, open(root + path, "wb") as dst:
        dst.write(src.read())
    os.chmod(root + path, 0o644)


def _device(node: str, root: str) -> None:
    """The device node `node` in the root being built: made anew where we may (root), else bound."""
    st = os.stat(node)
    try:
        os.mknod(root + node, 0o666 | (st.st_mode & 0o170000), st.st_rdev)
        os.chmod(root + node, 0o666)  # mknod applied our umask
    except PermissionError:  # a user namespace may not make devices
        _bind(node, root, node, readonly=False)


def enter_fresh_root(config: dict) -> list[str]:
    """Build the default-deny root on a tmpfs mounted over the executor's (empty, private)
    scratch directory, pivot_root into it and detach the host's root. Returns the host paths it
    shows. Raises OSError when the kernel refuses a step (nothing is pivoted then)."""
    root = os.path.realpath(config["workdir_root"])
    # not nodev: the device nodes live in it (made by root; nobody else can make one)
    _must(mount(b"tmpfs", root, b"tmpfs", MS_NOSUID, b"size=%d,mode=0755" % ROOT_BYTES), "tmpfs root")
    try:
        exposed = _populate_root(root, config)
        os.mkdir(root + "/.old", 0o700)
        _pivot_root(root, root + "/.old")
    except BaseException:
        libc_call("umount2", root.encode(), MNT_DETACH)
        raise
    os.chdir("/")
    _must(libc_call("umount2", b"/.old", MNT_DETACH), "detach the host root")
    os.rmdir("/.old")
    return exposed


def _populate_root(root: str, config: dict) -> list[str]:
    for name in ("tmp", "proc", "dev", "dev/shm"):
        os.makedirs(f"{root}/{name}", mode=0o755, exist_ok=True)
    _must(mount(b"tmpfs", root + "/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=%d,mode=0755" % config["tmp_bytes"]),
          "tmpfs /tmp")
    _must(mount(b"tmpfs", root + "/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV,
                b"size=%d,mode=1777" % config["tmp_bytes"]), "tmpfs /dev/shm")
    if mount(b"proc", root + "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC) != 0:
        _bind("/proc", root, "/proc", readonly=False)  # a user namespace may not mount a fresh one
    for node in DEV_NODES:
        if os.path.exists(f"/dev/{node}"):
            _device(f"/dev/{node}", root)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    cgroup = config.get("cgroup") or {}
    cgroup_dirs = set(cgroup.get("roots", [])) | {cgroup.get("memory_root"), cgroup.get("cpu_root")}
    for directory in sorted(cgroup_dirs - {None}):
        _bind(directory, root, directory, readonly=False)  # forkers join them, workers read them
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
    exposed = fresh_root_dirs(interpreter_dirs(), [p for p in sys.path if p])
    for directory in exposed:
        _bind(directory, root, directory)
    checkout = checkout_root()
    if any(_within(checkout, d) for d in exposed):  # a checkout inside the Python prefix (/usr/src/app)
        _must(mount(b"tmpfs", root + checkout, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"),
              "cover the checkout")
    files = imported_package_files() + [f for f in ETC_FILES if os.path.isfile(f)]
    for path in files:
        _copy(path, root)
    archives = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isfile(p)})  # zipped eggs
    archives = [a for a in archives if not any(_within(a, d) for d in exposed) and not _within(a, checkout)]
    for path in archives:
        _bind(path, root, path)
    return exposed + files + archives


def enter_user_namespace() -> bool:
    """Without root: become the owner of a new user namespace (and so able to make the mount,
    PID, network and IPC namespaces and the fresh root), mapping only our own uid and gid, as
    bubblewrap does. False where the kernel or its policy refuses unprivileged user namespaces."""
    uid, gid = os.getuid(), os.getgid()
    if libc_call("unshare", CLONE_NEWUSER) != 0:
        return False
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        return False
    return True


# the setting that accepts such a host, in the config's terms (the recipes write it as the flag)
UNCONFINED_SETTING = "env.allow_unconfined=True"


def confinement_gap(info: dict) -> str | None:
    """Why model code could read host files here (None: it cannot), from what the zygote found
    (CodeExecutor.isolation). Confined: the fresh root, and each call's /proc its own or shown
    to an unprivileged uid of its own (a call running as the trainer's uid could otherwise reach
    the host's root through /proc/<trainer>/root)."""
    if not info.get("fresh_root"):
        why = info.get("fresh_root_refused") or ("isolate=False" if not info.get("isolate", True) else
                                                  "no mount namespace: neither root nor an unprivileged user "
                                                  "namespace is allowed here")
        return f"no private file system view ({why})"
    if not (info.get("uid_drop") or (info.get("pidns") and info.get("call_mounts"))):
        return "calls run as the trainer's user without a /proc of their own"
    return None


def require_confined(info: dict, allow_unconfined: bool) -> None:
    """Refuse (RuntimeError, one line naming the setting) a code pool whose sandboxes could read the
    host's files, datasets and gold answers included, unless the user allowed it."""
    gap = confinement_gap(info)
    if gap is not None and not allow_unconfined:
        raise RuntimeError(f"the code sandbox cannot hide this host's files from model code ({gap}), so a policy "
                           f"could read the data's answers; fix the host (root, or unprivileged user namespaces: "
                           f"docs/code_env.md) or accept it with {UNCONFINED_SETTING}")


def _mountinfo() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, per-mount options) of every mount, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields = left.split()
            point = fields[4].encode().decode("unicode_escape") if "\\" in fields[4] else fields[4]
            out.append((point, right.split()[0], set(fields[5].split(","))))
    return out


def make_host_readonly(keep_writable: tuple[str, ...] = ()) -> bool:
    """Bind-remount every mount of our namespace read-only (keeping its other flags), except
    kernel interfaces, device nodes and `keep_writable` (our own root-owned /tmp, where the
    workers make per-call directories when calls cannot have their own mounts). True when
    every one of them is read-only now."""
    ok = True
    for point, fstype, options in _mountinfo():
        if fstype in KEEP_WRITABLE or "ro" in options or point in keep_writable:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for name in options:
            flags |= _MOUNT_FLAGS.get(name, 0)
        ok &= mount(None, point, None, flags) == 0
    return ok


def python_tree() -> list[str]:
    """Directories an unprivileged sandbox must be able to read to import and to run python."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        paths.add(sysconfig.get_paths()[key])
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    return sorted(os.path.realpath(p) for p in paths)


def code_roots() -> list[str]:
    """Where the code the sandboxes run lives (the fallback view): the Python tree and
    rstarjax's own checkout (an editable install is not on sys.path; its import hook points
    into the checkout)."""
    return python_tree() + [checkout_root()]


def open_children_holding(mount_point: str, paths: list[str]) -> dict[str, int]:
    """O_PATH handles to the direct children of `mount_point` that contain any of `paths`,
    taken before a tmpfs covers `mount_point` (afterwards they are unreachable by name)."""
    prefix = os.path.realpath(mount_point).rstrip("/") + "/"
    children = {p[len(prefix):].split("/")[0] for p in paths if p.startswith(prefix)}
    return {c: os.open(prefix + c, os.O_PATH) for c in children if os.path.isdir(prefix + c)}


def bind_back(mount_point: str, handles: dict[str, int]) -> bool:
    """Bind-mount each held child back into the fresh tmpfs at `mount_point`."""
    ok = True
    for child, fd in handles.items():
        try:
            target = os.path.join(mount_point, child)
            os.mkdir(target, 0o755)
            ok &= mount(f"/proc/self/fd/{fd}".encode(), target, None, MS_BIND | MS_REC) == 0
        finally:
            os.close(fd)
    return ok


def first_closed_ancestor(path: str) -> str | None:
    """The outermost ancestor of `path` that others cannot traverse (mode lacks o+x)."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return None
    return None


def expose_python_tree() -> list[str]:
    """In our private mount namespace, make the interpreter readable to the sandbox uid.

    Python often lives under a 0700 home (/root/.pyenv). We never change host permissions:
    instead a 0755 tmpfs covers the closed directory (hiding the rest of it, e.g. /root/.ssh,
    from sandboxes) and only the needed child directories are bind-mounted back into it.
    """
    plan: dict[str, set[str]] = {}
    for path in python_tree():
        closed = first_closed_ancestor(path)
        if closed is None or closed == path:
            continue
        child = path[len(closed) + 1 :].split("/")[0]
        plan.setdefault(closed, set()).add(child)
    exposed = []
    for closed, children in plan.items():
        handles = {c: os.open(os.path.join(closed, c), os.O_PATH) for c in children}
        if mount(b"tmpfs", closed, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755") != 0:
            for fd in handles.values():
                os.close(fd)
            continue
        if bind_back(closed, handles):
            exposed.extend(os.path.join(closed, c) for c in children)
    return exposed


def probe_unprivileged_imports(uid: int) -> bool:
    """Can `uid` read the standard library? (If not, dropping to it would break every import.)"""
    stdlib = sysconfig.get_paths()["stdlib"]
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.listdir(stdlib)
            with open(os.path.join(stdlib, "statistics.py"), "rb"):
                pass
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# --------------------------------------------------------------------------------------------
# per sandbox (in the child, as root, before the uid drop)


def mount_call_filesystems(workdir: str, uid: int | None, disk_bytes: int, own_proc: bool,
                           tmp_binds: tuple[str, ...] | None = None) -> None:
    """In the sandbox's own mount namespace: /proc of its PID namespace, and fresh tmpfs for its
    working directory (owned by its uid) and /dev/shm. With ``tmp_binds`` (``call_tmp_binds``:
    the fresh root's /tmp holds the working directory's mount point and those entries only), the
    working directory's tmpfs becomes the call's own writable /tmp, the working directory a folder
    in it and those entries bound back read-only, so that code writing ``/tmp/x`` works as on
    any machine, within the same size limit, and leaves nothing for the next call. Raises
    OSError when the kernel refuses."""
    owner = b"" if uid is None else b",uid=%d,gid=%d" % (uid, uid)
    size = b"size=%d,nr_inodes=%d" % (disk_bytes, CALL_INODES)
    if tmp_binds is None:
        _must(mount(b"tmpfs", workdir, b"tmpfs", MS_NOSUID | MS_NODEV, size + b",mode=0700" + owner),
              f"mount tmpfs on {workdir}")
    else:
        _own_tmp(workdir, uid, size, tmp_binds)
    _must(mount(b"tmpfs", "/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, size + b",mode=1777"),
          "mount tmpfs on /dev/shm")
    if own_proc:
        _must(mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC), "mount proc on /proc")


def _own_tmp(workdir: str, uid: int | None, size: bytes, tmp_binds: tuple[str, ...]) -> None:
    """A tmpfs built at the working directory's mount point (a sticky, world-writable /tmp with
    the working directory in it at its path below /tmp, or by its name where it lies elsewhere,
    and ``tmp_binds`` bound back), then moved over /tmp; a working directory outside /tmp is that
    folder bound back at its own path (one size limit for both)."""
    _must(mount(b"tmpfs", workdir, b"tmpfs", MS_NOSUID | MS_NODEV, size + b",mode=1777"),
          f"mount tmpfs on {workdir}")
    def staged(path: str) -> str:  # where a path of the call's /tmp is while the tmpfs is built
        return workdir + path[len("/tmp"):]

    inner = _inner_path(workdir)
    os.makedirs(staged(os.path.dirname(inner)), mode=0o755, exist_ok=True)
    os.mkdir(staged(inner), 0o700)
    if uid is not None:
        os.chown(staged(inner), uid, uid)
    for top in tmp_binds:
        _bind(top, workdir, top[len("/tmp"):])
    _must(mount(workdir.encode(), "/tmp", None, MS_MOVE), "move the call's tmpfs to /tmp")
    if inner != os.path.normpath(workdir):
        _must(mount(inner.encode(), workdir, None, MS_BIND), f"bind {inner} at {workdir}")


def _inner_path(workdir: str) -> str:
    """Where the working directory lies in a call's own /tmp: its own path below /tmp, or
    /tmp/<its name> where it lies elsewhere (``TMPDIR=/scratch``)."""
    workdir = os.path.normpath(workdir)
    return workdir if _within(workdir, "/tmp") and workdir != "/tmp" else "/tmp/" + os.path.basename(workdir)


def call_tmp_binds(info: dict, workdir: str) -> tuple[str, ...] | None:
    """What a call's own /tmp must show again of the fresh root's /tmp (``mount_call_filesystems``):
    the top-level entries below /tmp of what the fresh root exposes (a virtualenv, a checkout's
    imported files, where they live below /tmp); None where calls keep the zygote's /tmp (no
    fresh root or no mount namespace per call, an exposed path that is /tmp itself, or one whose
    top-level entry holds the working directory or lies in it)."""
    if not (info.get("fresh_root") and info.get("call_mounts")):
        return None
    workdir = os.path.normpath(workdir)
    inner = _inner_path(workdir)
    tops = set()
    for path in info.get("exposed", []):
        path = os.path.normpath(path)
        if _within(path, "/tmp"):
            if path == "/tmp":
                return None
            top = "/tmp/" + os.path.relpath(path, "/tmp").split("/")[0]
            if _within(inner, top) or _within(top, inner) or _within(path, workdir):
                return None
            tops.add(top)
    return tuple(sorted(tops))
