"""The embedded demo: the whole recipe on a laptop in minutes (``configs/demo.py``).

1. Procedural integer problems (``rl.demo_tasks``: big products, modular powers, counting,
   digit sums) that a tiny model cannot do in its head but can with the Python tool; the
   held-out split is disjoint from the training split by construction.
2. A tiny Qwen3 with the small-vocabulary Qwen BPE, trained by non-reasoning SFT
   (``rl.sft``) on tool-use traces in the paper's format (compact system prompt, see
   ``chat_template.COMPACT``), deliberately short so the policy still miscopies numbers.
3. Greedy held-out accuracy of the SFT policy through the real agent loop (serving engine,
   sandboxed code execution, math-verify reward).
4. GRPO-RoC (``rl.trainer.run_rl``) from the SFT weights with the same environment.
5. Greedy held-out accuracy again; ``demo_summary.json``, curves (``rstarjax.report``) and a
   HF export (``rstarjax.export``) in the workdir.

``run_demo(config, workdir)`` is the ``mode=demo`` entry point.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

log = logging.getLogger(__name__)


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def build_demo_model(config, tokenizer, mesh) -> nnx.Module:
    """A fresh Qwen3 of ``config.demo.model`` sizes with the tokenizer's (small) vocabulary."""
    from rstarjax.models import ModelConfig, Qwen3
    from rstarjax.models.sharding import shard_model

    sizes = dict(config.demo.model)
    # vocab = the tokenizer's real ids, not the padded table: the engine samples over every row and
    # an untrained padding row decoded as text would crash the turn (reported to serving)
    cfg = ModelConfig.preset("tiny", vocab_size=tokenizer.num_tokens, dtype=jnp.dtype(config.model.dtype),
                             bos_token_id=tokenizer.endoftext_id, eos_token_id=tokenizer.eos_id,
                             max_position_embeddings=int(config.rl.max_prompt_len + config.rl.max_response_len),
                             **sizes)
    return shard_model(Qwen3(cfg, rngs=nnx.Rngs(int(config.seed))), mesh)


def write_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def greedy_accuracy(rollouts, records: Sequence[Mapping[str, str]], policy_version: int = 0
                    ) -> tuple[float, list]:
    """Held-out accuracy of greedy decoding through the agent loop (one sample per problem),
    on the rollout function's engine and executor (no second compile)."""
    from rstarjax.models.chat_template import encode_prompt
    from rstarjax.rl.agent_loop import RolloutRequest, run_rollouts
    from rstarjax.serving.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    requests = [RolloutRequest(encode_prompt(rollouts.tokenizer, r["problem"], rollouts.fmt), str(r["answer"]), g,
                               greedy, policy_version) for g, r in enumerate(records)]
    trajs, _ = run_rollouts(rollouts.engine, rollouts.tokenizer, rollouts.executor, requests, rollouts.agent_config)
    return float(np.mean([t.reward > 0 for t in trajs])), trajs


def accuracy_breakdown(records: Sequence[Mapping[str, str]], trajectories) -> dict[str, Any]:
    """Held-out accuracy per task kind and the share of responses that called the tool (overall
    and per kind): what tells "RL learnt to use the tool" from "RL learnt to copy digits"."""
    from rstarjax.rl.demo_tasks import kind_of

    by_kind: dict[str, list] = {}
    for r, t in zip(records, trajectories, strict=True):
        by_kind.setdefault(kind_of(r["problem"]), []).append(t)
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
    from fractions import Fraction

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


def demo_datasets(config) -> dict[str, list]:
    """SFT traces, RL rows and held-out rows of ``config.demo``. With ``demo.recover_fraction``
    the buggy first programs of the recovery traces run in the RL sandbox (``rstarjax.env``), so
    their tracebacks are the ones rollouts show the policy."""
    from rstarjax.rl import demo_tasks

    d = config.demo
    kinds = tuple(d.task_kinds) if d.task_kinds else demo_tasks.TASK_KINDS
    in_head = dict(d.get("in_head_fraction", {}))
    recover = {k: float(v) for k, v in dict(d.get("recover_fraction", {})).items() if float(v) > 0}
    sft_tasks = demo_tasks.generate_tasks(d.num_sft_problems, "train", seed=config.seed,
                                          kinds=tool_balanced_kind_cycle(kinds, in_head))
    # RL problems: the same training split, a different seed (fresh problems, never held out)
    rl_rows = demo_tasks.make_dataset(d.num_rl_problems, "train", seed=config.seed + 1, kinds=kinds)
    eval_rows = demo_tasks.make_dataset(d.num_eval_problems, "test", seed=config.seed, kinds=kinds)
    if recover:
        from rstarjax.rl import agent_loop

        with agent_loop.make_executor(config) as executor:
            traces = demo_tasks.make_sft_traces(sft_tasks, in_head_fraction=in_head, seed=config.seed,
                                                recover_fraction=recover,
                                                error_runner=demo_tasks.sandbox_error_runner(executor))
    else:
        traces = demo_tasks.make_sft_traces(sft_tasks, in_head_fraction=in_head, seed=config.seed)
    if len(traces) < 0.9 * len(sft_tasks):
        raise RuntimeError(f"only {len(traces)} of {len(sft_tasks)} SFT traces ran correctly")
    return {"sft_traces": traces, "rl_rows": rl_rows, "eval_rows": eval_rows}


def rl_config_for_demo(config, workdir: str, train_path: str):
    """The config run_rl reads: the demo's RL section with data from the generated file."""
    c = copy.deepcopy(config)
    c.data.train_path = train_path
    c.checkpoint.init_from = ""
    return c


def provenance(config) -> dict[str, Any]:
    """What a figure in the README needs to be traced to its run: the SHA-256 of the config (as
    ``config.json`` in the workdir holds it), the seeds, the library versions and the code's commit."""
    import platform
    import subprocess

    import flax
    import jaxlib
    import optax

    import rstarjax

    commit = None
    try:  # best effort: an installed wheel has no git checkout
        root = os.path.dirname(os.path.dirname(os.path.abspath(rstarjax.__file__)))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            commit = out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "config_sha256": hashlib.sha256(config_json(config).encode()).hexdigest(),
        "seeds": {"seed": int(config.seed), "sft_seed": int(config.sft.seed)},
        "versions": {"rstarjax": rstarjax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": flax.__version__, "optax": optax.__version__, "python": platform.python_version()},
        "git_commit": commit,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "cpu_count": os.cpu_count(),
    }


def config_json(config) -> str:
    """The config as sorted JSON: what ``provenance``'s hash is taken of."""
    return config.to_json_best_effort(sort_keys=True, indent=1)


@dataclasses.dataclass
class DemoSetup:
    """What every stage of a demo run shares: tokenizer, chat format, mesh, the generated data."""
    tokenizer: Any
    fmt: Any
    mesh: Any
    data: dict[str, list]
    rl_path: str
    t_start: float
    provenance: dict[str, Any]  # taken at the start: the code and config that produced the run


def prepare(config, workdir: str, summary_name: str) -> DemoSetup:
    """Refuses a used workdir, generates the data and writes it (and ``config.json``) there."""
    from rstarjax.models.sharding import make_mesh
    from rstarjax.rl import sft as sft_lib

    t_start = time.time()
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(os.path.join(workdir, summary_name)) and not config.demo.get("overwrite", False):
        raise FileExistsError(f"{os.path.join(workdir, summary_name)} exists: pick a new --workdir "
                              "(the demo is not resumable)")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config_json(config))
    prov = provenance(config)
    fmt = sft_lib.chat_format(config.sft.chat_format)
    tokenizer = sft_lib.build_tokenizer(config)
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    data = demo_datasets(config)
    write_jsonl(os.path.join(workdir, "sft_traces.jsonl"), [{"messages": m} for m in data["sft_traces"]])
    rl_path = os.path.join(workdir, "rl_train.jsonl")
    write_jsonl(rl_path, data["rl_rows"])
    write_jsonl(os.path.join(workdir, "heldout.jsonl"), data["eval_rows"])
    _say(f"{len(data['sft_traces'])} SFT traces, {len(data['rl_rows'])} RL problems, "
         f"{len(data['eval_rows'])} held-out problems ({time.time() - t_start:.0f}s)")
    return DemoSetup(tokenizer, fmt, mesh, data, rl_path, t_start, prov)


def train_sft_policy(config, setup: DemoSetup, workdir: str) -> tuple[nnx.Module, dict[str, Any]]:
    """Non-reasoning SFT of a fresh demo model on the generated traces (logs in ``workdir/sft``)."""
    from rstarjax.rl import checkpoint as ckpt_lib
    from rstarjax.rl import sft as sft_lib
    from rstarjax.rl.metrics import MetricsWriter

    model = build_demo_model(config, setup.tokenizer, setup.mesh)
    sft_dir = os.path.join(workdir, "sft")
    with MetricsWriter(os.path.join(sft_dir, "logs"), tensorboard=False) as mw:
        sft_trainer, sft_summary = sft_lib.train_sft(
            model, setup.tokenizer, setup.data["sft_traces"], sft_lib.SFTConfig.from_config(config.sft),
            mesh=setup.mesh, fmt=setup.fmt, workdir=sft_dir,
            checkpoint_cfg=ckpt_lib.CheckpointConfig(every_steps=10**9, keep=1, async_save=False),
            meta=sft_lib.model_meta(model, setup.tokenizer), metrics_writer=mw, log_every=0)
    _say(f"SFT: {sft_summary['steps']} steps, loss {sft_summary['first_loss']:.3f} -> "
         f"{sft_summary['final_loss']:.3f} ({sft_summary['seconds']:.0f}s)")
    return sft_trainer.model(), sft_summary


def evaluate(rollouts, records, label: str, policy_version: int = 0) -> tuple[float, list, dict[str, Any]]:
    """Greedy held-out accuracy, its trajectories and the per-kind breakdown (printed)."""
    t0 = time.time()
    acc, trajs = greedy_accuracy(rollouts, records, policy_version=policy_version)
    breakdown = accuracy_breakdown(records, trajs)
    _say(f"held-out greedy accuracy {label}: {100 * acc:.1f}% ({time.time() - t0:.0f}s); {_describe(breakdown)}")
    return acc, trajs, breakdown


def run_demo(config, workdir: str) -> dict[str, Any]:
    """``mode=demo``: SFT -> greedy eval -> GRPO-RoC -> greedy eval; writes demo_summary.json."""
    from rstarjax.models import save_hf
    from rstarjax.rl import agent_loop
    from rstarjax.rl.trainer import run_rl

    summary_path = os.path.join(workdir, "demo_summary.json")
    setup = prepare(config, workdir, "demo_summary.json")
    data = setup.data
    policy, sft_summary = train_sft_policy(config, setup, workdir)

    executor = agent_loop.make_executor(config)
    try:
        rollouts = agent_loop.ColocatedRollouts(config, policy, tokenizer=setup.tokenizer, executor=executor,
                                                num_slots=int(config.demo.num_slots), fmt=setup.fmt)
        sft_acc, sft_trajs, sft_breakdown = evaluate(rollouts, data["eval_rows"], "after SFT")

        rl_dir = os.path.join(workdir, "rl")
        t0 = time.time()
        trainer = run_rl(rl_config_for_demo(config, rl_dir, setup.rl_path), rl_dir, rollout_fn=rollouts,
                         model=policy, on_update=lambda tr: rollouts.update_params(tr.model()))
        rl_seconds = time.time() - t0
        _say(f"RL: {trainer.step} GRPO-{'RoC' if config.rl.roc else 'plain'} steps ({rl_seconds:.0f}s)")

        rollouts.update_params(trainer.model())
        rl_acc, rl_trajs, rl_breakdown = evaluate(rollouts, data["eval_rows"], "after RL", trainer.step)
    finally:
        executor.close()

    _write_eval_samples(os.path.join(workdir, "heldout_samples.jsonl"), data["eval_rows"], sft_trajs, rl_trajs)
    if config.demo.export_hf:
        save_hf(trainer.model(), os.path.join(workdir, "hf"), tokenizer=setup.tokenizer)
    summary = {
        "sft_accuracy": sft_acc,
        "rl_accuracy": rl_acc,
        "num_eval_problems": len(data["eval_rows"]),
        "wall_seconds": time.time() - setup.t_start,
        "sft_steps": sft_summary["steps"],
        "sft_seconds": sft_summary["seconds"],
        "rl_steps": trainer.step,
        "rl_seconds": rl_seconds,
        "roc": bool(config.rl.roc),
        "seed": int(config.seed),
        "sft": sft_breakdown,
        "rl": rl_breakdown,
        "provenance": setup.provenance,
    }
    try:
        from rstarjax import report
        summary["plots"] = report.render(workdir)
    except Exception as e:  # plots are a convenience; never lose the run's figures over them
        log.warning("report failed: %s", e)
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    _say(f"summary: {json.dumps({k: summary[k] for k in ('sft_accuracy', 'rl_accuracy', 'num_eval_problems', 'wall_seconds')})}")
    return summary


def _write_eval_samples(path: str, records, sft_trajs, rl_trajs) -> None:
    rows = []
    for r, a, b in zip(records, sft_trajs, rl_trajs):
        rows.append({"problem": r["problem"], "answer": r["answer"],
                     "sft": {"reward": a.reward, "response": a.response_text},
                     "rl": {"reward": b.reward, "response": b.response_text}})
    write_jsonl(path, rows)
