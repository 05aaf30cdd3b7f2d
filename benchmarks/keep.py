"""Run a benchmark R times and keep its raw JSON with its provenance (docs/figures.md).

    python benchmarks/keep.py NAME [--runs 3] [--machine TEXT] [--note TEXT] -- CMD [ARG ...]

Each run's last stdout line must be one JSON object (every ``benchmarks/*.py`` prints one).
The file written, ``benchmarks/results/cpu-DATE-COMMIT-NAME.json``, has what
``tests/test_figures.py`` asks of a kept figure (``command``, ``commit``, ``machine``, ``date``),
the installed versions, every run's line under ``runs``, and under ``result`` the median of each
number over the runs (the same shape as a line) with its ``[min, max]`` under ``spread``: a
published figure is the median of >= 3 runs with its spread. A text or flag that differs between
runs is kept as the list of its values. The file is rewritten after every run, so an interrupted
series keeps the runs it finished (``runs_finished`` < ``runs_asked``).

The commit is HEAD's; a working tree with uncommitted changes to code is refused (the figure
would name a commit that did not make it) unless ``--allow-dirty``, which records the diff's
files. The machine text defaults to the CPU model, cores, memory and the load average before
and after: say more with ``--machine`` (what else was running).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rstarjax.io.files import write_json_atomic  # noqa: E402

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers")
CODE_DIRS = ("rstarjax", "benchmarks", "configs", "setup.py")
NOT_CODE = (":!benchmarks/results", ":!benchmarks/profiles")  # where figures are kept, not made


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True).stdout.rstrip()


def uncommitted_code() -> list[str]:
    """Paths under the code directories whose working-tree contents differ from HEAD's."""
    out = git("status", "--porcelain", "--", *CODE_DIRS, *NOT_CODE)
    return [line[3:] for line in out.splitlines() if line.strip()]


def versions() -> str:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def memory_gb() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return float("nan")


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def last_json_line(stdout: str) -> dict:
    """The run's result: its last non-empty stdout line, which must be a JSON object."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the command printed nothing on stdout (a benchmark prints one JSON line)")
    try:
        doc = json.loads(lines[-1])
    except ValueError as e:
        raise ValueError(f"its last stdout line is not JSON ({e}): {lines[-1][:200]!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"its last stdout line is JSON but not an object: {lines[-1][:200]!r}")
    return doc


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def summarise(values: list):
    """(median, spread) of one leaf across runs: numbers give their median and [min, max];
    dicts and equal-length lists are summarised per key/item; anything else is its one value
    when every run agrees, else the list of the runs' values (spread None)."""
    if all(isinstance(v, dict) for v in values):
        keys = [k for k in values[0] if all(k in v for v in values)]
        keys += sorted({k for v in values for k in v} - set(keys), key=str)
        median, spread = {}, {}
        for k in keys:
            median[k], spread[k] = summarise([v.get(k) for v in values])
        return median, spread
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        pairs = [summarise([v[i] for v in values]) for i in range(len(values[0]))]
        return [m for m, _ in pairs], [s for _, s in pairs]
    if all(is_number(v) for v in values):
        finite = [float(v) for v in values if v == v]  # NaN (a figure not measured) left out
        if not finite:
            return values[0], None
        return statistics.median(finite), [min(finite), max(finite)]
    if all(v == values[0] for v in values):
        return values[0], None
    return values, None


def result_path(out_dir: str, date: str, commit: str, name: str) -> str:
    return os.path.join(out_dir, f"cpu-{date}-{commit}-{name}.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(usage="keep.py NAME [options] -- CMD [ARG ...]",
                                description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="what the file is named after (e.g. code_env)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--machine", default="", help="said before the measured CPU/memory/load")
    p.add_argument("--note", action="append", default=[], help="kept under notes (repeatable)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="one run's limit")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--allow-dirty", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        p.error("give the benchmark's command after --")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    dirty = uncommitted_code()
    if dirty and not args.allow_dirty:
        print(f"keep.py: uncommitted changes to {', '.join(dirty[:5])}: commit first (the figure "
              "names HEAD's commit) or pass --allow-dirty", file=sys.stderr)
        return 2
    commit = git("rev-parse", "--short=7", "HEAD")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = result_path(args.out_dir, date, commit, args.name)
    described = (f"{args.machine + '; ' if args.machine else ''}{cpu_model()}, {os.cpu_count()} "
                 f"cores, {memory_gb()} GB; load average (1/5/15 min) before: {load_average()}")
    doc = {"command": shlex.join(command), "commit": commit, "date": date, "machine": described,
           "versions": versions(), "runs_asked": args.runs, "runs_finished": 0,
           "notes": list(args.note), "run_seconds": [], "runs": []}
    if dirty:
        doc["uncommitted"] = dirty
    for i in range(args.runs):
        t0 = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            print(f"keep.py: run {i + 1} passed --timeout-s {args.timeout_s:g}; "
                  f"{len(doc['runs'])} finished runs kept in {path}", file=sys.stderr)
            return 1
        if done.returncode != 0:
            print(f"keep.py: run {i + 1} exited {done.returncode}; its stderr ends:\n"
                  f"{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        try:
            line = last_json_line(done.stdout)
        except ValueError as e:
            print(f"keep.py: run {i + 1}: {e}", file=sys.stderr)
            return 1
        doc["runs"].append(line)
        doc["run_seconds"].append(round(time.perf_counter() - t0, 1))
        doc["runs_finished"] = len(doc["runs"])
        doc["result"], doc["spread"] = summarise(doc["runs"])
        doc["machine"] = f"{described}, after run {i + 1}: {load_average()}"
        write_json_atomic(path, doc)
        print(f"keep.py: run {i + 1}/{args.runs} in {doc['run_seconds'][-1]} s -> {path}",
              file=sys.stderr)
    print(json.dumps({"path": os.path.relpath(path, ROOT), "runs": doc["runs_finished"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
