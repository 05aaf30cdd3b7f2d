"""The embedded demo: the whole recipe on a laptop in minutes (``configs/demo.py``).

1. Procedural integer problems (``recipes.demo_tasks``: big products, modular powers, counting,
   digit sums) that a tiny model cannot do in its head but can with the Python tool; the
   held-out split is disjoint from the training split by construction.
2. A tiny Qwen3 with the small-vocabulary Qwen BPE, trained by non-reasoning SFT
   (``recipes.sft``) on tool-use traces in the paper's format (compact system prompt, see
   ``chat_template.COMPACT``), deliberately short so the policy still miscopies numbers.
3. Greedy held-out accuracy of the SFT policy through the real agent loop (serving engine,
   sandboxed code execution, math-verify reward).
4. GRPO-RoC (``recipes.rl.run_rl``) from the SFT weights with the same environment.
5. Greedy held-out accuracy again; ``demo_summary.json``, curves (``rstarjax.report``) and a
   HF export (``rstarjax.export``) in the workdir.

``run_demo(run, workdir)`` is the ``mode=demo`` entry point; ``recipes.demo_compare`` (``mode=demo_compare``)
shares its data, SFT and evaluation steps (``prepare``, ``train_sft_policy``, ``evaluate``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
import optax
from flax import nnx

import rstarjax
from rstarjax import report
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import files
from rstarjax.io.checkpoint import CheckpointConfig
from rstarjax.io.metrics_log import MetricsWriter, read_metrics
from rstarjax.models import save_hf
from rstarjax.models.chat_template import chat_format
from rstarjax.recipes import build, demo_tasks
from rstarjax.recipes import sft as sft_lib
from rstarjax.recipes.config import RunConfig
from rstarjax.recipes.rl import run_rl
from rstarjax.rl.agent_loop import ColocatedRollouts
from rstarjax.serving.sampling import SamplingParams

log = logging.getLogger(__name__)
GREEDY = SamplingParams(temperature=0.0)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def demo_policy(run: RunConfig, tokenizer, mesh) -> nnx.Module:
    """A fresh Qwen3 of ``demo.model`` sizes with the tokenizer's (small) vocabulary. The demo's
    SFT trains every weight; ``model.lora_rank`` applies to its RL stage (``run_rl`` puts
    adapters on the SFT policy)."""
    # vocab = the tokenizer's real ids, not the padded table: the engine samples over every row and
    # an untrained padding row decoded as text would crash the turn (reported to serving)
    return build.policy(dataclasses.replace(run.model, lora_rank=0), mesh, run.seed, vocab_size=tokenizer.num_tokens,
                        bos_token_id=tokenizer.endoftext_id, eos_token_id=tokenizer.eos_id,
                        max_position_embeddings=int(run.rl.max_prompt_len + run.rl.max_response_len),
                        **run.demo.model)


def greedy_accuracy(rollouts: ColocatedRollouts, records: Sequence[Mapping[str, str]], policy_version: int = 0
                    ) -> tuple[float, list]:
    """Held-out accuracy of greedy decoding through the agent loop (one sample per problem),
    on the rollout function's engine and executor (no second compile)."""
    trajs, _ = rollouts(list(records), 1, 0, policy_version, sampling=GREEDY)
    return float(np.mean([t.reward > 0 for t in trajs])), trajs


def accuracy_breakdown(records: Sequence[Mapping[str, str]], trajectories) -> dict[str, Any]:
    """Held-out accuracy per task kind and the share of responses that called the tool (overall
    and per kind): what tells "RL learnt to use the tool" from "RL learnt to copy digits"."""
    by_kind: dict[str, list] = {}
    for r, t in zip(records, trajectories, strict=True):
        by_kind.setdefault(demo_tasks.kind_of(r["problem"]), []).append(t)
    rate = lambda ts, pred: round(float(np.mean([pred(t) for t in ts])), 4)  # noqa: E731
    return {
        "accuracy_by_kind": {k: rate(ts, lambda t: t.reward > 0) for k, ts in sorted(by_kind.items())},
        "tool_call_rate": rate(trajectories, lambda t: t.tool_calls > 0),
        "tool_call_rate_by_kind": {k: rate(ts, lambda t: t.tool_calls > 0) for k, ts in sorted(by_kind.items())},
    }


def _describe(breakdown: Mapping[str, Any]) -> str:
    kinds = ", ".join(f"{k} {100 * v:.0f}%" for k, v in breakdown["accuracy_by_kind"].items())
    return f"by kind: {kinds}; tool called in {100 * breakdown['tool_call_rate']:.0f}% of responses"


def tool_balanced_kind_cycle(kinds: Sequence[str], in_head_fraction: Mapping[str, float]) -> tuple[str, ...]:
    """The round-robin order of SFT problem kinds, each kind repeated in proportion to
    1 / (1 - its in-head share), so every kind gets about the same number of TOOL traces (what
    digit copying is learnt from) and the in-head traces come on top. E.g. a 0.6 share: 5 of
    that kind per 2 of each other kind."""
    def weight(kind: str) -> Fraction:
        share = Fraction(str(in_head_fraction.get(kind, 0.0)))
        return 1 / (1 - share) if share < 1 else Fraction(1)  # an all-in-head kind has no tool traces

    weights = {k: weight(k) for k in kinds}
    scale = math.lcm(*(w.denominator for w in weights.values()))
    counts = {k: int(w * scale) for k, w in weights.items()}
    cycle, left = [], dict(counts)
    while any(left.values()):  # interleave, so any prefix of the cycle is roughly balanced
        for k in kinds:
            if left[k]:
                cycle.append(k)
                left[k] -= 1
    return tuple(cycle)


def demo_datasets(run: RunConfig) -> dict[str, list]:
    """SFT traces, RL rows and held-out rows of ``run.demo``. With ``demo.recover_fraction`` the
    buggy first programs of the recovery traces run in the RL sandbox (``rstarjax.env``), so
    their tracebacks are the ones rollouts show the policy."""
    d = run.demo
    kinds = tuple(d.task_kinds) if d.task_kinds else demo_tasks.TASK_KINDS
    in_head = dict(d.in_head_fraction)
    recover = {k: float(v) for k, v in d.recover_fraction.items() if float(v) > 0}
    sft_tasks = demo_tasks.generate_tasks(d.num_sft_problems, "train", seed=run.seed,
                                          kinds=tool_balanced_kind_cycle(kinds, in_head))
    # RL problems: the same training split, a different seed (fresh problems, never held out)
    rl_rows = demo_tasks.make_dataset(d.num_rl_problems, "train", seed=run.seed + 1, kinds=kinds)
    eval_rows = demo_tasks.make_dataset(d.num_eval_problems, "test", seed=run.seed, kinds=kinds)
    if recover:
        with build.executor(run.rl.num_tool_workers, run.env.allow_unconfined) as executor:
            traces = demo_tasks.make_sft_traces(sft_tasks, in_head_fraction=in_head, seed=run.seed,
                                                recover_fraction=recover,
                                                error_runner=demo_tasks.sandbox_error_runner(executor))
    else:
        traces = demo_tasks.make_sft_traces(sft_tasks, in_head_fraction=in_head, seed=run.seed)
    if len(traces) < 0.9 * len(sft_tasks):
        raise RuntimeError(f"only {len(traces)} of {len(sft_tasks)} SFT traces ran correctly")
    return {"sft_traces": traces, "rl_rows": rl_rows, "eval_rows": eval_rows}


def rl_run_for_demo(run: RunConfig, train_path: str) -> RunConfig:
    """The config the RL stage reads: the demo's sections with data from the generated file."""
    return dataclasses.replace(run, data=dataclasses.replace(run.data, train_path=train_path),
                               checkpoint=dataclasses.replace(run.checkpoint, init_from=""))


def config_json(run: RunConfig) -> str:
    """The run's typed config (every section, defaults included) as sorted JSON: what
    ``provenance``'s hash is taken of and ``config.json`` in the workdir holds."""
    return json.dumps(dataclasses.asdict(run), sort_keys=True, indent=1, default=str)


def git_commit() -> str | None:
    """The commit of the code that runs (``-dirty`` with uncommitted changes to tracked files);
    None outside a git checkout (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(rstarjax.__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(run: RunConfig) -> dict[str, Any]:
    """What a figure in the README needs to be traced to its run: the SHA-256 of the config (as
    ``config.json`` in the workdir holds it), the seeds, the library versions and the code's commit."""
    return {
        "config_sha256": hashlib.sha256(config_json(run).encode()).hexdigest(),
        "seeds": {"seed": int(run.seed), "sft_seed": int(run.sft.seed)},
        "versions": {"rstarjax": rstarjax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": flax.__version__, "optax": optax.__version__, "python": platform.python_version()},
        "git_commit": git_commit(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "cpu_count": os.cpu_count(),
    }


@dataclasses.dataclass
class DemoSetup:
    """What every stage of a demo run shares: tokenizer, mesh, the generated data."""
    tokenizer: Any
    mesh: Any
    data: dict[str, list]
    rl_path: str
    t_start: float
    provenance: dict[str, Any]  # taken at the start: the code and config that produced the run


def prepare(run: RunConfig, workdir: str, summary_name: str) -> DemoSetup:
    """Refuses a used workdir, generates the data and writes it (and ``config.json``) there."""
    t_start = time.time()
    os.makedirs(workdir, exist_ok=True)
    summary_path = os.path.join(workdir, summary_name)
    if os.path.exists(summary_path) and not run.demo.overwrite:
        raise FileExistsError(f"{summary_path} exists: that run finished; pick a new --workdir")
    files.write_atomic(os.path.join(workdir, "config.json"), config_json(run))
    prov = provenance(run)
    tokenizer = build.tokenizer(run.model)
    mesh = build.mesh(run.mesh)
    data = demo_datasets(run)
    files.write_jsonl_atomic(os.path.join(workdir, "sft_traces.jsonl"), [{"messages": m} for m in data["sft_traces"]])
    rl_path = os.path.join(workdir, "rl_train.jsonl")
    files.write_jsonl_atomic(rl_path, data["rl_rows"])
    files.write_jsonl_atomic(os.path.join(workdir, "heldout.jsonl"), data["eval_rows"])
    _say(f"{len(data['sft_traces'])} SFT traces, {len(data['rl_rows'])} RL problems, "
         f"{len(data['eval_rows'])} held-out problems ({time.time() - t_start:.0f}s)")
    return DemoSetup(tokenizer, mesh, data, rl_path, t_start, prov)


def load_sft_policy(run: RunConfig, setup: DemoSetup) -> tuple[nnx.Module, dict[str, Any]]:
    """The demo model with the params of an earlier run's SFT checkpoint (``demo.sft_checkpoint``,
    e.g. ``OLD_WORKDIR/sft/checkpoints``): RL arms re-run from the same SFT weights, no SFT."""
    model = demo_policy(run, setup.tokenizer, setup.mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    try:
        step, meta = ckpt_lib.read_checkpoint_meta(run.demo.sft_checkpoint)
    except FileNotFoundError:
        raise FileNotFoundError(f"--config.demo.sft_checkpoint={run.demo.sft_checkpoint!r} holds no finished "
                                "checkpoint") from None
    if meta.get("stage") != "sft":
        raise ValueError(f"--config.demo.sft_checkpoint={run.demo.sft_checkpoint!r} is not an SFT checkpoint "
                         f"(its meta says stage {meta.get('stage')!r})")
    restored, _, _ = ckpt_lib.restore_params(run.demo.sft_checkpoint, ckpt_lib.abstract_like(params), step=step)
    _say(f"SFT: params of step {step} from {run.demo.sft_checkpoint} (no SFT run)")
    summary = {"steps": int(step), "seconds": 0.0, "sft_checkpoint": os.path.abspath(run.demo.sft_checkpoint)}
    return nnx.merge(graphdef, restored, rest), summary


# The full demo's SFT is ~1,000 steps (15-40 min on a laptop or a free Colab GPU): a progress
# line every SFT_PROGRESS_EVERY steps shows it is alive, and a checkpoint every
# SFT_CHECKPOINT_EVERY steps lets a re-run after a disconnect resume instead of starting over.
# The CI-sized demo's few steps print no progress line (the summary line follows at once).
SFT_PROGRESS_EVERY = 50
SFT_CHECKPOINT_EVERY = 200


def duration(seconds: float) -> str:
    """``seconds`` as people read an ETA: "45s", "12m05s", "1h03m"."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def sft_progress_line(step: int, total: int, loss: float, steps_per_s: float) -> str:
    """One SFT progress line: where it is, its loss, its pace and the time left at that pace."""
    eta = (total - step) / steps_per_s if steps_per_s > 0 else float("nan")
    return f"SFT step {step}/{total}: loss {loss:.3f}, {steps_per_s:.2f} steps/s, ETA {duration(eta)}"


class SFTProgress:
    """``train_sft``'s ``on_step``: a progress line through ``say`` every ``every`` steps (never at
    the last step, which the summary line reports). The pace counts from the end of the first
    step this process trained, so the compile it waited for is not spread over the ETA."""

    def __init__(self, every: int, say=_say, clock=time.monotonic):
        self.every, self.say, self.clock = every, say, clock
        self.first: tuple[int, float] | None = None  # (step, time) at the end of this process's first step

    def __call__(self, step: int, total: int, metrics: Mapping[str, float]) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        if step % self.every or step >= total:
            return
        done, elapsed = step - self.first[0], now - self.first[1]
        self.say(sft_progress_line(step, total, metrics["sft/loss"], done / elapsed if done and elapsed > 0 else 0.0))


def logged_sft_losses(log_path: str) -> dict[int, float]:
    """``sft/loss`` by step in the SFT metrics log (empty when there is none): the losses of the
    steps an earlier process trained."""
    try:
        records = read_metrics(log_path)
    except (OSError, ValueError):
        return {}
    return {int(r["step"]): float(r["sft/loss"]) for r in records if "sft/loss" in r}


def resumed_sft_summary(fresh: Mapping[str, Any], saved: Mapping[str, Any] | None,
                        logged_losses: Mapping[int, float]) -> dict[str, Any]:
    """The demo's SFT summary when ``train_sft`` resumed from a checkpoint (``fresh``: what this
    process's call returned; its losses and seconds cover only the steps it trained). SFT already
    finished with its summary saved (``saved``, of the same length): that summary, its loss and
    time those of the run that trained it. Otherwise the run's first and last losses from the
    metrics log, and ``seconds`` this process's, said by ``seconds_from_step``."""
    start, steps = int(fresh.get("start_step", 0)), int(fresh["steps"])
    if not start:
        return dict(fresh)
    if start >= steps and saved is not None and int(saved.get("steps", -1)) == steps:
        return {**saved, "resumed_at_step": start}
    out = dict(fresh, resumed_at_step=start, seconds_from_step=start)
    out["first_loss"] = logged_losses.get(1, out["first_loss"])
    if start >= steps:  # nothing trained here: the last loss is the one logged at the last step
        out["final_loss"] = logged_losses.get(steps, out["final_loss"])
    return out


def sft_time_covered(summary: Mapping[str, Any]) -> str:
    """What an SFT summary's ``seconds`` are: all its steps, the steps after ``seconds_from_step``
    (a run resumed mid-SFT), or nothing known (a run resumed after SFT, its summary lost)."""
    steps, since = int(summary["steps"]), summary.get("seconds_from_step")
    if since is None:
        return f"{summary['seconds']:.0f}s"
    if int(since) >= steps:
        return "time unknown: an earlier run trained it"
    return f"{summary['seconds']:.0f}s for steps {int(since) + 1}-{steps}"


def sft_summary_line(summary: Mapping[str, Any]) -> str:
    """What the demo prints after SFT: its steps, loss and time; after a resume, where it resumed
    and what its time covers."""
    steps, start = int(summary["steps"]), int(summary.get("resumed_at_step", 0))
    loss = f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
    if not start:
        return f"SFT: {steps} steps, {loss} ({summary['seconds']:.0f}s)"
    if start >= steps:
        return f"SFT: resumed at step {start} of {steps} (nothing left to train); {loss} ({sft_time_covered(summary)})"
    return f"SFT: resumed at step {start}, trained to step {steps}; {loss} ({sft_time_covered(summary)})"


def train_sft_policy(run: RunConfig, setup: DemoSetup, workdir: str) -> tuple[nnx.Module, dict[str, Any]]:
    """Non-reasoning SFT of a fresh demo model on the generated traces (logs, checkpoints and
    ``sft_summary.json`` in ``workdir/sft``; a re-run resumes from its newest checkpoint); with
    ``demo.sft_checkpoint``, that checkpoint's params instead (``load_sft_policy``)."""
    if run.demo.sft_checkpoint:
        return load_sft_policy(run, setup)
    model = demo_policy(run, setup.tokenizer, setup.mesh)
    sft_dir = os.path.join(workdir, "sft")
    logdir = os.path.join(sft_dir, "logs")
    summary_path = os.path.join(sft_dir, "sft_summary.json")
    saved = None
    if os.path.exists(summary_path):  # read before this run could change it
        with open(summary_path) as f:
            saved = json.load(f)
    sft_trainer, fresh = sft_lib.train_sft(
        model, setup.tokenizer, setup.data["sft_traces"], run.sft, mesh=setup.mesh,
        fmt=chat_format(run.sft.chat_format), workdir=sft_dir,
        checkpoint_cfg=CheckpointConfig(every_steps=SFT_CHECKPOINT_EVERY, keep=1, async_save=False),
        meta=build.model_meta(model, setup.tokenizer, run.sft.chat_format), log_every=0,
        # opened at the step resumed from, so steps a killed run logged past its checkpoint are logged once
        open_metrics=lambda start: MetricsWriter(logdir, tensorboard=False, resume_step=start),
        on_step=SFTProgress(SFT_PROGRESS_EVERY))
    sft_summary = resumed_sft_summary(fresh, saved, logged_sft_losses(os.path.join(logdir, "metrics.jsonl")))
    files.write_json_atomic(summary_path, sft_summary)
    _say(sft_summary_line(sft_summary))
    return sft_trainer.model(), sft_summary


def sft_source(sft_summary: Mapping[str, Any], workdir: str) -> dict[str, Any]:
    """The checkpoint the RL stage's starting policy was read from or saved to (this run's SFT
    or ``demo.sft_checkpoint``), as a ``recipes.lora_base`` record: a LoRA RL stage's
    checkpoints name it as their base, so ``rstarjax.export`` can rebuild the policy."""
    path = sft_summary.get("sft_checkpoint") or os.path.join(workdir, "sft", "checkpoints")
    return {"source": "checkpoint", "path": os.path.abspath(path), "step": int(sft_summary["steps"])}


def demo_rollouts(run: RunConfig, policy: nnx.Module, setup: DemoSetup, executor) -> ColocatedRollouts:
    """The agent loop the demo evaluates and trains with: the RL section's budgets and sampling,
    the SFT traces' chat format, ``demo.num_slots`` slots."""
    return build.rollouts(policy, setup.tokenizer, executor, run.agent(), run.rl.sampling(), run.rl.max_prompt_len,
                          run.sft.chat_format, run.serving, num_slots=run.demo.num_slots)


def evaluate(rollouts, records, label: str, policy_version: int = 0) -> tuple[float, list, dict[str, Any]]:
    """Greedy held-out accuracy, its trajectories and the per-kind breakdown (printed)."""
    t0 = time.time()
    acc, trajs = greedy_accuracy(rollouts, records, policy_version=policy_version)
    breakdown = accuracy_breakdown(records, trajs)
    _say(f"held-out greedy accuracy {label}: {100 * acc:.1f}% ({time.time() - t0:.0f}s); {_describe(breakdown)}")
    return acc, trajs, breakdown


def run_demo(run: RunConfig, workdir: str) -> dict[str, Any]:
    """``mode=demo``: SFT -> greedy eval -> GRPO-RoC -> greedy eval; writes demo_summary.json."""
    summary_path = os.path.join(workdir, "demo_summary.json")
    setup = prepare(run, workdir, "demo_summary.json")
    data = setup.data
    policy, sft_summary = train_sft_policy(run, setup, workdir)

    executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
    try:
        rollouts = demo_rollouts(run, policy, setup, executor)
        sft_acc, sft_trajs, sft_breakdown = evaluate(rollouts, data["eval_rows"], "after SFT")

        rl_dir = os.path.join(workdir, "rl")
        t0 = time.time()
        trainer = run_rl(rl_run_for_demo(run, setup.rl_path), rl_dir, rollout_fn=rollouts, model=policy,
                         on_update=lambda tr: rollouts.update_params(tr.served_model()),
                         model_source=sft_source(sft_summary, workdir))
        rl_seconds = time.time() - t0
        _say(f"RL: {trainer.step} GRPO-{'RoC' if run.rl.roc else 'plain'} steps ({rl_seconds:.0f}s)")

        rollouts.update_params(trainer.served_model())
        rl_acc, rl_trajs, rl_breakdown = evaluate(rollouts, data["eval_rows"], "after RL", trainer.step)
    finally:
        executor.close()

    _write_eval_samples(os.path.join(workdir, "heldout_samples.jsonl"), data["eval_rows"], sft_trajs, rl_trajs)
    if run.demo.export_hf:
        with files.staged_dir(os.path.join(workdir, "hf")) as hf_dir:  # whole or not at all
            # LoRA: merged in f32; the template of the format the policy was trained in (what
            # mode=eval reads to ask in that format)
            save_hf(trainer.lora_model(), hf_dir, tokenizer=setup.tokenizer, chat_format=run.sft.chat_format)
    summary = {
        "sft_accuracy": sft_acc,
        "rl_accuracy": rl_acc,
        "num_eval_problems": len(data["eval_rows"]),
        "wall_seconds": time.time() - setup.t_start,
        "sft_steps": sft_summary["steps"],
        "sft_seconds": sft_summary["seconds"],
        **resumed_timing_note(sft_summary),
        "rl_steps": trainer.step,
        "rl_seconds": rl_seconds,
        "roc": bool(run.rl.roc),
        "seed": int(run.seed),
        "sft": sft_breakdown,
        "rl": rl_breakdown,
        "provenance": setup.provenance,
    }
    try:
        summary["plots"] = report.render(workdir)
    except Exception as e:  # plots are a convenience; never lose the run's figures over them
        log.warning("report failed: %s", e)
    files.write_json_atomic(summary_path, summary)  # whole or not at all: seed_table reads it
    _say(f"summary: {json.dumps({k: summary[k] for k in ('sft_accuracy', 'rl_accuracy', 'num_eval_problems', 'wall_seconds')})}")
    return summary


def resumed_timing_note(sft_summary: Mapping[str, Any]) -> dict[str, Any]:
    """What ``demo_summary.json`` adds when this process resumed SFT: where, and what its
    ``sft_seconds`` cover (``wall_seconds`` and ``rl_seconds`` are always this process's)."""
    start = int(sft_summary.get("resumed_at_step", 0))
    if not start:
        return {}
    return {"sft_resumed_at_step": start,
            "timing_note": f"resumed at SFT step {start}: wall_seconds and rl_seconds are this process's; "
                           f"sft_seconds: {sft_time_covered(sft_summary)}"}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean and range of one figure over runs (the README quotes a demo figure this way)."""
    vals = [float(v) for v in values]
    return {"mean": float(np.mean(vals)), "min": min(vals), "max": max(vals)}


def seed_table(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Held-out accuracy after SFT and after RL over several runs' ``demo_summary.json``: overall,
    the gain in points, per kind (SFT and RL side by side) and the tool-call rate, each as
    ``spread``. The runs must share their kinds and held-out size (one config, other seeds)."""
    if not summaries:
        raise ValueError("seed_table needs at least one demo_summary.json")
    kinds = sorted(summaries[0]["sft"]["accuracy_by_kind"])
    for s in summaries:
        if sorted(s["sft"]["accuracy_by_kind"]) != kinds or s["num_eval_problems"] != summaries[0]["num_eval_problems"]:
            raise ValueError(f"seed {s.get('seed')}: other kinds or held-out size than seed {summaries[0].get('seed')}")
    return {
        "seeds": [int(s["seed"]) for s in summaries],
        "num_eval_problems": int(summaries[0]["num_eval_problems"]),
        "sft_accuracy": spread([s["sft_accuracy"] for s in summaries]),
        "rl_accuracy": spread([s["rl_accuracy"] for s in summaries]),
        "gain_points": spread([100 * (s["rl_accuracy"] - s["sft_accuracy"]) for s in summaries]),
        "by_kind": {k: {phase: spread([s[phase]["accuracy_by_kind"][k] for s in summaries]) for phase in ("sft", "rl")}
                    for k in kinds},
        "tool_call_rate": {phase: spread([s[phase]["tool_call_rate"] for s in summaries]) for phase in ("sft", "rl")},
    }


def _write_eval_samples(path: str, records, sft_trajs, rl_trajs) -> None:
    rows = []
    for r, a, b in zip(records, sft_trajs, rl_trajs):
        rows.append({"problem": r["problem"], "answer": r["answer"],
                     "sft": {"reward": a.reward, "response": a.response_text},
                     "rl": {"reward": b.reward, "response": b.response_text}})
    files.write_jsonl_atomic(path, rows)
