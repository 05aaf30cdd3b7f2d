"""TrainBatch: fixed-shape padded (optionally packed) arrays built from Trajectories, and the one
packer that lays sequences out in rows (RL trajectories here, SFT conversations in
``recipes/sft.py``).

Layout of one sequence (prompt + response) placed at columns [start, start + n) of a row:

    column        start ...          start+P-1 | start+P ...                 start+n-1
    tokens        prompt ids                    | response ids (model + tool segments)
    loss_mask     0                             | 1 on MODEL tokens, 0 on TOOL tokens
    old_logprobs  0                             | sampler log-prob of that token (0 on TOOL)
    advantages    0                             | the rollout's advantage (0 on prompt / padding)
    positions     0 ... P-1                     | P ... n-1          (restart at 0 per sequence)
    segment_ids   k (1-based sequence index within the row; 0 = padding)

Position t holds target token t and the log-prob of predicting it from t-1 (docs/design.md):
the loss gathers logits[:, t-1] for tokens[:, t] (``models/logprobs.py``). Every sequence starts
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

# The packed-sequence arrays every training batch has (SFT's whole batch) ...
SEQUENCE_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")
# ... and a TrainBatch's (``TrainBatch`` fields, in order).
BATCH_KEYS = SEQUENCE_KEYS + ("old_logprobs", "advantages", "rollout_logprobs")
REF_KEY = "ref_logprobs"  # log pi_ref per target token, added by Trainer.train when loss.kl_coef > 0


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


def place_rows(sequences: Sequence[dict[str, np.ndarray]], rows: Sequence[Sequence[int]], num_rows: int,
               seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """[num_rows, seq_len] arrays with ``sequences[i]`` laid out in the row that ``rows`` gives it,
    one after another from column 0: ``tokens`` (int32, ``pad_id`` elsewhere), each other column
    of the sequences (float32, 0 elsewhere), ``positions`` restarting at 0 per sequence and
    ``segment_ids`` 1.. per sequence in its row (0 = padding)."""
    if len(rows) > num_rows:
        raise ValueError(f"need {len(rows)} rows but num_rows={num_rows}")
    columns = [k for k in (sequences[0] if sequences else {}) if k != "tokens"]
    out = {"tokens": np.full((num_rows, seq_len), pad_id, np.int32),
           "positions": np.zeros((num_rows, seq_len), np.int32),
           "segment_ids": np.zeros((num_rows, seq_len), np.int32)}
    out.update({k: np.zeros((num_rows, seq_len), np.float32) for k in columns})
    for r, members in enumerate(rows):
        col = 0
        for seg, i in enumerate(members, start=1):
            n = len(sequences[i]["tokens"])
            if col + n > seq_len:
                raise ValueError(f"row {r} overflows seq_len={seq_len}")
            span = slice(col, col + n)
            out["positions"][r, span] = np.arange(n, dtype=np.int32)
            out["segment_ids"][r, span] = seg
            for k in ("tokens", *columns):
                out[k][r, span] = sequences[i][k]
            col += n
    return out


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

    seqs, cut = [], []  # per trajectory: its columns, and whether its response was cut
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
        room = seq_len - prompt.size
        cut.append(bool(resp.size > room))
        if cut[-1]:
            if not truncate:
                raise ValueError(
                    f"trajectory {i}: {prompt.size}+{resp.size} tokens exceed seq_len={seq_len} "
                    "(pass truncate=True to cut the response tail)"
                )
            resp, mask, lp, a = resp[:room], mask[:room], lp[:room], a[:room]
        zeros = np.zeros(prompt.size, np.float32)
        seqs.append({"tokens": np.concatenate([prompt, resp]), "loss_mask": np.concatenate([zeros, mask]),
                     "old_logprobs": np.concatenate([zeros, lp]), "advantages": np.concatenate([zeros, a])})
    n_cut = sum(cut)
    if n_cut:
        log.warning("build_train_batch: truncated %d of %d sequences to seq_len=%d", n_cut, len(seqs), seq_len)

    lengths = [len(s["tokens"]) for s in seqs]
    row_members = pack_first_fit(lengths, seq_len) if pack else [[i] for i in range(len(seqs))]
    b = len(row_members) if num_rows is None else num_rows
    arrays = place_rows(seqs, row_members, b, seq_len, pad_id)
    placements: list[Placement | None] = [None] * len(seqs)
    for r, members in enumerate(row_members):
        col = 0
        for i in members:
            placements[i] = Placement(row=r, start=col, length=lengths[i], truncated=cut[i])
            col += lengths[i]
    batch = TrainBatch(rollout_logprobs=arrays["old_logprobs"].copy(), **arrays)
    return batch, BatchLayout(placements=tuple(placements), num_rows=b, seq_len=seq_len)
