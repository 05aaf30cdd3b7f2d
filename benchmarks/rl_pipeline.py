"""RL pipeline benchmark: trained tokens per second of wall time of the whole RL loop, one JSON line.

Each arm is ``recipes.rl.run_rl`` as a user runs it: rollouts on the paged engine through the
scheduler with real sandboxed tool calls and the real verifier, RoC, the update, the weight
hand-off. Only the policy is scripted (teacher-forced): every (problem, sample) has a fixed
heavy-tailed multi-turn script, the serving benchmark's shape (a problem's difficulty scales all
its samples' turn lengths and tool calls; turn lengths log-normal; tool calls run real code that
sleeps a log-normal time), and half of a group's samples answer right, so every group trains. The
engine still runs the model on every token, so rollout time is real decode time.

The regime measured: on 2 CPU cores this workload is **update-bound** (the update takes about
twice the rollouts' time, e.g. 7.97 s vs 3.79 s per step on one core each), so overlapping the
two can gain at most (update + rollouts) / update (~1.48x), and partial rollouts, which shorten
the rollouts' tail, have nothing to gain here. At the paper's scale rollouts dominate
(docs/training.md's projection); this benchmark checks the machinery and its overheads, not
the gain a GPU cluster would see.

Figures, measured over the steps after ``--warmup`` (their compiles excluded) as trained tokens
(``train/trained_tokens``) over the wall time between the step logs. **Every speedup divides by
the fastest synchronous arm of the same round** (``baseline``: the colocated loop ``sync``, or
the disaggregated synchronous arms where they ran and were faster), never by a slower layout's
own synchronous arm; ``same_layout_speedup`` keeps the ratio to the arm's own layout for context.

- ``partial_speedup``: ``rl.partial_rollout_tokens=--budget``, colocated; issue #33's target is
  >= 1.3x.
- ``policy_lag_max`` / ``policy_lag_mean``: of the partial arm's trained tokens; the max is the
  largest over every round, the mean the median over rounds.
- ``async_colocated_speedup``: ``rl.max_staleness=1`` (a rollout thread samples the next step
  while the update runs, on the same devices); ``async_policy_lag_max`` the largest lag of any
  asynchronous arm's trained tokens (<= 1 by construction).
- ``async_partial_speedup``: both, ``rl.max_staleness=1`` with ``--budget``;
  ``async_partial_policy_lag_max`` may exceed 1: a paused rollout's earlier tokens are one
  version older per round between (``rl.staleness.lag_bound``).
- ``trainer_wait_frac`` / ``rollout_idle_frac`` per arm: the share of the measured wall time the
  update side waited for rollouts, and the time no rollout ran.
- ``async_speedup``: disaggregated with ``rl.max_staleness=1`` (issue #33's target >= 1.5x), as
  the issue's analog of two device groups: two processes (jax.distributed, gloo), each pinned to
  one core (``taskset``) with one CPU device. Process 0 trains, process 1 rolls out
  (``serving.placement='disaggregated'``, ``rollout_devices=1``: ``rl.remote``), the weights
  handed over device to device after each update. Its own synchronous arm (``processes_sync``)
  gives each side one core, slower than the colocated loop on both: hence the fastest baseline.
  ``async_speedup_one_process``: the same asynchronous arm in one process with two CPU devices,
  where the two sides share both cores (XLA:CPU's thread pool is per process).

``--repeat N`` runs N rounds, the arms' order reversed every other round (so no arm always runs
first on a warming or loaded machine); each figure is the median over rounds, ``spread`` its
[min, max].

    python benchmarks/rl_pipeline.py [--quick] [--repeat 3] [--budget 128] [--steps 6] [--arms async,async_partial]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true", help="fewer prompts and shorter scripts")
ap.add_argument("--smoke", action="store_true", help="seconds-sized: one measured step per arm, short "
                                                   "scripts (tests/test_rl_pipeline.py; its figures mean nothing)")
ap.add_argument("--repeat", type=int, default=0, help="alternating rounds (default 1 quick, 3)")
ap.add_argument("--budget", type=int, default=0, help="partial arm's tokens per rollout per step "
                                                    "(default 192 quick, 256)")
ap.add_argument("--steps", type=int, default=0, help="measured steps per arm (default 4 quick, 6)")
ap.add_argument("--arms", default="", help="comma-separated arms to run (default all; 'sync' always runs, "
                                         "the baseline): partial, async, async_partial, disaggregated, processes")
ap.add_argument("--arm", default="", help=argparse.SUPPRESS)  # internal: one disaggregated arm, JSON out
ap.add_argument("--process", type=int, default=-1, help=argparse.SUPPRESS)  # internal: a 2-process arm's
ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)  # process and coordinator port
ap.add_argument("--warmup", type=int, default=3, help="steps per arm before the measured ones (their compiles, and the partial arm filling its pipeline)")
args = ap.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if args.arm:  # a disaggregated arm: the trainer on one device, the rollout slice on the other
    devices = 1 if args.process >= 0 else 2  # in two processes: one device each
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rstarjax.env import CodeExecutor  # noqa: E402
from rstarjax.io import compile_cache  # noqa: E402
from rstarjax.models.chat_template import COMPACT  # noqa: E402
from rstarjax.models.config import ModelConfig  # noqa: E402
from rstarjax.models.qwen3 import Qwen3  # noqa: E402
from rstarjax.recipes import build  # noqa: E402
from rstarjax.recipes.config import parse  # noqa: E402
from rstarjax.recipes.rl import run_rl  # noqa: E402
from rstarjax.rl.agent_loop import ColocatedRollouts  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "configs"))
import base  # noqa: E402

TOOL = "execute_python_code_with_standard_io"
QUICK = args.quick or args.smoke
REPEAT = args.repeat or (1 if QUICK else 3)
BUDGET = args.budget or (16 if args.smoke else 192 if QUICK else 256)
STEPS = args.steps or (1 if args.smoke else 6 if QUICK else 8)
WARMUP = 1 if args.smoke else args.warmup
PROMPTS, GROUP = (2, 2) if args.smoke else (4, 4) if QUICK else (8, 4)  # per step; 2G rollouts per prompt
MAX_RESPONSE = 256 if args.smoke else 1024 if QUICK else 1536
LONGEST_TURN = 32 if args.smoke else 160 if QUICK else 240


def script_for(tok, problem_id: int, sample: int) -> list[int]:
    """The teacher-forced tokens of sample ``sample`` of problem ``problem_id``: 1-5 turns, every
    turn but the last ending in a real tool call, the last in an answer (right for even samples)."""
    difficulty = np.random.default_rng([problem_id]).lognormal(0.0, 0.6)
    rng = np.random.default_rng([problem_id, sample])
    filler = tok.encode(" think")[0]
    calls = min(int(rng.geometric(min(0.9, 0.45 / difficulty))) - 1, 1 if args.smoke else 4)
    turns = []
    for k in range(calls + 1):
        mu = (3.0 if QUICK else 3.4) + np.log(difficulty)
        length = int(np.clip(rng.lognormal(mu, 0.9), 4, LONGEST_TURN))
        if k < calls:
            sleep = float(np.clip(rng.lognormal(-2.5, 1.0), 0.01, 0.5))
            code = f"import time\ntime.sleep({sleep:.3f})\nprint({problem_id}*{k})"
            turns += [filler] * length + tok.encode(
                '<tool_call>\n{"name": "' + TOOL + '", "arguments": ' + json.dumps({"code": code, "input": ""})
                + "}\n</tool_call>")
        else:
            answer = 42 if sample % 2 == 0 else 41
            turns += [filler] * length + tok.encode(f"<answer>\\boxed{{{answer}}}</answer><|im_end|>")
    return turns


class ScriptedRollouts(ColocatedRollouts):
    """The recipe's rollouts (engines, scheduler, code pool, verifier) with scripted policies."""

    def requests(self, records, n_per_prompt, seed, policy_version, sampling=None, group_ids=None):
        reqs = super().requests(records, n_per_prompt, seed, policy_version, sampling, group_ids)
        for i, req in enumerate(reqs):
            problem_id = int(records[i // n_per_prompt]["problem"].split()[2].split("*")[0])
            req.script = script_for(self.tokenizer, problem_id, req.sample_index)
        return reqs


def stage_config(workdir: str, budget: int, staleness: int = 0, disaggregated: bool = False):
    c = base.get_config()
    c.total_steps = WARMUP + STEPS
    c.seed = 0
    c.model.preset = "tiny"
    c.model.random_init = True
    c.model.dtype = "float32"
    c.model.remat_policy = "none"
    c.model.tokenizer_num_regular_tokens = 486
    c.data.train_path = os.path.join(workdir, "train.jsonl")
    c.rl.prompts_per_step = PROMPTS
    c.rl.group_size = GROUP
    c.rl.oversample = 2 * GROUP
    c.rl.max_prompt_len = 192  # the compact prompt is 162 tokens in the small vocabulary
    c.rl.max_response_len = MAX_RESPONSE
    c.rl.max_turns = 8
    c.rl.chat_format = "compact"
    c.rl.partial_rollout_tokens = budget
    c.rl.max_staleness = staleness
    if disaggregated:
        c.serving.placement, c.serving.rollout_devices = "disaggregated", 1
    if staleness:
        c.loss.tis_cap = 2.0  # its off-policy correction (free when nothing is stale)
    c.trainer.micro_batch_size = 0
    c.mesh.fsdp, c.mesh.data = 1, 1
    # the pool holds a step's rollouts at once with room for the carried ones (the regime of a
    # GPU's pool, sized by rStar2-Agent §3.2's K): what is left to gain is the tail
    c.serving.num_slots = 64
    c.serving.kv_pages = 64 * (MAX_RESPONSE + 256) // 16
    c.checkpoint.every_steps = 1000  # no checkpoint inside the measured steps
    c.checkpoint.async_save = False
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    return parse(c)


def bench_model():
    """The serving benchmark's model: on 2 cores its update takes a fraction of the rollout time,
    as at the paper's scale (docs/training.md's projection: 264 s of 1,164)."""
    return Qwen3(ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512, hidden_size=128,
                                    intermediate_size=256), rngs=nnx.Rngs(0))


def scripted_rollouts(run, executor, model) -> ScriptedRollouts:
    return ScriptedRollouts(model, tokenizer=build.tokenizer(run.model), executor=executor, agent=run.agent(),
                            sampling=run.rl.sampling(), max_prompt_len=run.rl.max_prompt_len, fmt=COMPACT,
                            serving=run.serving)


def arm_workdir(prefix: str) -> str:
    """A fresh workdir holding the arm's problems."""
    workdir = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:
        for i in range(400):
            f.write(json.dumps({"problem": f"What is {i}*7?", "answer": "42"}) + "\n")
    return workdir


def run_arm(budget: int, executor, cache_dir: str, staleness: int = 0, disaggregated: bool = False,
            remote: bool = False) -> dict:
    """One arm's figures; ``remote``: this is the trainer process of a 2-process arm (its
    rollouts in the other process, ``rl.remote``)."""
    workdir = arm_workdir(f"rl_pipeline_{budget}_{staleness}_{int(disaggregated)}_")
    run = stage_config(workdir, budget, staleness, disaggregated)
    model = bench_model()
    compile_cache.enable_persistent_cache(cache_dir)
    t0 = time.perf_counter()
    if remote:
        run_rl(run, workdir, model=model)
    else:
        rollouts = scripted_rollouts(run, executor, model)
        run_rl(run, workdir, rollout_fn=rollouts, model=model,
               on_update=lambda tr: rollouts.update_params(tr.served_model()))
    wall = time.perf_counter() - t0
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    measured = logged[WARMUP:]
    span = measured[-1]["wall_time"] - logged[WARMUP - 1]["wall_time"]
    tokens = sum(m["train/trained_tokens"] for m in measured)
    out = {"trained_tokens_per_s": tokens / span, "measured_s": span, "trained_tokens": tokens,
           "steps": len(measured), "wall_s": wall,
           "rollout_s_mean": statistics.mean(m.get("timing/rollout_s", 0.0) for m in measured),
           "update_s_mean": statistics.mean(m.get("time/update", 0.0) for m in measured),
           "mean_live": statistics.mean(m.get("timing/rollout_mean_live", 0.0) for m in measured)}
    total = {k: sum(m.get(f"timing/rollout_{k}", 0.0) for m in measured)
             for k in ("decode_s", "decode_steps", "generated_tokens", "prefill_s", "makespan_s")}
    out.update({"train_s_mean": statistics.mean(m.get("time/update", 0.0) + m.get("time/old_logprobs", 0.0)
                                                for m in measured),
                "decode_us_per_token": 1e6 * total["decode_s"] / max(1.0, total["generated_tokens"]),
                "tokens_per_decode_step": total["generated_tokens"] / max(1.0, total["decode_steps"]),
                "prefill_s_mean": total["prefill_s"] / len(measured),
                "groups_trained_mean": statistics.mean(m.get("partial/groups_trained", PROMPTS) for m in measured)})
    waits = sum(m.get("async/rollout_wait_s" if staleness else "time/rollout", 0.0) for m in measured)
    out["trainer_wait_frac"] = waits / span
    out["rollout_idle_frac"] = max(0.0, 1.0 - total["makespan_s"] / span)
    if staleness or budget:  # the lag of the trained tokens (asynchronous: every token's, paused ones too)
        prefix = "async/" if staleness else "partial/"
        out["policy_lag_max"] = max(m.get(f"{prefix}policy_lag_max", 0.0) for m in measured)
        out["policy_lag_mean"] = statistics.mean(m.get(f"{prefix}policy_lag_mean", 0.0) for m in measured)
    if budget:
        out["rounds_per_step"] = statistics.mean(m.get("partial/rounds", 1.0) for m in measured)
    return out


DISAGGREGATED = {"disaggregated_sync": 0, "disaggregated_async": 1}  # arm -> rl.max_staleness (one process)
PROCESSES = {"processes_sync": 0, "processes_async": 1}  # the same in two processes, a core each


def arm_flags() -> list[str]:
    flags = [f for f in sys.argv[1:] if f in ("--quick", "--smoke")]
    for name in ("budget", "steps", "warmup"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    return flags


def run_disaggregated(arm: str, cache_dir: str) -> dict:
    """One disaggregated arm in a subprocess with two CPU devices; its ``run_arm`` result."""
    env = {**os.environ, "RL_PIPELINE_CACHE": cache_dir}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm, *arm_flags()], env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"the {arm} arm failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pinned() -> bool:
    """Whether each process of a 2-process arm gets its own core (``taskset``, >= 2 cores)."""
    import shutil

    return shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2


def run_processes(arm: str, cache_dir: str) -> dict:
    """One 2-process arm: the trainer process's ``run_arm`` result, with ``pinned``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "RL_PIPELINE_CACHE": cache_dir}
    env.pop("XLA_FLAGS", None)
    procs = []
    for pid in (0, 1):
        pin = ["taskset", "-c", str(cores[pid])] if pinned() else []
        procs.append(subprocess.Popen([*pin, sys.executable, os.path.abspath(__file__), "--arm", arm,
                                       "--process", str(pid), "--port", str(port), *arm_flags()], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=3600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"the {arm} arm failed:\n{err[-3000:]}")
    return {**json.loads(outs[0][0].strip().splitlines()[-1]), "pinned": float(pinned())}


def process_arm() -> None:
    """This process's side of a 2-process arm: process 0 trains, process 1 rolls out."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)  # as rstarjax.main does for this layout
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=2,
                               process_id=args.process, initialization_timeout=300)
    from rstarjax.rl.remote import serve_remote

    cache_dir, staleness = os.environ["RL_PIPELINE_CACHE"], PROCESSES[args.arm]
    if args.process == 0:
        print(json.dumps(run_arm(0, None, cache_dir, staleness, disaggregated=True, remote=True)))
        return
    compile_cache.enable_persistent_cache(cache_dir)
    with CodeExecutor(num_workers=2) as executor:
        run = stage_config(arm_workdir("rl_pipeline_rollout_process_"), 0, staleness, disaggregated=True)
        serve_remote(scripted_rollouts(run, executor, bench_model()), wait_s=3600)


def main():
    if args.arm in PROCESSES:
        process_arm()
        return
    if args.arm:
        with CodeExecutor(num_workers=2) as executor:
            print(json.dumps(run_arm(0, executor, os.environ["RL_PIPELINE_CACHE"], DISAGGREGATED[args.arm],
                                     disaggregated=True)))
        return
    cache_dir = tempfile.mkdtemp(prefix="rl_pipeline_cache_")
    wanted = selected_arms(args.arms)
    runs = {"sync": [], "partial": [], "async": [], "async_partial": [],
            **{arm: [] for arm in (*DISAGGREGATED, *PROCESSES)}}
    colocated = {"partial": (BUDGET, 0), "async": (0, 1), "async_partial": (BUDGET, 1)}  # (budget, staleness)
    with CodeExecutor(num_workers=2) as executor:
        thunks = {"sync": lambda: run_arm(0, executor, cache_dir)}
        for arm, (budget, staleness) in colocated.items():
            if arm in wanted:
                thunks[arm] = lambda b=budget, k=staleness: run_arm(b, executor, cache_dir, staleness=k)
        if "disaggregated" in wanted and not args.smoke:  # the smoke run: the 2-process ones only
            for arm in DISAGGREGATED:
                thunks[arm] = lambda a=arm: run_disaggregated(a, cache_dir)
        if "processes" in wanted:
            for arm in PROCESSES:  # the code pool above idles meanwhile
                thunks[arm] = lambda a=arm: run_processes(a, cache_dir)
        for r in range(REPEAT):
            for arm in round_order(list(thunks), r):
                runs[arm].append(thunks[arm]())
    print(json.dumps(summary(runs)))


def round_order(arms: list[str], round_index: int) -> list[str]:
    """The arms in the order round ``round_index`` runs them: as listed in even rounds, reversed
    in odd ones, so no arm always runs first (or last) on a machine that warms or loads up."""
    return arms if round_index % 2 == 0 else arms[::-1]


def selected_arms(names: str) -> set[str]:
    """The arms ``--arms`` names (all when empty); an unknown name is an error."""
    every = {"partial", "async", "async_partial", "disaggregated", "processes"}
    wanted = {n.strip() for n in names.split(",") if n.strip() and n.strip() != "sync"} if names else every
    if wanted - every:
        raise SystemExit(f"unknown arms {sorted(wanted - every)}: choose among {sorted(every)}")
    return wanted


SYNC_ARMS = ("sync", "disaggregated_sync", "processes_sync")  # the same work, synchronous, each layout
SPEEDUPS = {"partial_speedup": "partial", "async_colocated_speedup": "async",
            "async_partial_speedup": "async_partial", "async_speedup": "processes_async",
            "async_speedup_one_process": "disaggregated_async"}  # figure -> arm, over the fastest sync
SAME_LAYOUT = {"async_speedup": ("processes_async", "processes_sync"),
               "async_speedup_one_process": ("disaggregated_async", "disaggregated_sync")}


def fastest_sync(runs: dict, round_index: int) -> str:
    """The synchronous arm with the most trained tokens/s in round ``round_index``: every
    speedup's baseline (the strongest configuration of the same work measured in that round)."""
    ran = [arm for arm in SYNC_ARMS if len(runs.get(arm, [])) > round_index]
    return max(ran, key=lambda arm: runs[arm][round_index]["trained_tokens_per_s"])


def summary(runs: dict) -> dict:
    """The JSON line: each speedup's median and [min, max] over the rounds, each round's ratio
    taken against that round's fastest synchronous arm (None where an arm did not run); the
    lags (maxima: the largest over every round); and every arm's median figures."""
    rounds = len(runs["sync"])
    baselines = [fastest_sync(runs, r) for r in range(rounds)]

    def over(arm, base_of):
        return [runs[arm][r]["trained_tokens_per_s"] / runs[base_of(r)][r]["trained_tokens_per_s"]
                for r in range(len(runs[arm]))]

    ratios = {name: over(arm, lambda r: baselines[r]) for name, arm in SPEEDUPS.items()}
    same_layout = {name: over(arm, lambda r, b=base: b) for name, (arm, base) in SAME_LAYOUT.items()}
    median = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items() if rs}
    async_runs = runs["async"] + runs["disaggregated_async"] + runs["processes_async"]
    return {
        "benchmark": "rl_pipeline", "quick": QUICK, "repeat": REPEAT, "budget": BUDGET,
        "prompts_per_step": PROMPTS, "rollouts_per_step": PROMPTS * 2 * GROUP, "measured_steps": STEPS,
        "regime": "update-bound on 2 CPU cores: overlap gains at most (update + rollouts) / update",
        "baseline": baselines,  # per round: the fastest synchronous arm, every speedup's denominator
        **{name: statistics.median(r) if r else None for name, r in ratios.items()},
        "same_layout_speedup": {name: statistics.median(r) if r else None for name, r in same_layout.items()},
        "processes_pinned": median["processes_sync"]["pinned"] if "processes_sync" in median else None,
        "spread": {name: [min(r), max(r)] for name, r in ratios.items() if r},
        "policy_lag_max": max((r["policy_lag_max"] for r in runs["partial"]), default=None),
        "policy_lag_mean": median["partial"]["policy_lag_mean"] if "partial" in median else None,
        "async_policy_lag_max": max((r["policy_lag_max"] for r in async_runs), default=None),
        # both on: paused tokens may lag beyond k (staleness.lag_bound)
        "async_partial_policy_lag_max": max((r["policy_lag_max"] for r in runs["async_partial"]), default=None),
        **median,
    }


if __name__ == "__main__":
    main()
