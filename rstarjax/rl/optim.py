"""Optimizer for the policy: AdamW, linear warmup then constant LR, global-norm clipping.

rStar2-Agent §4.3 / §5.1: learning rate 1e-6; the verl defaults the paper builds on add a short
linear warmup, weight decay 0.01 and gradient clipping at 1.0. Weight decay applies to every
parameter, as torch.optim.AdamW over ``module.parameters()`` does in verl (no norm/bias mask),
so a run here can be compared with a verl run step for step.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-6
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0  # <= 0 disables clipping
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"Adam betas must lie in [0, 1), got b1={self.b1} b2={self.b2}")

    @classmethod
    def from_config(cls, optim_cfg) -> "OptimConfig":
        """From the ``config.optim`` ConfigDict (only the fields this dataclass knows)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(optim_cfg).items() if k in names})


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from lr/warmup to lr over ``warmup_steps`` updates, then constant.

    Step s (0-based count of updates already applied) uses lr * min(1, (s + 1) / warmup): the
    first update is already non-zero (as torch's LambdaLR warmup in verl), the ``warmup``-th
    reaches the full rate.
    """
    lr = cfg.learning_rate
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(lr)

    def schedule(count):
        frac = jnp.minimum(1.0, (count + 1) / cfg.warmup_steps)
        return lr * frac

    return schedule


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) -> AdamW(schedule, weight_decay) (decoupled decay)."""
    adamw = optax.adamw(
        learning_rate=lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.grad_clip_norm and cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw
