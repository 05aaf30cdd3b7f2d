"""One GRPO-RoC step (``rl_step``), reading the ``rl`` config section (``rl.config.RLConfig``).

    records -> rollouts (2G each; agent_loop) -> batch filter + RoC keeps G (selection)
            -> advantages (eq. 7; advantages) -> TrainBatch (batch) -> update (eq. 6; trainer)

The stage around it (data, checkpoints, the rollout engine's weights) is ``recipes/rl.py``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import numpy as np

from rstarjax import processes
from rstarjax.rl import advantages as adv_lib
from rstarjax.rl import loss as loss_lib
from rstarjax.rl import metrics as metrics_lib
from rstarjax.rl.batch import TrainBatch, build_train_batch
from rstarjax.rl.config import RLConfig
from rstarjax.rl.partial import CollectedRound, PartialRollouts, fresh_token_mask, policy_lag_metrics
from rstarjax.rl.selection import informative_groups, select_groups, selection_metrics
from rstarjax.rl.trainer import Trainer
from rstarjax.rl.trajectory import RolloutFn, trajectories_of

PAD_ID = 0  # value of padding tokens; never attended to (segment 0) nor trained on (mask 0)

log = logging.getLogger(__name__)


def _update_anywhere(has_rows: bool, num_rows: int) -> bool:
    """Whether any process has a group to train on, after checking that every process brings the
    same number of rows (the global batch is their concatenation, split evenly over the
    devices). One small all-gather, outside rollout."""
    got = processes.allgather(np.asarray([has_rows, num_rows], np.int64))
    rows = got[:, 1].tolist()
    if len(set(rows)) > 1:
        raise ValueError(f"processes bring different row counts {rows} to the update: every process "
                         "needs the same number of prompts per step (rl.prompts_per_step / processes)")
    return bool(got[:, 0].any())


def _round_seed(seed: int, round_index: int) -> int:
    """Round 0 keeps the step's seed (dynamic sampling off/on give the same first rollouts)."""
    if round_index == 0:
        return seed
    return int(np.random.default_rng([seed, round_index]).integers(0, 2**31 - 1))


def _relabel(trajs, offset: int) -> list:
    """Copies with ``group_id += offset``: groups of different rounds stay distinct."""
    return [dataclasses.replace(t, group_id=int(t.group_id) + offset) for t in trajs]


def _prompt_text(records: list, traj) -> str:
    """What a trajectory was asked: its record's problem, else its prompt's token ids."""
    gid = int(traj.group_id)
    record = records[gid] if 0 <= gid < len(records) else None
    if isinstance(record, Mapping) and record.get("problem"):
        return str(record["problem"])
    return f"prompt ids {np.asarray(traj.prompt_ids).tolist()}"


def group_token_ids(trajectories, placements, num_rows: int, seq_len: int) -> np.ndarray:
    """int32[num_rows, seq_len]: the group of each token, where ``batch.build_train_batch`` placed
    its trajectory (``placements``; a truncated one as cut, packed rows holding several): 1 + the
    rank of its ``group_id`` among the trajectories' (a group is its prompt's kept rollouts,
    the ids ``advantages.trajectory_advantages`` groups by); 0 = no trajectory (padding).
    loss.token_mean="group" divides each group's token sum by its own tokens (eq. 6)."""
    ids = np.zeros((num_rows, seq_len), np.int32)
    rank: dict[int, int] = {}
    for traj, place in zip(trajectories, placements):
        gid = rank.setdefault(int(traj.group_id), len(rank) + 1)
        ids[place.row, place.start:place.start + place.length] = gid
    return ids


def _empty_train_batch(num_rows: int, seq_len: int) -> TrainBatch:
    """All-padding TrainBatch (mask 0 everywhere): a step where no group carried a signal."""
    z = np.zeros((num_rows, seq_len), np.float32)
    zi = np.zeros((num_rows, seq_len), np.int32)
    return TrainBatch(tokens=zi + PAD_ID, positions=zi.copy(), segment_ids=zi.copy(), loss_mask=z,
                      old_logprobs=z.copy(), advantages=z.copy(), rollout_logprobs=z.copy())


def rl_step(trainer: Trainer, rollout_fn: RolloutFn | None, records: list, cfg: RLConfig, loss_cfg: loss_lib.LossConfig,
            seed: int, more_records: Callable[[], list] | None = None,
            before_update: Callable[[], None] | None = None,
            serving_dtype: str | None = None, stale_rollouts: bool = False,
            partial: PartialRollouts | CollectedRound | None = None) -> dict[str, float]:
    """One GRPO-RoC step on this process's prompts: rollouts (2G each) -> batch filter (rollouts
    ended by infrastructure errors excluded, equal-reward groups rejected) -> RoC keeps G ->
    advantages (``loss_cfg.advantage_estimator``, eq. 7) -> TrainBatch -> update. Returns host
    metrics (rollout + filter + train).

    Multi-process runs split by prompt group: ``records`` are this process's share of the step's
    prompts (``io.data.host_shard``: every ``process_count``-th record, the same count on every
    process), and all 2G rollouts of a prompt are made, filtered, RoC-selected and given their
    advantages here, so group statistics always see whole groups. Rollout runs on this
    process's devices only (``ColocatedRollouts``); the only cross-process steps are the update
    (``trainer.train`` on the global batch: the processes' rows concatenated in process order)
    and small all-gathers of flags (whether to update; with dynamic sampling, whether to refill).
    Every process brings ``len(records) * G`` rows: the
    rows of rejected or missing groups are padding with loss mask 0 (zero weight), so the row
    count never depends on what the filters kept (``trainer.skip_padding`` skips their compute).

    Rejected groups are not refilled (the official trainer's behaviour): their rows are padding
    (loss mask 0), so eq. 6's denominator counts only the kept groups' tokens. When no process has
    a group left, no update runs (``trainer.step`` does not advance; the caller draws new data).
    With the trainer's ``loss.token_mean="group"`` it gets each token's group too
    (``group_token_ids``: eq. 6's token mean per group).

    With ``cfg.dynamic_sampling`` (DAPO): groups whose kept rewards are all equal are
    dropped, and while fewer than ``len(records)`` informative groups are held (on any process)
    and fewer than ``cfg.dynamic_sampling_max_rounds`` rounds ran, ``more_records()`` (the next
    prompts of the data iterator; None or StopIteration ends the refill) gets rolled out too.
    Extra informative groups beyond the quota are discarded (first come first kept). A shortfall
    after the last round is padded with empty rows (loss mask 0): the batch keeps its configured
    [len(records) * G, L] shape and the eq.-6 denominator counts only real tokens.

    ``before_update`` runs after the last rollout and before the update (only when one runs):
    e.g. the colocated engine frees its serving memory (``serving.release_during_update``).

    ``serving_dtype`` (the dtype the rollouts were served in): count the trained tokens whose
    sampler and trainer log-probs differ by more than ``metrics.gap_threshold_of`` it and the
    trainer's forward dtypes (the coarser side's; ``train/logprob_gap_tokens_over``), and when
    both sides compute in float32 warn with the step and the affected trajectories' prompts when
    any does; in any dtypes, warn when the batch's mean k3 KL between the two
    (``train/logprob_gap_kl``) passes ``metrics.logprob_gap_kl_level``, which a sampler / trainer
    temperature mismatch does and rounding noise does not (docs/metrics.md).

    Partial rollouts (``rl.partial_rollout_tokens``; ``partial`` a ``rl.partial.PartialRollouts``,
    which rolls out in place of ``rollout_fn``): ``records`` are the prompts this step starts (at
    most its ``room``); the step trains at most ``groups_per_update`` complete groups, new or
    carried, oldest first, padded to that many. The log-prob gap is measured on the tokens the
    current policy sampled (``fresh_token_mask``). A ``rl.partial.CollectedRound`` (partial
    rollouts a rollout thread ran) is one such step's rollouts, already collected. The rollout
    source says which (``rl.sources.StepRound``).

    ``stale_rollouts`` (asynchronous rollouts, ``rl.staleness``): ``rollout_fn`` returns a round an
    older policy may have sampled; the step reports its lag (``async/policy_lag_*``) and measures
    the log-prob gap on the current policy's tokens only.
    """
    quota = partial.groups_per_update if partial is not None else len(records)
    num_rows = quota * cfg.group_size
    estimator = loss_cfg.advantage_estimator
    forward_dtypes = getattr(trainer, "forward_dtypes", ())
    gap_threshold = None if serving_dtype is None else metrics_lib.gap_threshold_of(serving_dtype, forward_dtypes)
    gap_kl_level = None if serving_dtype is None else metrics_lib.logprob_gap_kl_level(serving_dtype, forward_dtypes)
    t0 = time.perf_counter()
    all_records = []  # every round's records: a trajectory's group_id indexes them
    all_trajs, all_kept, groups, extras, selections = [], [], [], [], []
    dropped, rounds, offset, batch_records = 0, 0, 0, records
    while True:
        if partial is None:
            out = rollout_fn(batch_records, cfg.rollouts_per_prompt, _round_seed(seed, rounds),
                             trainer.policy_version)
            trajs, extra = trajectories_of(out), (out[1] if isinstance(out, tuple) else {})
        else:  # the groups that completed, whenever they started
            batch_records, trajs, extra = partial.collect(batch_records, cfg.rollouts_per_prompt, seed,
                                                          trainer.policy_version)
        selection = select_groups(trajs, len(batch_records), cfg, _round_seed(seed, rounds))
        selections.append(selection)
        all_records += list(batch_records)
        kept = selection.kept
        rounds += 1
        if offset:
            trajs, kept = _relabel(trajs, offset), _relabel(kept, offset)
        offset += len(batch_records)
        all_trajs += trajs
        all_kept += kept
        extras.append(extra)
        if not cfg.dynamic_sampling:
            groups.append(kept)
            break
        informative, _ = informative_groups(kept, estimator, cfg.length_penalty_coef)
        dropped += len(batch_records) - len(informative)  # rejected, short or uninformative
        groups += informative
        short = len(groups) < quota
        if rounds >= cfg.dynamic_sampling_max_rounds or more_records is None or not processes.any_process(short):
            break
        try:
            batch_records = more_records()
        except StopIteration:  # finite data ran out: train on what was collected
            break
    t1 = time.perf_counter()
    train_trajs = [t for g in groups[:quota] for t in g] if cfg.dynamic_sampling else groups[0]
    if train_trajs:
        # eq. 7 per group (+ optional Kimi length reward)
        _, adv = adv_lib.trajectory_advantages(train_trajs, estimator, cfg.length_penalty_coef)
        batch, layout = build_train_batch(train_trajs, adv, seq_len=cfg.seq_len, pad_id=PAD_ID, num_rows=num_rows,
                                          overlong_filter=cfg.overlong_filter)
    else:
        batch, layout = _empty_train_batch(num_rows, cfg.seq_len), None
    metrics, gap_mask, group_ids = {}, None, None
    if getattr(getattr(trainer, "loss_cfg", None), "token_mean", None) == "group":  # eq. 6's per-group means
        group_ids = (np.zeros((num_rows, cfg.seq_len), np.int32) if layout is None
                     else group_token_ids(train_trajs, layout.placements, num_rows, cfg.seq_len))
    if partial is not None or stale_rollouts:
        metrics.update(policy_lag_metrics(train_trajs, trainer.policy_version, "async/" if stale_rollouts else "partial/"))
        if layout is not None:
            gap_mask = fresh_token_mask(train_trajs, layout.placements, trainer.policy_version, num_rows, cfg.seq_len,
                                        kept_kv=partial is not None and partial.keeps_kv)
    metrics.update(metrics_lib.rollout_metrics(all_trajs, prefix="rollout_all/"))
    metrics.update(metrics_lib.group_metrics(all_trajs, prefix="rollout_all/"))
    metrics.update(metrics_lib.rollout_metrics(train_trajs or all_kept, prefix="rollout/"))
    metrics.update(metrics_lib.roc_metrics(all_trajs, all_kept))
    metrics.update(selection_metrics(selections))
    if cfg.dynamic_sampling:
        n_groups = min(len(groups), quota)
        metrics.update({"dynamic_sampling/rounds": float(rounds),
                        "dynamic_sampling/groups_dropped": float(dropped),
                        "dynamic_sampling/groups_trained": float(n_groups),
                        "dynamic_sampling/groups_padded": float(quota - n_groups),
                        "dynamic_sampling/groups_surplus": float(max(len(groups) - quota, 0))})
    t2 = time.perf_counter()
    update = _update_anywhere(bool(train_trajs), num_rows)
    metrics["filter/updated"] = float(update)
    if update:
        if before_update is not None:
            before_update()
        denom = None
        if estimator == "dr_grpo":  # Dr. GRPO's constant: the configured sequences of one update x max length
            rows_per_update = processes.global_rows(num_rows) // trainer.cfg.mini_batches
            denom = loss_lib.dr_grpo_denominator(rows_per_update, cfg.max_response_len)
        elif loss_cfg.micro_batch_rows == "configured":  # verl: the rows sampled per update, before RoC
            denom = float(processes.global_rows(quota * cfg.rollouts_per_prompt) // trainer.cfg.mini_batches)
        train_kw = {} if group_ids is None else {"group_ids": group_ids}
        metrics.update(trainer.train(batch, denom=denom, gap_threshold=gap_threshold, gap_mask=gap_mask, **train_kw))
        over = int(metrics.get("train/logprob_gap_tokens_over", 0))
        if over and gap_threshold == metrics_lib.LOGPROB_GAP_THRESHOLDS["float32"]:  # both sides float32
            hit = [] if layout is None else metrics_lib.trajectories_at(
                layout.placements, trainer.logprob_gap_outliers)
            prompts = [_prompt_text(all_records, train_trajs[i]) for i in hit]
            log.warning(metrics_lib.logprob_gap_alarm(trainer.step, over, gap_threshold,
                                                      list(dict.fromkeys(prompts))))
        if gap_kl_level is not None and "train/logprob_gap_kl" in metrics:  # bf16 included: see the level
            kl_warning = metrics_lib.logprob_gap_kl_warning(trainer.step, metrics["train/logprob_gap_kl"],
                                                            gap_kl_level)
            if kl_warning:
                log.warning(kl_warning)
    t3 = time.perf_counter()
    timings = {"rollout": t1 - t0, "prepare": t2 - t1, "train": t3 - t2}
    metrics.update(metrics_lib.throughput_metrics(int(sum(len(t.response_ids) for t in all_trajs)), timings))
    # the rollout function's own figures (engine / scheduler / tool timings), already namespaced:
    # the first round's, with timings ("timing/...") summed over the rounds of a dynamic-sampling step
    for i, extra in enumerate(extras):
        for k, v in extra.items():
            if not isinstance(v, (int, float, np.number)):
                continue
            if i == 0:
                metrics[k] = float(v)
            elif k.startswith("timing/"):
                metrics[k] = metrics.get(k, 0.0) + float(v)
    if "timing/tool_exec_wait_s" in metrics:
        metrics["time/tools"] = float(metrics["timing/tool_exec_wait_s"])
    return metrics


@dataclasses.dataclass
class EmptyBatchStreak:
    """Rollout batches in a row that left no group to train on (``rl_step`` ran no update), and
    what their groups were, from each batch's ``filter/`` metrics (``selection_metrics``).

    Such a streak has two causes that call for opposite answers. Groups whose rewards were all
    equal (all-correct, all-wrong, or equal once RoC kept G) are the data and the policy: the
    stage has nothing left to learn from what it draws and ends cleanly. Groups left short of
    rollouts by infrastructure errors point at a broken environment (``infra_failing``): an
    infrastructure failure is never blamed on the model."""

    limit: int  # rl.max_rejected_batches
    batches: int = 0
    groups: float = 0.0
    all_correct: float = 0.0
    all_wrong: float = 0.0
    infra_short: float = 0.0

    def observe(self, metrics: Mapping[str, float]) -> bool:
        """Count one batch that trained no group; whether the streak has reached ``limit``."""
        groups = float(metrics.get("filter/groups", 0.0))
        self.batches += 1
        self.groups += groups
        self.all_correct += groups * float(metrics.get("filter/rejected_all_correct_frac", 0.0))
        self.all_wrong += groups * float(metrics.get("filter/rejected_all_wrong_frac", 0.0))
        self.infra_short += float(metrics.get("filter/infra_short_groups", 0.0))
        return self.batches >= self.limit

    def reset(self) -> None:
        """A batch trained: the streak is over."""
        self.batches, self.groups, self.all_correct, self.all_wrong, self.infra_short = 0, 0.0, 0.0, 0.0, 0.0

    @property
    def infra_failing(self) -> bool:
        """Whether infrastructure errors left a group of the streak short of rollouts."""
        return self.infra_short > 0

    @property
    def all_correct_only(self) -> bool:
        """Whether every rejected group of the streak was all-correct (the policy solved them)."""
        return self.all_correct > 0 and self.all_wrong == 0 and not self.infra_failing

    def shares(self) -> str:
        """The groups of the streak by kind, in percent: "70% all-wrong, 30% all-correct"."""
        total = max(self.groups, 1.0)
        other = max(self.groups - self.all_wrong - self.all_correct - self.infra_short, 0.0)
        parts = [f"{100 * self.all_wrong / total:.0f}% all-wrong", f"{100 * self.all_correct / total:.0f}% all-correct"]
        if other:
            parts.append(f"{100 * other / total:.0f}% equal once RoC kept G")
        if self.infra_short:
            parts.append(f"{100 * self.infra_short / total:.0f}% short of rollouts by infrastructure errors")
        return ", ".join(parts)
