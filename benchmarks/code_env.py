"""Code-environment throughput and latency, next to the one-interpreter-per-call baseline.

Prints ONE JSON line. For trivial and sympy-using code, at 1, 64 and 1,000 concurrent
submissions: calls/s, end-to-end latency p50/p99, and the dispatch overhead p50/p99 (end-to-end
minus the wait for a free sandbox slot minus the time in the sandbox from `start`, i.e. from its
fork for a cold start or the hand-over for a warm one, teardown included: what the
queue/threads/sockets themselves add), with its two parts, the way to the worker (transport) and
the way back (return path). docs/code_env.md says exactly which stamps count. The baseline
runs `python -c CODE` per call (what the official rStar2-Agent environment does) with at most
`2 * cpu_count` interpreters at once, on fewer calls (it is slow), in the same process and run.

    python benchmarks/code_env.py [--workers N] [--slots S] [--quick] [--pool-only]
    python benchmarks/code_env.py --ab OTHER_CHECKOUT [--repeats 3] [--rounds 3]

`startup_s` is the pool's start (zygotes preloaded, isolation set up, workers forked) until it
answers its first call. `--pool-only` skips the baseline. `--ab` compares this checkout's pool
with another checkout's (e.g. `git worktree add /tmp/before HEAD~1`): both pools run at once in
two child processes, idle in turn, and every measurement (calls/s, p50 at each concurrency) is
taken from one then the other, `--rounds` times per start, over `--repeats` starts (whose
startup times alternate too). On a shared machine whose load drifts by the minute, only such
interleaving compares like with like.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--arm" in sys.argv:  # an A/B arm: the pool of the checkout named after --arm
    ROOT = os.path.abspath(sys.argv[sys.argv.index("--arm") + 1])
sys.path.insert(0, ROOT)

from rstarjax.env import CodeExecutor  # noqa: E402

CODES = {
    "trivial": "print(1)",
    "sympy": "import sympy\nx = sympy.Symbol('x')\nprint(sympy.expand((x + 1) ** 5))",
}


def pct(values, q) -> float:
    return round(float(np.percentile(np.asarray(values) * 1e3, q)), 2) if len(values) else float("nan")


def bench_pool(ex: CodeExecutor, code: str, concurrency: int, sequential_calls: int = 40) -> dict:
    expected = ex.run(code).text
    t0 = time.perf_counter()
    if concurrency == 1:
        results = [ex.run(code) for _ in range(sequential_calls)]
    else:
        futs = [ex.submit(code) for _ in range(concurrency)]
        results = [f.result(timeout=600) for f in futs]
    wall = time.perf_counter() - t0
    bad = sum(r.text != expected for r in results)
    lat, overhead, queued, returned, transport = [], [], [], [], []
    untimed = [r for r in results if r.timings is None]  # answered by the pool itself (infra)
    if untimed:
        print(f"warning: {len(untimed)} calls answered without running: {untimed[0].text!r}",
              file=sys.stderr)
    for r in results:
        t = r.timings
        if t is None:
            continue
        lat.append(t["resolved"] - t["submit"])
        # waiting for a free sandbox slot: in the central queue, then in the worker's own list
        queued.append((t["dequeue"] - t["submit"]) + (t["start"] - t["worker_recv"]))
        # what the machinery adds: batch transport to the worker (incl. waiting for the worker's
        # event loop, busy forking other calls) + the way back (worker reply -> future resolved)
        overhead.append((t["worker_recv"] - t["dequeue"]) + (t["resolved"] - t["end"]))
        transport.append(t["worker_recv"] - t["dequeue"])
        returned.append(t["resolved"] - t["end"])
    return {
        "calls": len(results),
        "infra_answers": len(untimed),
        "calls_per_s": round(len(results) / wall, 1),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "queue_wait_p99_ms": pct(queued, 99),
        "overhead_p50_ms": pct(overhead, 50),
        "overhead_p99_ms": pct(overhead, 99),
        "transport_p99_ms": pct(transport, 99),
        "return_path_p99_ms": pct(returned, 99),
        "sandbox_p50_ms": pct([r.timings["end"] - r.timings["start"] for r in results if r.timings], 50),
        "wrong": bad,
    }


def run_baseline_once(code: str) -> float:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return time.perf_counter() - t


def bench_baseline(code: str, calls: int, parallel: int) -> dict:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        lat = list(pool.map(lambda _: run_baseline_once(code), range(calls)))
    wall = time.perf_counter() - t0
    return {"calls": calls, "parallel": parallel, "calls_per_s": round(calls / wall, 2),
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}


def serve_arm(args) -> None:
    """One A/B arm: start the pool, say how long that took, then run what the parent asks for
    (one JSON request per line: {"code": name, "c": concurrency}), one JSON answer per line."""
    t0 = time.perf_counter()
    with CodeExecutor(num_workers=args.workers, slots_per_worker=args.slots) as ex:
        ex.run("print(0)")
        ready = {"startup_s": round(time.perf_counter() - t0, 3), "root": ROOT,
                 "isolation": {k: v for k, v in ex.isolation.items() if isinstance(v, bool)}}
        ex.run_batch(["print(0)"] * 16 + [CODES["sympy"]] * 16)  # warm up
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            print(json.dumps(bench_pool(ex, CODES[request["code"]], int(request["c"]))), flush=True)


def run_ab(args, levels) -> dict:
    """This checkout ("this") against args.ab ("other"), interleaved (see the module docstring)."""
    script = os.path.abspath(__file__)
    arms = {"this": ROOT, "other": os.path.abspath(args.ab)}
    out = {"bench": "code_env_ab", "arms": arms, "cpus": len(os.sched_getaffinity(0)), "workers": args.workers,
           "slots_per_worker": args.slots, "load_avg_1m": [round(os.getloadavg()[0], 2)]}
    samples: dict[str, dict[str, list]] = {arm: {} for arm in arms}
    for repeat in range(args.repeats):
        order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
        procs = {}
        for arm in order:  # started one after the other: each start has the machine to itself
            procs[arm] = subprocess.Popen(
                [sys.executable, script, "--arm", arms[arm], "--workers", str(args.workers), "--slots", str(args.slots)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = json.loads(procs[arm].stdout.readline())
            samples[arm].setdefault("startup_s", []).append(ready["startup_s"])
            out.setdefault("isolation", {})[arm] = ready["isolation"]
        for name in CODES:
            for c in levels:
                for _ in range(args.rounds):
                    for arm in order:
                        procs[arm].stdin.write(json.dumps({"code": name, "c": c}) + "\n")
                        procs[arm].stdin.flush()
                        r = json.loads(procs[arm].stdout.readline())
                        for key in ("calls_per_s", "p50_ms"):
                            samples[arm].setdefault(f"{name}_c{c}_{key}", []).append(r[key])
                        samples[arm].setdefault("wrong", []).append(r["wrong"] + r["infra_answers"])
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=120)
        out["load_avg_1m"].append(round(os.getloadavg()[0], 2))
    for arm, metrics in samples.items():
        out[arm] = {k: {"median": float(np.median(v)), "min": min(v), "max": max(v), "n": len(v)} if k != "wrong"
                    else sum(v) for k, v in metrics.items()}
    out["raw"] = samples
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="fewer calls (smoke run)")
    parser.add_argument("--pool-only", action="store_true", help="no baseline")
    parser.add_argument("--ab", help="another checkout: interleave its pool's figures with this one's")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # internal: serve one A/B arm
    parser.add_argument("--repeats", type=int, default=3, help="--ab: pool starts per arm")
    parser.add_argument("--rounds", type=int, default=3, help="--ab: measurements per level and start")
    args = parser.parse_args()
    levels = (1, 64, 200) if args.quick else (1, 64, 1000)
    if args.arm:
        serve_arm(args)
        return
    if args.ab:
        print(json.dumps(run_ab(args, levels)))
        return
    cpus = len(os.sched_getaffinity(0))
    out = {"bench": "code_env", "cpus": cpus, "workers": args.workers, "slots_per_worker": args.slots,
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    t0 = time.perf_counter()
    with CodeExecutor(num_workers=args.workers, slots_per_worker=args.slots) as ex:
        ex.run("print(0)")
        out["startup_s"] = round(time.perf_counter() - t0, 3)
        out["isolation"] = {k: v for k, v in ex.isolation.items() if isinstance(v, bool) or k == "call_budget"}
        out["huge_page_mb"] = round(ex.isolation.get("huge_page_bytes", 0) / 2**20)  # heavy zygote
        ex.run_batch(["print(0)"] * 16 + [CODES["sympy"]] * 16)  # warm up
        for name, code in CODES.items():
            for c in levels:
                out[f"pool_{name}_c{c}"] = bench_pool(ex, code, c)
    if args.pool_only:
        print(json.dumps(out))
        return
    parallel = 2 * cpus
    for name, code in CODES.items():
        n = 8 if args.quick else (48 if name == "trivial" else 16)
        out[f"baseline_{name}"] = bench_baseline(code, n, parallel)
        out[f"baseline_{name}_sequential"] = bench_baseline(code, 4 if args.quick else 8, 1)
    for name in CODES:
        best_pool = max(out[f"pool_{name}_c{c}"]["calls_per_s"] for c in levels[1:])
        out[f"speedup_{name}_throughput"] = round(best_pool / out[f"baseline_{name}"]["calls_per_s"], 1)
        out[f"speedup_{name}_latency_c1"] = round(
            out[f"baseline_{name}_sequential"]["p50_ms"] / out[f"pool_{name}_c1"]["p50_ms"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
