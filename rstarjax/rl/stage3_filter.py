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

log = logging.getLogger(__name__)


def solve_counts(trajectories, num_groups: int) -> list[tuple[int, int]]:
    """(correct, total) rollouts per group_id in [0, num_groups)."""
    counts = [[0, 0] for _ in range(num_groups)]
    for t in trajectories:
        if not 0 <= t.group_id < num_groups:
            raise ValueError(f"trajectory group_id={t.group_id} outside [0, {num_groups})")
        counts[t.group_id][0] += int(t.reward > 0)
        counts[t.group_id][1] += 1
    return [tuple(c) for c in counts]


def keep_problem(correct: int, total: int, k: int) -> bool:
    """Drop a problem only when all k rollouts were correct (§4.3: "remove problems with all 8
    correct"); a problem whose rollouts did not all come back is an error, never silently kept.
    A rollout ended by an infrastructure error counts as not correct: the problem is kept (a hard
    problem wrongly dropped is lost; an easy one wrongly kept costs a little stage-3 compute)."""
    if total != k:
        raise ValueError(f"expected {k} rollouts for a problem, got {total}")
    return correct < k


def filter_problems(records: Sequence[dict], rollout_fn: Callable, k: int, batch_prompts: int, seed: int,
                    progress: Callable[[int], None] | None = None) -> tuple[list[dict], dict]:
    """Run k rollouts per problem in batches of ``batch_prompts`` and keep the unsolved ones.

    Returns (kept records, each with an added ``"stage2_pass_rate"``; summary counts).
    """
    kept: list[dict] = []
    hist = [0] * (k + 1)  # problems by number of correct rollouts
    infra = 0
    for start in range(0, len(records), batch_prompts):
        chunk = list(records[start:start + batch_prompts])
        out = rollout_fn(chunk, k, seed + start, -1)
        trajs = out[0] if isinstance(out, tuple) else out
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


def run_filter(config, workdir: str, rollout_fn: Callable | None = None, model=None) -> dict:
    """The ``filter`` mode of rstarjax.main (single process writes; see docs/training.md)."""
    import jax
    import tqdm

    from rstarjax.rl import checkpoint as ckpt_lib
    from rstarjax.rl import data as data_lib
    from rstarjax.rl import trainer as trainer_lib

    if jax.process_count() > 1:
        raise NotImplementedError("the stage-3 filter runs on one process (rollouts are the cost; "
                                  "use one host with a larger serving mesh)")
    records, report = data_lib.load_problems(config.data.train_path)
    if rollout_fn is None:
        mesh = trainer_lib.build_mesh(config)
        model = model if model is not None else trainer_lib.build_model(config, mesh)
        if config.checkpoint.init_from:
            from flax import nnx

            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            shardings = jax.tree.map(lambda x: x.sharding, params)
            params, _, step = ckpt_lib.restore_params(config.checkpoint.init_from,
                                                      ckpt_lib.abstract_like(params, shardings))
            model = nnx.merge(graphdef, params, rest)
            log.info("filtering with the policy of step %d from %s", step, config.checkpoint.init_from)
        from rstarjax.rl import agent_loop
        from rstarjax.rl import sft as sft_lib

        tokenizer = sft_lib.build_tokenizer(config)
        sft_lib.check_vocab(model, tokenizer)
        rollout_fn = agent_loop.make_rollout_fn(config, model, tokenizer=tokenizer,
                                                fmt=sft_lib.chat_format(config.rl.get("chat_format", "rstar2")))
        owned = rollout_fn
    else:
        owned = None
    bar = tqdm.tqdm(total=len(records), desc="filter", disable=not config.logging.progress_bar)
    try:
        kept, summary = filter_problems(records, rollout_fn, config.filter.k, config.filter.batch_prompts,
                                        config.seed, progress=bar.update)
    finally:
        bar.close()
        if owned is not None and hasattr(owned, "close"):
            owned.close()
    summary["data_report"] = str(report)
    out = config.filter.output_path or os.path.join(workdir, "filtered.jsonl")
    write_jsonl_atomic(out, kept)
    with open(out + ".summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    log.info("stage-3 filter: kept %d of %d problems -> %s", summary["kept"], summary["total"], out)
    return summary
