"""The coordination service's key-value store as a transport (``rl.mailbox``), measured on CPU at
scaled volumes of the paper's step, against a plain localhost socket carrying the same bytes.

With rollouts in processes apart from the trainer (``rl.remote``) and RoC on the training side,
every rollout of a step reaches a training process as a ``Mailbox`` message through the
coordination service that ``jax.distributed`` starts (hosted by process 0). At the paper's step
(rStar2-Agent, arXiv 2508.20722, §4: 512 prompts x 2G = 32 rollouts, responses up to 12K
tokens) that is 16,384 rollouts x 12,288 tokens x (int32 token id + float32 log-prob) = 1.61 GB.
This script measures how fast that store moves such messages (two ``jax.distributed`` processes
on this machine: process 1 sends, as a rollout process does, process 0 receives and hosts the
service, as the trainer does), at several volumes (``--rollouts``, each of ``--tokens`` tokens),
so that the time is seen to grow linearly with the volume and can be projected to 1.61 GB.

Arms, alternating (``mailbox`` first in even runs, ``socket`` first in odd ones), the same work:
pickle the payload, move it, unpickle it on the other side.

* ``mailbox``: ``rl.mailbox.Mailbox.send`` / ``receive`` (chunks of ``CHUNK_BYTES`` through the
  store, read and deleted);
* ``socket``: the same pickled bytes over one localhost TCP connection (the strongest plain
  transport between two processes of one machine; a baseline, not a transport the project has).

Each trial is timed from before the sender pickles to after the receiver unpickled
(``time.monotonic``: one clock for every process of the machine). Prints one JSON line: per
volume and arm the median seconds, its spread (max - min) and the throughput, the least-squares
line of seconds against bytes (slope, intercept, r^2) per arm, and the paper's step projected
from the mailbox's line. ``--out`` also writes it, with the command, commit, machine and date.

    python benchmarks/mailbox.py --rollouts 128,512,2048 --runs 3 --out benchmarks/results/...
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 12_288  # the paper's longest response (12K)
PAPER_ROLLOUTS = 512 * 32  # a step's prompts x 2G
BYTES_PER_TOKEN = 8  # int32 token id + float32 log-prob
ARMS = ("mailbox", "socket")


def paper_bytes(tokens: int = TOKENS) -> int:
    """The token ids and log-probs of every rollout of one paper step."""
    return PAPER_ROLLOUTS * tokens * BYTES_PER_TOKEN


def payload(rollouts: int, tokens: int):
    """``rollouts`` rollouts of ``tokens`` tokens: each its token ids and log-probs (what a
    trajectory carries per token; the rest of a trajectory is small beside it)."""
    import numpy as np

    rng = np.random.default_rng(rollouts)
    ids = rng.integers(0, 151_936, size=(rollouts, tokens), dtype=np.int32)
    logprobs = -rng.random((rollouts, tokens), dtype=np.float32)
    return [(ids[i], logprobs[i]) for i in range(rollouts)]


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least-squares ``y = slope * x + intercept`` and its r^2."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope_s_per_gb": slope * 1e9, "intercept_s": intercept,
            "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0, "points": n}


def summarize(trials: list[dict], tokens: int) -> dict:
    """Per volume and arm: median seconds, spread, GB/s; per arm: the line through every trial;
    the paper's step projected from the mailbox's line."""
    volumes = {}
    for t in trials:
        volumes.setdefault(t["rollouts"], {}).setdefault(t["arm"], []).append(t)
    per_volume = []
    for rollouts in sorted(volumes):
        row = {"rollouts": rollouts, "bytes": volumes[rollouts][ARMS[0]][0]["bytes"]}
        for arm, ts in sorted(volumes[rollouts].items()):
            secs = [t["seconds"] for t in ts]
            row[arm] = {"median_s": statistics.median(secs), "spread_s": max(secs) - min(secs),
                        "gb_per_s": row["bytes"] / statistics.median(secs) / 1e9, "runs": len(secs)}
        per_volume.append(row)
    lines = {arm: fit_line([t["bytes"] for t in trials if t["arm"] == arm],
                           [t["seconds"] for t in trials if t["arm"] == arm]) for arm in ARMS
             if any(t["arm"] == arm for t in trials)}
    paper = paper_bytes()
    mailbox = lines["mailbox"]
    projected = mailbox["slope_s_per_gb"] * paper / 1e9 + mailbox["intercept_s"]
    return {"tokens_per_rollout": tokens, "volumes": per_volume, "lines": lines,
            "paper_step_bytes": paper,
            "paper_step_projected_s": {"mailbox": projected,
                                       **({"socket": lines["socket"]["slope_s_per_gb"] * paper / 1e9
                                           + lines["socket"]["intercept_s"]} if "socket" in lines else {})},
            "largest_measured_fraction_of_paper_step": per_volume[-1]["bytes"] / paper}


# ---- the two worker processes ----------------------------------------------------------

def _socket_pair(client, pid: int):
    """A TCP connection between the two processes (process 0 listens, publishing its port)."""
    if pid == 0:
        server = socket.create_server(("localhost", 0))
        client.key_value_set("bench/socket_port", str(server.getsockname()[1]))
        conn, _ = server.accept()
        server.close()
    else:
        port = int(client.blocking_key_value_get("bench/socket_port", 120_000))
        conn = socket.create_connection(("localhost", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _recv_exactly(conn, n: int) -> bytes:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the sender closed the socket mid-message")
        got += k
    return bytes(buf)


def worker(pid: int, port: int, rollout_counts: list[int], tokens: int, runs: int, wait_s: float) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    from rstarjax.rl.mailbox import Mailbox, service_client

    client = service_client()
    data_box, ready_box = Mailbox("bench/data"), Mailbox("bench/ready")  # 1 -> 0, 0 -> 1
    conn = _socket_pair(client, pid)
    try:
        for rollouts in rollout_counts:
            body = payload(rollouts, tokens) if pid == 1 else None
            nbytes = rollouts * tokens * BYTES_PER_TOKEN
            for run in range(runs):
                for arm in (ARMS if run % 2 == 0 else ARMS[::-1]):
                    if pid == 0:  # the receiver (the trainer's side, hosting the service)
                        ready_box.send("ready")
                        if arm == "mailbox":
                            kind, (t0, got) = data_box.receive(wait_s, "the benchmark's message")
                        else:
                            size = int.from_bytes(_recv_exactly(conn, 8), "little")
                            t0, got = pickle.loads(_recv_exactly(conn, size))
                        t1 = time.monotonic()
                        assert len(got) == rollouts and got[-1][0].shape == (tokens,)
                        print(json.dumps({"arm": arm, "rollouts": rollouts, "bytes": nbytes, "run": run,
                                          "seconds": t1 - t0}), flush=True)
                        del got
                    else:  # the sender (a rollout process's side)
                        ready_box.receive(wait_s, "the receiver to be ready")
                        t0 = time.monotonic()
                        if arm == "mailbox":
                            data_box.send("round", (t0, body))
                        else:
                            data = pickle.dumps((t0, body), protocol=pickle.HIGHEST_PROTOCOL)
                            conn.sendall(len(data).to_bytes(8, "little"))
                            conn.sendall(data)
                            del data
            del body
    finally:
        conn.close()


def run_workers(rollout_counts: list[int], tokens: int, runs: int, wait_s: float) -> list[dict]:
    """The two worker processes; the receiver's trial lines (killed after ``wait_s``)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # one CPU device each
    argv = [",".join(map(str, rollout_counts)), str(tokens), str(runs), str(wait_s)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(pid), str(port), *argv],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=wait_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a benchmark worker failed (exit {p.returncode}):\n{err[-3000:]}")
    return [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollouts", default="128,512,2048",
                    help="comma-separated rollouts per message (the paper's step: 16384)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="tokens per rollout")
    ap.add_argument("--runs", type=int, default=3, help="trials per volume and arm")
    ap.add_argument("--wait-s", type=float, default=1800.0, help="the longest the whole benchmark may run")
    ap.add_argument("--out", default="", help="also write the result, with command, commit, machine, date, here")
    ap.add_argument("--machine", default="", help="what the machine is, for --out")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        pid, port, counts, tokens, runs, wait_s = args.worker
        worker(int(pid), int(port), [int(c) for c in counts.split(",")], int(tokens), int(runs), float(wait_s))
        return
    counts = sorted(int(c) for c in args.rollouts.split(","))
    if not counts or min(counts) < 1 or args.tokens < 1 or args.runs < 1:
        print("mailbox.py: --rollouts, --tokens and --runs must be positive", file=sys.stderr)
        sys.exit(2)
    trials = run_workers(counts, args.tokens, args.runs, args.wait_s)
    result = {"benchmark": "mailbox", **summarize(trials, args.tokens), "trials": trials}
    print(json.dumps(result), flush=True)
    if args.out:
        import jax

        record = {"command": shlex.join(["python", "benchmarks/mailbox.py", *(argv if argv is not None else sys.argv[1:])]),
                  "commit": _commit(), "date": datetime.date.today().isoformat(),
                  "machine": args.machine or f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
                  "versions": f"jax {jax.__version__}, python {platform.python_version()}", "result": result}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
