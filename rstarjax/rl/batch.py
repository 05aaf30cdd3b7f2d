"""TrainBatch: fixed-shape padded (optionally packed) arrays built from Trajectories.

Layout of one sequence (prompt + response) placed at columns [start, start + n) of a row:

    column        start ...          start+P-1 | start+P ...                 start+n-1
    tokens        prompt ids                    | response ids (model + tool segments)
    loss_mask     0                             | 1 on MODEL tokens, 0 on TOOL tokens
    old_logprobs  0                             | sampler log-prob of that token (0 on TOOL)
    advantages    0                             | the rollout's advantage (0 on prompt / padding)
    positions     0 ... P-1                     | P ... n-1          (restart at 0 per sequence)
    segment_ids   k (1-based sequence index within the row; 0 = padding)

Position t holds target token t and the log-prob of predicting it from t-1 (docs/design.md):
the loss gathers logits[:, t-1] for tokens[:, t] (``loss.token_logprobs``). Every sequence starts
with at least one prompt token (loss mask 0), so a packed segment boundary is never trained on.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax
import numpy as np

from rstarjax.rl.trajectory import Trajectory

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
    """docs/design.md TrainBatch; all arrays [B, L]."""

    tokens: np.ndarray  # int32
    positions: np.ndarray  # int32, restart at 0 for every packed sequence
    segment_ids: np.ndarray  # int32, 1.. per sequence in the row, 0 = padding
    loss_mask: np.ndarray  # f32
    old_logprobs: np.ndarray  # f32, sampler log-probs (trainer may overwrite with a recomputation)
    advantages: np.ndarray  # f32
    rollout_logprobs: np.ndarray  # f32, sampler log-probs kept for truncated IS (LossConfig.tis_cap)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def num_loss_tokens(self) -> float:
        return float(np.asarray(self.loss_mask, np.float64).sum())

    def rows(self, start: int, stop: int) -> "TrainBatch":
        """Rows [start, stop): a micro-batch (the loss denominator stays the full batch's)."""
        return jax.tree.map(lambda a: a[start:stop], self)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where trajectory i landed: row, first column, length, and whether it was cut."""

    row: int
    start: int
    length: int
    truncated: bool


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    placements: tuple[Placement, ...]
    num_rows: int
    seq_len: int

    @property
    def num_truncated(self) -> int:
        return sum(p.truncated for p in self.placements)

    @property
    def fill(self) -> float:
        """Fraction of the [B, L] cells that hold real tokens."""
        return sum(p.length for p in self.placements) / max(1, self.num_rows * self.seq_len)


def _advantage_per_token(adv, n_resp: int, i: int) -> np.ndarray:
    a = np.asarray(adv, np.float32)
    if a.ndim == 0:
        return np.full(n_resp, a, np.float32)
    if a.shape != (n_resp,):
        raise ValueError(f"advantages[{i}] has shape {a.shape}, expected a scalar or ({n_resp},)")
    return a


def pack_first_fit(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence lengths into rows of seq_len (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def build_train_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence,
    seq_len: int,
    pad_id: int,
    pack: bool = False,
    truncate: bool = False,
    num_rows: int | None = None,
    overlong_filter: bool = False,
) -> tuple[TrainBatch, BatchLayout]:
    """TrainBatch plus where each trajectory went.

    advantages[i]: a scalar (broadcast over trajectory i's response) or a per-response-token array.
    A sequence longer than ``seq_len`` raises ValueError unless ``truncate=True``, in which case the
    response tail is cut (placement.truncated = True, logged); a prompt that alone fills seq_len
    always raises. ``num_rows`` pads with empty rows to a fixed B (error if more are needed).
    ``overlong_filter`` (DAPO) zeroes the loss mask of trajectories whose finish is MAX_LENGTH.
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    if not trajectories:
        raise ValueError("no trajectories")
    if seq_len < 2:
        raise ValueError("seq_len must be >= 2")

    seqs = []  # (tokens, mask, logprobs, adv, truncated)
    for i, (t, adv) in enumerate(zip(trajectories, advantages)):
        prompt = np.asarray(t.prompt_ids, np.int32)
        if prompt.size == 0:
            raise ValueError(f"trajectory {i} has an empty prompt (position 0 would be trained on)")
        if prompt.size >= seq_len:
            raise ValueError(f"trajectory {i}: prompt of {prompt.size} tokens leaves no room in seq_len={seq_len}")
        resp = t.response_ids
        mask = t.loss_mask
        lp = t.sampled_logprobs
        a = _advantage_per_token(adv, resp.size, i)
        if not np.all(np.isfinite(a)) or not np.all(np.isfinite(lp)):
            raise ValueError(f"trajectory {i}: non-finite advantage or log-prob")
        if lp.size and lp.max() > 1e-3:  # probabilities or logits passed by mistake
            raise ValueError(f"trajectory {i}: sampled log-probs must be <= 0, got max {lp.max():.4g}")
        if overlong_filter and t.truncated:
            mask = np.zeros_like(mask)
        cut = False
        room = seq_len - prompt.size
        if resp.size > room:
            if not truncate:
                raise ValueError(
                    f"trajectory {i}: {prompt.size}+{resp.size} tokens exceed seq_len={seq_len} "
                    "(pass truncate=True to cut the response tail)"
                )
            resp, mask, lp, a = resp[:room], mask[:room], lp[:room], a[:room]
            cut = True
        zeros = np.zeros(prompt.size, np.float32)
        seqs.append(
            (
                np.concatenate([prompt, resp]),
                np.concatenate([zeros, mask]),
                np.concatenate([zeros, lp]),
                np.concatenate([zeros, a]),
                cut,
            )
        )
    n_cut = sum(s[4] for s in seqs)
    if n_cut:
        log.warning("make_train_batch: truncated %d of %d sequences to seq_len=%d", n_cut, len(seqs), seq_len)

    lengths = [len(s[0]) for s in seqs]
    row_members = pack_first_fit(lengths, seq_len) if pack else [[i] for i in range(len(seqs))]
    b = len(row_members) if num_rows is None else num_rows
    if len(row_members) > b:
        raise ValueError(f"need {len(row_members)} rows but num_rows={num_rows}")

    tokens = np.full((b, seq_len), pad_id, np.int32)
    positions = np.zeros((b, seq_len), np.int32)
    segment_ids = np.zeros((b, seq_len), np.int32)
    loss_mask = np.zeros((b, seq_len), np.float32)
    old_lp = np.zeros((b, seq_len), np.float32)
    adv_arr = np.zeros((b, seq_len), np.float32)
    placements: list[Placement | None] = [None] * len(seqs)
    for r, members in enumerate(row_members):
        col = 0
        for k, i in enumerate(members, start=1):
            tok, m, lp, a, cut = seqs[i]
            n = len(tok)
            sl = slice(col, col + n)
            tokens[r, sl] = tok
            positions[r, sl] = np.arange(n, dtype=np.int32)
            segment_ids[r, sl] = k
            loss_mask[r, sl] = m
            old_lp[r, sl] = lp
            adv_arr[r, sl] = a
            placements[i] = Placement(row=r, start=col, length=n, truncated=cut)
            col += n
    batch = TrainBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        loss_mask=loss_mask,
        old_logprobs=old_lp,
        advantages=adv_arr,
        rollout_logprobs=old_lp.copy(),
    )
    return batch, BatchLayout(placements=tuple(placements), num_rows=b, seq_len=seq_len)


def make_train_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence,
    seq_len: int,
    pad_id: int,
    pack: bool = False,
    truncate: bool = False,
    num_rows: int | None = None,
    overlong_filter: bool = False,
) -> TrainBatch:
    """``build_train_batch`` without the layout (see there)."""
    return build_train_batch(
        trajectories, advantages, seq_len, pad_id, pack=pack, truncate=truncate, num_rows=num_rows,
        overlong_filter=overlong_filter,
    )[0]
