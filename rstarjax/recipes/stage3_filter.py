"""Stage-3 data filter (rStar2-Agent §4.3): k=8 rollouts per problem with the latest policy;
problems solved k/k are dropped, the rest are written as the stage-3 training set (jsonl).

``--config=configs/stage3.py:filter --config.checkpoint.init_from=STAGE2/checkpoints``
reads the stage-2 policy, the original problem set from ``config.data.train_path``, and writes
``config.filter.output_path`` (default WORKDIR/filtered.jsonl) plus a JSON summary next to it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence

import jax
import tqdm

from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.io import files
from rstarjax.io.data import DataError
from rstarjax.recipes import build, preemption
from rstarjax.recipes.config import RunConfig
from rstarjax.rl.trajectory import RolloutFn, group_indices, trajectories_of

log = logging.getLogger(__name__)


def solve_counts(trajectories, num_groups: int) -> list[tuple[int, int]]:
    """(correct, total) rollouts per group_id in [0, num_groups)."""
    groups = group_indices([t.group_id for t in trajectories], num_groups)
    return [(sum(int(trajectories[i].reward > 0) for i in idx), len(idx)) for idx in groups.values()]


def check_counts(chunk: Sequence[dict], counts: Sequence[tuple[int, int]], k: int, start: int) -> None:
    """Every problem of a batch came back with exactly k rollouts, checked before the batch is
    recorded (a short group on record would fail every rerun that reads it back)."""
    wrong = [(start + i, rec.get("uid", rec.get("problem", "")), total)
             for i, (rec, (_, total)) in enumerate(zip(chunk, counts)) if total != k]
    if len(counts) != len(chunk) or wrong:
        named = "; ".join(f"row {row} ({str(uid)[:60]!r}): {total}" for row, uid, total in wrong[:5])
        raise ValueError(f"expected {k} rollouts for each problem of the batch at row {start}, got {named}"
                         " (not recorded: a rerun rolls this batch out again)")


def keep_problem(correct: int, total: int, k: int) -> bool:
    """Drop a problem only when all k rollouts were correct (§4.3: "remove problems with all 8
    correct"); a problem whose rollouts did not all come back is an error, never silently kept.
    A rollout ended by an infrastructure error counts as not correct: the problem is kept (a hard
    problem wrongly dropped is lost; an easy one wrongly kept costs a little stage-3 compute)."""
    if total != k:
        raise ValueError(f"expected {k} rollouts for a problem, got {total}")
    return correct < k


def batch_key(chunk: Sequence[dict], start: int, k: int, seed: int, policy: str = "") -> str:
    """What a finished batch's line in the progress file must match to be reused: its place, its
    problems and answers, k, the seed and the policy that rolled it out (``policy_identity``: a
    changed data file, setting or checkpoint redoes the batch)."""
    text = json.dumps([start, k, seed, [[r.get("problem"), r.get("answer")] for r in chunk]]
                      + ([policy] if policy else []), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _recorded_counts_fit(row: dict, chunk: Sequence[dict], k: int) -> bool:
    """A progress line's counts are a (correct <= k, total == k) pair per problem of its batch."""
    try:
        counts = [tuple(int(x) for x in c) for c in row["counts"]]
        int(row["infra"])
    except (KeyError, TypeError, ValueError):
        return False
    return len(counts) == len(chunk) and all(len(c) == 2 and 0 <= c[0] <= k and c[1] == k for c in counts)


def read_progress(path: str | None) -> dict[str, dict]:
    """The finished batches of an earlier run of the filter, by ``batch_key`` (a torn last line
    from a kill is ignored: its batch runs again)."""
    done = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    done[row["key"]] = row
                except (ValueError, KeyError, TypeError):
                    continue
    return done


def filter_problems(records: Sequence[dict], rollout_fn: RolloutFn, k: int, batch_prompts: int, seed: int,
                    progress: Callable[[int], None] | None = None, progress_path: str | None = None,
                    guard: preemption.SignalGuard | None = None, policy: str = "") -> tuple[list[dict], dict]:
    """Run k rollouts per problem in batches of ``batch_prompts`` and keep the unsolved ones.

    ``progress_path``: each finished batch's counts are appended there, and the batches an
    earlier run finished (same problems, k, seed) are read from it instead of rolled out again,
    so an interrupted filter resumes (``policy``: what rolls out, part of each batch's key: a
    batch another checkpoint or sampling setting filtered is not reused). ``guard``: a stop signal abandons the batch in progress
    (its rollouts, ``SignalGuard.rollouts``) and raises ``preemption.Interrupted``.
    Returns (kept records, each with an added ``"stage2_pass_rate"``; summary counts).
    """
    kept: list[dict] = []
    hist = [0] * (k + 1)  # problems by number of correct rollouts
    infra, resumed, finished = 0, 0, 0
    done = read_progress(progress_path)
    if progress_path:  # a line a killed filter cut short: a batch appended after it would be lost with it
        files.cut_torn_tail(progress_path)
    log_file = open(progress_path, "a") if progress_path else None
    try:
        for start in range(0, len(records), batch_prompts):
            chunk = list(records[start:start + batch_prompts])
            key = batch_key(chunk, start, k, seed, policy)
            recorded = done.get(key)
            if recorded is not None and not _recorded_counts_fit(recorded, chunk, k):
                log.warning("the progress line of the batch at row %d does not fit it (%s): rolling it out again",
                            start, recorded.get("counts"))
                recorded = None
            if recorded is not None:
                counts, batch_infra = [tuple(c) for c in recorded["counts"]], int(recorded["infra"])
                resumed += len(chunk)
            else:
                try:
                    with guard.rollouts() if guard is not None else contextlib.nullcontext():
                        trajs = trajectories_of(rollout_fn(chunk, k, seed + start, -1))
                except preemption.StepAbandoned:
                    raise preemption.Interrupted(
                        guard.request.signum, finished, True, True,
                        done=f"{finished} of {len(records)} problems are filtered and kept in {progress_path}"
                        if progress_path else f"{finished} of {len(records)} problems were filtered") from None
                counts = solve_counts(trajs, len(chunk))
                check_counts(chunk, counts, k, start)
                batch_infra = sum(bool(getattr(t, "infra_error", False)) for t in trajs)
                if log_file is not None:
                    log_file.write(json.dumps({"key": key, "start": start, "counts": counts, "infra": batch_infra}) + "\n")
                    log_file.flush()
                    os.fsync(log_file.fileno())
            infra += batch_infra
            finished += len(chunk)
            for rec, (correct, total) in zip(chunk, counts):
                hist[correct] += 1
                if keep_problem(correct, total, k):
                    kept.append(dict(rec, stage2_pass_rate=correct / k))
            if progress is not None:
                progress(len(chunk))
    finally:
        if log_file is not None:
            log_file.close()
    summary = {"total": len(records), "kept": len(kept), "dropped_all_correct": hist[k],
               "correct_histogram": hist, "k": k, "infra_error_rollouts": infra, "resumed_problems": resumed}
    return kept, summary


def policy_identity(run: RunConfig, init_from_step: int | None = None, meta: dict | None = None) -> str:
    """What decides the filter's rollouts besides the problems, k and the seed: the weights (the
    checkpoint's path, step and recorded fingerprints, or the base model) and the sampling
    settings, hashed."""
    weights = ({"init_from": os.path.abspath(run.checkpoint.init_from), "step": init_from_step,
                "arrays": (meta or {}).get(ckpt_lib.FINGERPRINT_KEY)} if run.checkpoint.init_from
               else {"base": run.model.hf_path or run.model.preset, "lora_rank": run.model.lora_rank})
    rl = run.rl
    # the agent's settings that decide what counts as solved: the reward (its mode, time limit)
    # and the tool's limits (waits and retries only decide how long an infrastructure failure takes)
    agent = run.agent()
    outcome = [agent.reward_mode, agent.verify_timeout_s, agent.tool_timeout_s, agent.max_tool_response_chars]
    sampling = [repr(rl.sampling()), rl.max_turns, rl.max_prompt_len, rl.max_response_len, rl.chat_format, outcome]
    return hashlib.sha256(json.dumps([weights, sampling], sort_keys=True, default=str).encode()).hexdigest()[:20]


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
    policy = "the given rollouts"
    # the checkpoint is checked before any model is built (a missing one is one line at once)
    init_from_step, init_meta = build.init_from_checkpoint(run.checkpoint.init_from) if run.checkpoint.init_from else (None, None)
    if rollout_fn is None:
        policy = (f"the policy in {run.checkpoint.init_from}" if run.checkpoint.init_from
                  else f"the base model {run.model.hf_path or run.model.preset} (no --config.checkpoint.init_from)")
        mesh = build.mesh(run.mesh)
        if model is None:  # init_from's params replace the built ones: no need to read HF's
            model = build.policy(run.model, mesh, run.seed,  # (LoRA: init_from holds adapters only)
                                 read_weights=not run.checkpoint.init_from or run.model.lora_rank > 0)
        if run.checkpoint.init_from:  # (a LoRA stage's policy merged to serve)
            model, step = build.restore_policy(model, run.checkpoint.init_from, mesh)
            log.info("filtering with the policy of step %d from %s", step, run.checkpoint.init_from)
        executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
        rollout_fn = build.rollouts(model, build.tokenizer(run.model), executor, run.agent(), run.rl.sampling(),
                                    run.rl.max_prompt_len, run.rl.chat_format, run.serving)
    out = run.filter.output_path or os.path.join(workdir, "filtered.jsonl")
    progress_path = out + ".progress.jsonl"  # finished batches: a rerun after a stop resumes from them
    print(f"rstarjax: stage-3 filter of {len(records)} problems ({run.filter.k} rollouts each) with {policy}"
          + (f"; {len(read_progress(progress_path))} batches finished earlier are on record ({progress_path}): "
             "those of the same problems, settings and policy are reused"
             if os.path.exists(progress_path) else ""), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    bar = tqdm.tqdm(total=len(records), desc="filter", disable=not run.logging.progress_bar)
    with preemption.SignalGuard(run.checkpoint.preemption_grace_s) as guard:  # a stop keeps the batches done
        try:
            kept, summary = filter_problems(records, rollout_fn, run.filter.k, run.filter.batch_prompts,
                                            run.seed, progress=bar.update, progress_path=progress_path,
                                            guard=guard, policy=policy_identity(run, init_from_step, init_meta))
        finally:
            bar.close()
            if executor is not None:
                executor.close(drain_timeout=0.0 if guard.request is not None else None)
    summary["data_report"] = str(report)
    # each file whole or not at all: a killed filter never leaves a half-written dataset or summary
    files.write_json_atomic(out + ".summary.json", summary, indent=1)
    if not kept:  # stage 3 would have nothing to train on: said now, not at its start
        raise DataError(f"the stage-3 filter kept none of {summary['total']} problems: the policy solved every one "
                        f"{run.filter.k}/{run.filter.k} (summary: {out}.summary.json); no dataset written")
    files.write_jsonl_atomic(out, kept, ensure_ascii=False)
    if len(kept) < run.rl.prompts_per_step:
        log.warning("the stage-3 filter kept %d problems, fewer than one stage-3 step's %d prompts "
                    "(--config.rl.prompts_per_step)", len(kept), run.rl.prompts_per_step)
    # the progress file stays: a rerun of the same command (same problems, settings, policy)
    # rewrites this dataset from it instead of rolling out every problem again
    print(f"rstarjax: stage-3 filter: kept {summary['kept']} of {summary['total']} problems "
          f"({summary['dropped_all_correct']} solved {run.filter.k}/{run.filter.k} dropped) -> {out}", flush=True)
    return summary
