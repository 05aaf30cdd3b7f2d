"""How data crosses process boundaries in the code environment.

* trainer <-> worker: a stream socket of frames, each a 4-byte big-endian length + UTF-8 JSON.
* worker -> sandbox: the call itself never passes through the process a sandbox is forked from.
  It travels as two memfds (the call as JSON, its stdin) over the sandbox's own channel socket,
  and the sandbox reads them after the fork (`send_call` / `receive_call`).
* sandbox -> worker: one JSON line on fd 3 (see sandbox.py).

Nothing is ever unpickled: sandboxes are hostile and the workers run as root. Only the
standard library is imported: the zygote loads this module too.
"""
from __future__ import annotations

import json
import os
import socket
import struct

HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20  # a worker refuses (and dies of) a longer frame: the trainer never sends one
# One call as sent (its JSON: code and stdin escaped) may take at most this much of a frame; a
# longer one is the model's error, answered at submit (CodeExecutor), and a batch of calls is
# cut to fit a frame (JobQueue.get_batch's max_bytes).
MAX_CALL_BYTES = MAX_FRAME // 4
BATCH_BYTES = MAX_FRAME - (1 << 20)  # the batch's own JSON around its calls fits in the rest


def json_bytes(obj) -> int:
    """Bytes of ``obj`` as a frame carries it (what ``MAX_CALL_BYTES`` bounds)."""
    return len(json.dumps(obj).encode())


def encode_frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, obj) -> None:
    sock.sendall(encode_frame(obj))


class FrameReader:
    """Incremental decoder: feed it what a socket returned, get the complete frames."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(self.buf) < HEADER.size + n:
                break
            out.append(json.loads(bytes(self.buf[HEADER.size : HEADER.size + n])))
            del self.buf[: HEADER.size + n]
        return out


def memfd_holding(name: str, data: bytes) -> int:
    """`data` in a rewound memfd: any size, no pipe to fill (the reader takes it at leisure)."""
    fd = os.memfd_create(name, 0)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


def send_call(channel: socket.socket, call: dict) -> None:
    """Hand `call` to a sandbox over its channel: the call without its stdin as one memfd, the
    stdin as another. The sandbox may not read them for a while (a warm one is busy elsewhere
    until it asks): the socket buffer holds two fds, never the data."""
    stdin = (call.get("stdin") or "").encode("utf-8", errors="replace")
    fds = []
    try:
        fds.append(memfd_holding("call", json.dumps({k: v for k, v in call.items() if k != "stdin"}).encode()))
        fds.append(memfd_holding("stdin", stdin))
        socket.send_fds(channel, [b"c"], fds)
    finally:
        for fd in fds:
            os.close(fd)


def receive_call(channel_fd: int) -> tuple[dict, int] | None:
    """Block until the worker hands over a call: (call, stdin fd), or None when it closed the
    channel instead (the worker is going away)."""
    sock = socket.socket(fileno=channel_fd)
    try:
        _, fds, _, _ = socket.recv_fds(sock, 16, 2)
    finally:
        sock.detach()  # the fd stays open: the caller closes it
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return None
    call_fd, stdin_fd = fds
    try:
        with os.fdopen(call_fd, "rb") as f:
            call = json.loads(f.read())
    except BaseException:
        os.close(stdin_fd)
        raise
    return call, stdin_fd
