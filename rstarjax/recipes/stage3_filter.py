"""Stage-3 data filter (rStar2-Agent §4.3): k=8 rollouts per problem with the latest policy;
problems solved k/k are dropped, the rest are written as the stage-3 training set (jsonl).

``--config=configs/stage3.py:filter --config.checkpoint.init_from=STAGE2/checkpoints``
reads the stage-2 policy, the original problem set from ``config.data.train_path``, and writes
``config.filter.output_path`` (default WORKDIR/filtered.jsonl) plus a JSON summary next to it.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence

import jax
import tqdm
from flax import nnx

from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.models import lora
from rstarjax.recipes import build, lora_base
from rstarjax.recipes.config import RunConfig
from rstarjax.rl.trajectory import RolloutFn, group_indices, trajectories_of

log = logging.getLogger(__name__)


def solve_counts(trajectories, num_groups: int) -> list[tuple[int, int]]:
    """(correct, total) rollouts per group_id in [0, num_groups)."""
    groups = group_indices([t.group_id for t in trajectories], num_groups)
    return [(sum(int(trajectories[i].reward > 0) for i in idx), len(idx)) for idx in groups.values()]


def keep_problem(correct: int, total: int, k: int) -> bool:
    """Drop a problem only when all k rollouts were correct (§4.3: "remove problems with all 8
    correct"); a problem whose rollouts did not all come back is an error, never silently kept.
    A rollout ended by an infrastructure error counts as not correct: the problem is kept (a hard
    problem wrongly dropped is lost; an easy one wrongly kept costs a little stage-3 compute)."""
    if total != k:
        raise ValueError(f"expected {k} rollouts for a problem, got {total}")
    return correct < k


def filter_problems(records: Sequence[dict], rollout_fn: RolloutFn, k: int, batch_prompts: int, seed: int,
                    progress: Callable[[int], None] | None = None) -> tuple[list[dict], dict]:
    """Run k rollouts per problem in batches of ``batch_prompts`` and keep the unsolved ones.

    Returns (kept records, each with an added ``"stage2_pass_rate"``; summary counts).
    """
    kept: list[dict] = []
    hist = [0] * (k + 1)  # problems by number of correct rollouts
    infra = 0
    for start in range(0, len(records), batch_prompts):
        chunk = list(records[start:start + batch_prompts])
        trajs = trajectories_of(rollout_fn(chunk, k, seed + start, -1))
        infra += sum(bool(getattr(t, "infra_error", False)) for t in trajs)
        for rec, (correct, total) in zip(chunk, solve_counts(trajs, len(chunk))):
            hist[correct] += 1
            if keep_problem(correct, total, k):
                kept.append(dict(rec, stage2_pass_rate=correct / k))
        if progress is not None:
            progress(len(chunk))
    summary = {"total": len(records), "kept": len(kept), "dropped_all_correct": hist[k],
               "correct_histogram": hist, "k": k, "infra_error_rollouts": infra}
    return kept, summary


def write_jsonl_atomic(path: str, rows: Sequence[dict]) -> None:
    """Write to PATH.tmp then rename: a killed filter never leaves a half-written dataset."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def run_filter(run: RunConfig, workdir: str, rollout_fn: RolloutFn | None = None, model=None) -> dict:
    """``mode=filter``: the stage-2 policy (``checkpoint.init_from``) rolls out ``filter.k`` times
    per problem of ``data.train_path``; single process writes (see docs/training.md)."""
    if jax.process_count() > 1:
        raise NotImplementedError("the stage-3 filter runs on one process (rollouts are the cost; "
                                  "use one host with a larger serving mesh)")
    # with the engine's prompts (rollout_fn None), the over-long ones are skipped and counted too
    records, report = build.problems(run.data.train_path, run.rl,
                                     build.tokenizer(run.model) if rollout_fn is None else None,
                                     run.data.answer_filter, run.data.handling)
    executor = None
    if rollout_fn is None:
        mesh = build.mesh(run.mesh)
        if model is None:  # init_from's params replace the built ones: no need to read HF's
            model = build.policy(run.model, mesh, run.seed,  # (LoRA: init_from holds adapters only)
                                 read_weights=not run.checkpoint.init_from or run.model.lora_rank > 0)
        if run.checkpoint.init_from and model.config.lora_rank:  # a LoRA stage's policy, merged to serve
            model, step = lora_base.restore_lora_policy(model, run.checkpoint.init_from)
            model = lora.merged_model(model, mesh)
            log.info("filtering with the LoRA policy of step %d from %s", step, run.checkpoint.init_from)
        elif run.checkpoint.init_from:
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            shardings = jax.tree.map(lambda x: x.sharding, params)
            params, _, step = ckpt_lib.restore_params(run.checkpoint.init_from,
                                                      ckpt_lib.abstract_like(params, shardings))
            model = nnx.merge(graphdef, params, rest)
            log.info("filtering with the policy of step %d from %s", step, run.checkpoint.init_from)
        executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
        rollout_fn = build.rollouts(model, build.tokenizer(run.model), executor, run.agent(), run.rl.sampling(),
                                    run.rl.max_prompt_len, run.rl.chat_format, run.serving)
    bar = tqdm.tqdm(total=len(records), desc="filter", disable=not run.logging.progress_bar)
    try:
        kept, summary = filter_problems(records, rollout_fn, run.filter.k, run.filter.batch_prompts, run.seed,
                                        progress=bar.update)
    finally:
        bar.close()
        if executor is not None:
            executor.close()
    summary["data_report"] = str(report)
    out = run.filter.output_path or os.path.join(workdir, "filtered.jsonl")
    write_jsonl_atomic(out, kept)
    with open(out + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    log.info("stage-3 filter: kept %d of %d problems -> %s", summary["kept"], summary["total"], out)
    return summary
