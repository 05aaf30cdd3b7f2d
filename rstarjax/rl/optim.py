"""Optimizers and learning-rate schedules: AdamW with global-norm clipping, for RL (linear warmup
then constant) and for SFT (linear warmup then cosine decay).

rStar2-Agent §4.3 / §5.1: RL learning rate 1e-6; the verl defaults the paper builds on add a short
linear warmup, weight decay 0.01 and gradient clipping at 1.0. SFT: lr 5e-6, 4 % warm-up, cosine
decay. Weight decay applies to every parameter, as torch.optim.AdamW over ``module.parameters()``
does in verl (no norm/bias mask), so a run here can be compared with a verl run step for step.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from rstarjax.validation import require


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The ``optim`` section (the RL optimizer)."""

    learning_rate: float = 1e-6
    warmup_steps: int = 20
    # False (the paper): the warmup's first rollout step already runs at lr/warmup_steps; True
    # (the official profile, verl's scheduler): it runs at rate 0 (``lr_schedule``)
    warmup_from_zero: bool = False
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0  # <= 0 disables clipping
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        finite = math.isfinite
        require((finite(self.learning_rate) and self.learning_rate > 0,
                 f"learning_rate={self.learning_rate} must be a finite number > 0"),
                (self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0"),
                (finite(self.weight_decay) and self.weight_decay >= 0,
                 f"weight_decay={self.weight_decay} must be a finite number >= 0"),
                (finite(self.eps) and self.eps > 0, f"eps={self.eps} must be a finite number > 0"),
                (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0,
                 f"b1={self.b1} and b2={self.b2} (Adam's betas) must lie in [0, 1)"))


def lr_schedule(cfg: OptimConfig, updates_per_step: int = 1) -> optax.Schedule:
    """RL: linear warmup over ``warmup_steps`` rollout steps, then constant (rStar2-Agent §5.1:
    "linear warm-up over 20 rollout steps").

    The update(s) of rollout step k (0-based, counted from the optimizer's start) use
    lr * min(1, (k + 1) / warmup): every warmup step moves the weights, the last of the
    ``warmup`` reaches the full rate. With ``warmup_from_zero`` (the official profile) they use
    lr * min(1, k / warmup), exactly verl's ``get_constant_schedule_with_warmup`` stepped once
    per rollout step after its update (verl/utils/torch_functional.py; workers/fsdp_workers.py
    ``update_actor``): the first step's rate is 0, so its update only fills Adam's moments.
    ``updates_per_step`` is the trainer's ``mini_batches``: the updates of one rollout step share
    its rate. The argument is the schedule's own count of updates, which a skipped update
    (non-finite, or an empty mini-batch of a step that trains) still advances
    (``advance_schedule``), as verl's scheduler steps whether or not the optimizer did.
    """
    lr = cfg.learning_rate
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(lr)
    first = 0 if cfg.warmup_from_zero else 1

    def schedule(count):
        rollout_step = count // updates_per_step
        return lr * jnp.minimum(1.0, (rollout_step + first) / cfg.warmup_steps)

    return schedule


def advance_schedule(opt_state, by=1):
    """``opt_state`` with its learning-rate schedule's count moved on by ``by`` updates and nothing
    else (Adam's moments and bias-correction count kept): a skipped update keeps its place in
    the schedule, as verl steps its scheduler whether or not the optimizer stepped. A state
    without a schedule (a constant rate) is returned as it is."""
    def bump(state):
        if isinstance(state, optax.ScaleByScheduleState):
            return state._replace(count=state.count + by)
        return state
    return jax.tree.map(bump, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def cosine_with_warmup(step, total_steps: int, peak_lr: float, warmup_ratio: float = 0.04,
                       min_lr_ratio: float = 0.0):
    """SFT (rStar2-Agent §5.1): linear warm-up over ``warmup_ratio`` of the steps
    (``int(warmup_ratio * total_steps)``, as verl's SFT trainer), then cosine decay to
    ``peak_lr * min_lr_ratio``.

    Exactly verl's / transformers' ``get_cosine_schedule_with_warmup`` (LambdaLR semantics: the
    update after ``step`` previous updates uses lr(step); warm-up starts at 0), so a run here can
    be compared with a verl SFT run step for step. Works on Python numbers and jax scalars (it is
    the optax schedule)."""
    warmup = int(warmup_ratio * total_steps)
    step = jnp.asarray(step, jnp.float32)
    warm = step / max(warmup, 1)
    progress = (step - warmup) / max(total_steps - warmup, 1)
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    frac = jnp.where(step < warmup, warm, jnp.maximum(0.0, cosine))
    return peak_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * frac)


def adamw(schedule, weight_decay: float, grad_clip_norm: float, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip_norm) -> AdamW(schedule, weight_decay) (decoupled decay);
    ``grad_clip_norm`` <= 0: no clipping."""
    opt = optax.adamw(learning_rate=schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if grad_clip_norm and grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(grad_clip_norm), opt)
    return opt


def make_optimizer(cfg: OptimConfig, updates_per_step: int = 1) -> optax.GradientTransformation:
    """The RL optimizer: ``adamw`` on ``lr_schedule``."""
    return adamw(lr_schedule(cfg, updates_per_step), cfg.weight_decay, cfg.grad_clip_norm,
                 cfg.b1, cfg.b2, cfg.eps)
