"""The policy trainer: one jitted, sharded, micro-batched GRPO-RoC update (rStar2-Agent eq. 6).

State lives outside the NNX module (``nnx.split``): ``TrainState(params, opt_state, step)`` is a
plain pytree, so it can be jitted with explicit in/out shardings, donated, checkpointed by Orbax
and sent to the rollout engine in memory.

Micro-batching is exact: every micro-batch's loss is divided by the token count of the *whole*
(mini-)batch, so the sum of the micro-batch gradients equals the full-batch gradient of eq. 6
(whose normaliser is ``sum_i |o_i|`` over the batch), whatever the split.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rstarjax.models import sharding as sharding_lib
from rstarjax.rl import loss as loss_lib

BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask", "old_logprobs", "advantages",
              "rollout_logprobs")
REF_KEY = "ref_logprobs"  # log pi_ref per target token, added by Trainer.train when kl_coef > 0


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    micro_batch_size: int = 0  # global rows per micro-batch; 0 = the whole mini-batch at once
    mini_batches: int = 1  # optimizer updates per rollout batch (verl's ppo_mini_batch split)
    # Cast params to this dtype before the forward (f32 master copy kept); None leaves the
    # precision to the model (ModelConfig.dtype already computes in bf16 from f32 params).
    compute_dtype: str | None = None
    recompute_old_logprobs: bool = True  # old log-probs from a trainer forward, not the sampler

    def __post_init__(self):
        if self.micro_batch_size < 0:
            raise ValueError(f"micro_batch_size must be >= 0, got {self.micro_batch_size}")
        if self.mini_batches < 1:
            raise ValueError(f"mini_batches must be >= 1, got {self.mini_batches}")
        if self.compute_dtype is not None:
            jnp.dtype(self.compute_dtype)  # raises on an unknown dtype name

    @classmethod
    def from_config(cls, trainer_cfg) -> "TrainerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(trainer_cfg).items() if k in names})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any  # nnx.State of nnx.Param, float32 master weights
    opt_state: Any  # optax state
    step: jax.Array  # int32 scalar: optimizer updates applied so far


def cast_floating(tree, dtype):
    """Cast floating leaves (params) to the compute dtype; gradients flow back in f32."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def batch_to_dict(batch) -> dict[str, jax.Array]:
    """TrainBatch (dataclass) or mapping -> dict of the six arrays the step consumes."""
    get = batch.get if isinstance(batch, Mapping) else (lambda k, d=None: getattr(batch, k, d))
    missing = [k for k in BATCH_KEYS[:-1] if get(k) is None]
    if missing:
        raise ValueError(f"TrainBatch lacks {missing}")
    out = {k: get(k) for k in BATCH_KEYS}
    if out["rollout_logprobs"] is None:  # sampler log-probs, kept apart for truncated IS
        out["rollout_logprobs"] = out["old_logprobs"]
    shapes = {k: tuple(np.shape(v)) for k, v in out.items()}
    if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
        raise ValueError(f"TrainBatch arrays must all be [B, L]; got {shapes}")
    return out


def split_micro_batches(x: jax.Array, num_micro: int) -> jax.Array:
    """[B, ...] -> [num_micro, B / num_micro, ...] taking rows with stride ``num_micro``.

    Strided (row r goes to micro-batch r % num_micro) so that, with rows sharded contiguously
    over devices, every device holds an equal part of every micro-batch: all devices work on
    each micro-step.
    """
    b = x.shape[0]
    if b % num_micro:
        raise ValueError(f"batch of {b} rows is not divisible into {num_micro} micro-batches")
    return jnp.swapaxes(x.reshape((b // num_micro, num_micro) + x.shape[1:]), 0, 1)


def forward_logprobs(graphdef, rest, params, batch: Mapping[str, jax.Array], compute_dtype):
    """Log-prob of each target token under ``params`` and the entropy at its position, [B, L]."""
    if compute_dtype is not None:
        params = cast_floating(params, compute_dtype)
    model = nnx.merge(graphdef, params, rest)
    # f32 log-softmax from the hidden states, the vocabulary a chunk at a time (never [B, L, V])
    return model.token_logprobs(batch["tokens"], positions=batch["positions"],
                                segment_ids=batch["segment_ids"])


def step_keys(loss_cfg) -> tuple[str, ...]:
    """The batch arrays one update reads: ``BATCH_KEYS``, plus the reference policy's log-probs
    when the KL term is on (so a run without KL carries no extra [B, L] array)."""
    return BATCH_KEYS + (REF_KEY,) if loss_cfg.kl_coef > 0 else BATCH_KEYS


def make_train_step(graphdef, rest, optimizer: optax.GradientTransformation, loss_cfg, num_micro: int,
                    compute_dtype=None, micro_sharding: NamedSharding | None = None):
    """Pure ``(TrainState, batch dict) -> (TrainState, metrics)``: one optimizer update.

    The policy-loss normaliser is the whole batch's loss-mask sum (eq. 6's sum_i |o_i|), so the
    micro-batch gradients add up to the full-batch gradient exactly. With ``loss_cfg.kl_coef > 0``
    the batch must also hold ``ref_logprobs`` (the frozen reference policy's, no gradient).
    """
    keys = step_keys(loss_cfg)

    def micro_loss(params, micro, denom):
        logprobs, entropy = forward_logprobs(graphdef, rest, params, micro, compute_dtype)
        return loss_lib.policy_loss(
            logprobs, micro["old_logprobs"], micro["advantages"], micro["loss_mask"], denom, loss_cfg,
            ref_logprobs=micro.get(REF_KEY), rollout_logprobs=micro["rollout_logprobs"], entropy=entropy,
            segment_ids=micro["segment_ids"],
        )

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: Mapping[str, jax.Array], denom: jax.Array):
        """``denom`` <= 0: eq. 6's token count of this batch; > 0: a given constant (Dr. GRPO)."""
        batch = {k: batch[k] for k in keys}
        denom = jnp.where(denom > 0, denom, jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0))
        micros = {k: split_micro_batches(v, num_micro) for k, v in batch.items()}
        if micro_sharding is not None:
            micros = jax.lax.with_sharding_constraint(micros, micro_sharding)
        zero_grads = jax.tree.map(jnp.zeros_like, state.params)

        def body(carry, micro):
            grads, loss_sum, metric_sum = carry
            (loss, metrics), g = grad_fn(state.params, micro, denom)
            grads = jax.tree.map(jnp.add, grads, g)
            metric_sum = jax.tree.map(jnp.add, metric_sum, metrics)
            return (grads, loss_sum + loss, metric_sum), None

        metric_shapes = jax.eval_shape(lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micros), denom))
        zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes[0][1])
        (grads, loss, metrics), _ = jax.lax.scan(body, (zero_grads, jnp.float32(0.0), zero_metrics), micros)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # Loss-module metrics that are token sums over ``denom`` add up exactly across micro-steps.
        metrics = dict(metrics)
        metrics.update(loss=loss, grad_norm=grad_norm, tokens=denom)
        return TrainState(params, opt_state, state.step + 1), metrics

    return step


def logprob_gap(sampled: np.ndarray, recomputed: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Mismatch between the sampler's and the trainer's log-probs on trained tokens.

    ``logprob_gap_abs``: mean |difference|; ``logprob_gap_kl``: mean of the k3 estimator of
    KL(sampler || trainer), exp(d) - 1 - d with d = trainer - sampler (>= 0, unbiased).
    """
    mask = np.asarray(mask, np.float64)
    n = max(mask.sum(), 1.0)
    d = (np.asarray(recomputed, np.float64) - np.asarray(sampled, np.float64)) * mask
    return {
        "logprob_gap_abs": float(np.abs(d).sum() / n),
        "logprob_gap_max": float(np.abs(d).max()) if d.size else 0.0,
        "logprob_gap_kl": float(((np.exp(d) - 1.0 - d) * mask).sum() / n),
    }


class Trainer:
    """Owns the train state on the mesh and the jitted step.

    ``trainer.train(batch)`` runs ``mini_batches`` updates on one rollout batch (after an optional
    old-log-prob recompute) and returns host metrics. ``trainer.model()`` rebuilds an NNX module
    that views the current params (what the colocated rollout engine serves).
    """

    def __init__(self, model: nnx.Module, optim_cfg, loss_cfg, cfg: TrainerConfig, mesh: Mesh | None = None,
                 optimizer: optax.GradientTransformation | None = None):
        from rstarjax.rl import optim as optim_lib

        self.cfg = cfg
        self.loss_cfg = loss_cfg
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(1, -1, 1)
        self.optimizer = optimizer if optimizer is not None else optim_lib.make_optimizer(optim_cfg)
        self._schedule = optim_lib.lr_schedule(optim_cfg) if optimizer is None else None
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.param_sharding = sharding_lib.state_shardings(params, self.mesh)
        self.batch_sharding = sharding_lib.batch_sharding(self.mesh)
        self.replicated = NamedSharding(self.mesh, P())
        abstract_opt = jax.eval_shape(self.optimizer.init, params)
        opt_sharding = optax.tree_utils.tree_map_params(
            self.optimizer, lambda _, s: s, abstract_opt, self.param_sharding,
            transform_non_params=lambda _: self.replicated,
        )
        self.state_sharding = TrainState(self.param_sharding, opt_sharding, self.replicated)
        params = jax.device_put(params, self.param_sharding)
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sharding)(params)
        self.state = TrainState(params, opt_state, jax.device_put(jnp.int32(0), self.replicated))
        self._steps: dict[int, Callable] = {}
        self._logprob_fns: dict[int, Callable] = {}
        # The frozen reference policy of the KL term (k3, ``loss_cfg.kl_coef > 0``): a copy of the
        # initial params unless ``set_reference`` replaces it. None (no memory) without the KL.
        self.ref_params = self._copy_params(params) if loss_cfg.kl_coef > 0 else None

    # ------------------------------------------------------------------ jitted functions
    @property
    def data_parallel_size(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def _num_micro(self, rows: int) -> int:
        mbs = self.cfg.micro_batch_size or rows
        if rows % mbs:
            raise ValueError(f"mini-batch of {rows} rows is not a multiple of micro_batch_size={mbs}")
        if mbs % self.data_parallel_size:
            raise ValueError(f"micro_batch_size={mbs} must be a multiple of data*fsdp="
                             f"{self.data_parallel_size} devices")
        return rows // mbs

    def _batch_shardings(self, keys=BATCH_KEYS) -> dict[str, NamedSharding]:
        return {k: self.batch_sharding for k in keys}

    def _copy_params(self, params):
        """A fresh on-mesh copy (the train step donates ``state``, so the reference may not alias it)."""
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda p: jax.tree.map(jnp.copy, p), in_shardings=(self.param_sharding,),
                           out_shardings=self.param_sharding)(params)

    def set_reference(self, params=None) -> None:
        """Make ``params`` (default: the current policy) the KL term's frozen reference.

        Only meaningful with ``loss_cfg.kl_coef > 0``; otherwise no reference is kept and this
        raises, so a misconfigured run does not silently hold a second copy of the weights.
        """
        if self.loss_cfg.kl_coef <= 0:
            raise ValueError("set_reference needs loss.kl_coef > 0 (without the KL term no reference is kept)")
        params = self.state.params if params is None else params
        self.ref_params = self._copy_params(jax.device_put(params, self.param_sharding))

    def _micro_sharding(self) -> NamedSharding:
        # [M, B/M, L]: each micro-batch's rows are spread over all data-parallel devices
        return NamedSharding(self.mesh, P(None, *self.batch_sharding.spec))

    def step_fn(self, rows: int) -> Callable:
        """The jitted ``(state, batch, denom) -> (state, metrics)`` for ``rows``-row mini-batches."""
        num_micro = self._num_micro(rows)
        if num_micro not in self._steps:
            step = make_train_step(self.graphdef, self.rest, self.optimizer, self.loss_cfg, num_micro,
                                   self.cfg.compute_dtype, self._micro_sharding())
            self._steps[num_micro] = jax.jit(
                step,
                in_shardings=(self.state_sharding, self._batch_shardings(step_keys(self.loss_cfg)),
                              self.replicated),
                out_shardings=(self.state_sharding, self.replicated),
                donate_argnums=(0,),
            )
        return self._steps[num_micro]

    def logprob_fn(self, rows: int) -> Callable:
        """Jitted ``(params, batch) -> log-probs [B, L]``, micro-batched like the step."""
        num_micro = self._num_micro(rows)
        if num_micro not in self._logprob_fns:
            micro_sharding = self._micro_sharding()
            graphdef, rest, dtype = self.graphdef, self.rest, self.cfg.compute_dtype

            def fn(params, batch):
                micros = {k: split_micro_batches(batch[k], num_micro) for k in BATCH_KEYS}
                micros = jax.lax.with_sharding_constraint(micros, micro_sharding)
                lp = jax.lax.map(lambda m: forward_logprobs(graphdef, rest, params, m, dtype)[0], micros)
                return jnp.swapaxes(lp, 0, 1).reshape(batch["tokens"].shape)  # undo the strided split

            self._logprob_fns[num_micro] = jax.jit(
                fn, in_shardings=(self.param_sharding, self._batch_shardings()),
                out_shardings=self.batch_sharding,
            )
        return self._logprob_fns[num_micro]

    # ------------------------------------------------------------------ host API
    def put_batch(self, batch) -> dict[str, jax.Array]:
        """Host arrays -> global arrays on the mesh.

        Single process: the full batch. Multi-process: each process passes *its own* rows (its
        data shard); the global batch is their concatenation in process order.
        """
        arrays = batch_to_dict(batch)
        if jax.process_count() == 1:
            return {k: jax.device_put(np.asarray(v), self.batch_sharding) for k, v in arrays.items()}
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in arrays.items()}

    def compute_logprobs(self, batch: Mapping[str, jax.Array], params=None) -> jax.Array:
        """Log-probs of ``batch``'s tokens under ``params`` (default the current policy), [B, L]."""
        params = self.state.params if params is None else params
        with jax.set_mesh(self.mesh):
            return self.logprob_fn(batch["tokens"].shape[0])(params, {k: batch[k] for k in BATCH_KEYS})

    def train(self, batch, denom: float | None = None) -> dict[str, float]:
        """Old log-probs (optionally recomputed), then ``mini_batches`` optimizer updates.

        ``batch``: a TrainBatch / mapping of host arrays (this process's rows) or the dict
        ``put_batch`` returned. ``denom``: a constant loss normaliser (Dr. GRPO); default the
        token count of each mini-batch (eq. 6).
        """
        batch = dict(batch) if _is_global(batch) else self.put_batch(batch)
        batch = {k: batch[k] for k in BATCH_KEYS}
        metrics: dict[str, float] = {}
        if self.cfg.recompute_old_logprobs:
            recomputed = self.compute_logprobs(batch)
            metrics.update(_gap_on_device(batch["rollout_logprobs"], recomputed, batch["loss_mask"]))
            batch["old_logprobs"] = recomputed
        if self.loss_cfg.kl_coef > 0:
            if self.ref_params is None:
                raise ValueError("kl_coef > 0 but the trainer holds no reference params (set_reference)")
            # same jitted forward as the old-log-prob recompute, outside the gradient
            batch[REF_KEY] = self.compute_logprobs(batch, self.ref_params)
        rows = batch["tokens"].shape[0]
        n = self.cfg.mini_batches
        if rows % n:
            raise ValueError(f"batch of {rows} rows does not split into mini_batches={n}")
        denom_arr = jax.device_put(jnp.float32(denom if denom else 0.0), self.replicated)
        per_update = []
        with jax.set_mesh(self.mesh):
            for i in range(n):
                # contiguous mini-batches (verl's order); each has its own token-mean normaliser
                mini = batch
                if n > 1:
                    mini = {k: v[i * rows // n:(i + 1) * rows // n] for k, v in batch.items()}
                    mini = jax.device_put(mini, self._batch_shardings(tuple(batch)))
                self.state, m = self.step_fn(rows // n)(self.state, mini, denom_arr)
                per_update.append(m)
        host = jax.device_get(per_update)
        for k in host[0]:
            metrics[f"train/{k}"] = float(np.mean([h[k] for h in host]))
        metrics["train/step"] = self.step
        metrics["train/lr"] = self.learning_rate()
        return metrics

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    def learning_rate(self) -> float:
        """The rate the last update used, from the optimizer's own schedule count (which restarts
        when the optimizer is reset); nan when a custom optimizer was passed."""
        if self._schedule is None:
            return float("nan")
        counts = optax.tree_utils.tree_get_all_with_path(self.state.opt_state, "count")
        count = max(int(jax.device_get(c)) for _, c in counts) if counts else self.step
        return float(self._schedule(max(count - 1, 0)))

    def reset_optimizer(self) -> None:
        """Fresh optimizer state (rStar2-Agent §4.3, stage 3); the step counter is kept."""
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_sharding.opt_state)(
                self.state.params)
        self.state = TrainState(self.state.params, opt_state, self.state.step)

    def model(self) -> nnx.Module:
        """An NNX module over the current params (no copy)."""
        return nnx.merge(self.graphdef, self.state.params, self.rest)


def _is_global(batch) -> bool:
    return isinstance(batch, Mapping) and all(isinstance(batch.get(k), jax.Array) for k in BATCH_KEYS)


@jax.jit
def _gap_sums(sampled, recomputed, mask):
    d = (recomputed - sampled) * mask
    return jnp.sum(jnp.abs(d)), jnp.max(jnp.abs(d)), jnp.sum((jnp.exp(d) - 1.0 - d) * mask), jnp.sum(mask)


def _gap_on_device(sampled, recomputed, mask) -> dict[str, float]:
    """``logprob_gap`` computed where the (possibly multi-process) arrays live."""
    s_abs, s_max, s_kl, n = jax.device_get(_gap_sums(sampled, recomputed, mask))
    n = max(float(n), 1.0)
    return {"train/logprob_gap_abs": float(s_abs) / n, "train/logprob_gap_max": float(s_max),
            "train/logprob_gap_kl": float(s_kl) / n}


# ============================================================================ the RL loop
# A rollout function: (problem records of this process, rollouts per prompt, seed, policy version)
# -> Trajectories with ``group_id`` = index of the record in the list (optionally with a dict of
# timing / stats figures). The real one wraps rl/agent_loop.run_rollouts on the serving engine;
# tests pass deterministic stand-ins.
RolloutFn = Callable[[list, int, int, int], Any]

PAD_ID = 0  # value of padding tokens; never attended to (segment 0) nor trained on (mask 0)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The rollout-side numbers of one RL step (config.rl), rStar2-Agent §2.2.3 / §4.3."""

    prompts_per_step: int = 512  # global, over all processes
    group_size: int = 16  # G
    oversample: int = 32  # 2G
    max_prompt_len: int = 2048
    max_response_len: int = 8192
    roc: bool = True  # False: the paper's GRPO baseline, G rollouts per prompt, all trained
    roc_variant: str = "paper"
    # per-class floors of roc_variant="topk" (the official run script's values)
    roc_min_negatives: int = 2
    roc_min_positives: int = 2
    # rStar2-Agent §4.3 / the official run script: groups whose rewards are all equal are dropped
    # before RoC, without refilling (advantages.is_equal_reward_group)
    reject_equal_reward: bool = True
    # consecutive rollout batches with nothing left to train before the run stops with an error
    max_rejected_batches: int = 20
    # DAPO dynamic sampling (loss.dynamic_sampling): rollout rounds per step at most, the first
    # included (verl's max_num_gen_batches); 1 = drop zero-variance groups without refilling.
    dynamic_sampling_max_rounds: int = 3

    def __post_init__(self):
        if self.dynamic_sampling_max_rounds < 1:
            raise ValueError(f"rl.dynamic_sampling_max_rounds must be >= 1, got {self.dynamic_sampling_max_rounds}")
        if self.max_rejected_batches < 1:
            raise ValueError(f"rl.max_rejected_batches must be >= 1, got {self.max_rejected_batches}")

    @property
    def seq_len(self) -> int:
        return self.max_prompt_len + self.max_response_len

    @property
    def rollouts_per_prompt(self) -> int:
        """2G with RoC (it keeps G of them); G for the GRPO baseline, which trains on all it samples."""
        return self.oversample if self.roc else self.group_size

    @classmethod
    def from_config(cls, rl) -> "RLConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(rl).items() if k in names})


@dataclasses.dataclass
class Selection:
    """What ``select_groups`` kept of one rollout round, and why the other groups went."""

    kept: list  # trajectories to train on, G per kept group, in group order
    groups: int = 0  # groups rolled out
    all_correct: int = 0  # rejected before RoC: every rollout correct (§4.3 "perfect pass rate")
    all_wrong: int = 0  # rejected before RoC: every rollout wrong
    equal_after_roc: int = 0  # rejected after RoC: the G it kept have equal rewards (paper variant)
    short: int = 0  # fewer than G rollouts left once infrastructure errors are excluded
    infra_trajectories: int = 0  # rollouts ended by an infrastructure error (never trained on)

    @property
    def rejected(self) -> int:
        return self.all_correct + self.all_wrong + self.equal_after_roc

    @property
    def trained(self) -> int:
        return self.groups - self.rejected - self.short


def select_groups(trajectories, num_groups: int, cfg: RLConfig, seed: int) -> Selection:
    """Per prompt group: exclude rollouts ended by an infrastructure error, reject equal-reward
    groups (``cfg.reject_equal_reward``), then RoC keeps G (or, without RoC, the G rollouts).

    A group left with fewer than G rollouts after the exclusion is dropped (counted ``short``).
    With the paper's RoC a mixed group of 2G with a single failure keeps no negative (floor(1/2)
    = 0): its G rewards are equal and, with ``reject_equal_reward``, it is rejected after RoC.
    """
    from rstarjax.rl import advantages as adv_lib
    from rstarjax.rl import roc as roc_lib

    groups: dict[int, list] = {g: [] for g in range(num_groups)}
    for t in trajectories:
        if t.group_id not in groups:
            raise ValueError(f"trajectory group_id={t.group_id} outside [0, {num_groups})")
        groups[t.group_id].append(t)
    out = Selection(kept=[], groups=num_groups)
    for g, trajs in groups.items():
        if len(trajs) != cfg.rollouts_per_prompt:
            raise ValueError(f"group {g} has {len(trajs)} rollouts, expected {cfg.rollouts_per_prompt} "
                             f"({'oversample' if cfg.roc else 'group_size'})")
        valid = [t for t in trajs if not t.infra_error]
        out.infra_trajectories += len(trajs) - len(valid)
        if len(valid) < cfg.group_size:
            out.short += 1
            continue
        rewards = [float(t.reward) for t in valid]
        if cfg.reject_equal_reward and adv_lib.is_equal_reward_group(rewards):
            if rewards[0] > 0:
                out.all_correct += 1
            else:
                out.all_wrong += 1
            continue
        if cfg.roc:
            idx = roc_lib.roc_select(valid, cfg.group_size, np.random.default_rng([seed, g]), variant=cfg.roc_variant,
                                     min_negatives=cfg.roc_min_negatives, min_positives=cfg.roc_min_positives)
        else:
            idx = range(cfg.group_size)
        kept = [valid[i] for i in idx]
        if cfg.reject_equal_reward and adv_lib.is_equal_reward_group([t.reward for t in kept]):
            out.equal_after_roc += 1
            continue
        out.kept.extend(kept)
    return out


def selection_metrics(selections: list[Selection]) -> dict[str, float]:
    """``filter/``: what the batch filter did over a step's rollout rounds (fractions of groups)."""
    groups = max(sum(s.groups for s in selections), 1)
    total = lambda name: float(sum(getattr(s, name) for s in selections))  # noqa: E731
    return {
        "filter/groups": total("groups"),
        "filter/groups_trained": total("trained"),
        "filter/rejected_frac": total("rejected") / groups,
        "filter/rejected_all_correct_frac": total("all_correct") / groups,
        "filter/rejected_all_wrong_frac": total("all_wrong") / groups,
        "filter/rejected_after_roc": total("equal_after_roc"),
        "filter/infra_short_groups": total("short"),
        "filter/infra_trajectories": total("infra_trajectories"),
    }


def informative_groups(kept, loss_cfg) -> tuple[list[list], int]:
    """DAPO dynamic sampling filter (Yu et al. 2025 eq. 11; ``advantages.is_informative_group``)
    over RoC-kept trajectories: (groups whose eq.-7 rewards are not all equal, number dropped).

    Applied AFTER RoC, on the rewards the advantages see (answer reward + optional Kimi length
    reward): RoC can turn a mixed 2G group into an all-correct G (one wrong rollout, n_neg = 0),
    which has zero advantage everywhere just like an all-equal 2G group.
    """
    from rstarjax.rl import advantages as adv_lib

    by_group: dict[int, list] = {}
    for t in kept:
        by_group.setdefault(int(t.group_id), []).append(t)
    keep, dropped = [], 0
    for _, trajs in sorted(by_group.items()):
        shaped, _ = adv_lib.trajectory_advantages(trajs, std_normalize=loss_cfg.std_normalize,
                                                  length_penalty_coef=loss_cfg.length_penalty_coef)
        if adv_lib.is_informative_group(shaped):
            keep.append(trajs)
        else:
            dropped += 1
    return keep, dropped


def _any_process(flag: bool) -> bool:
    """True if ``flag`` is True on any process: every process must run the same number of rollout
    rounds (the colocated engine is a collective), so the refill decision is global."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def _round_seed(seed: int, round_index: int) -> int:
    """Round 0 keeps the step's seed (dynamic sampling off/on give the same first rollouts)."""
    if round_index == 0:
        return seed
    return int(np.random.default_rng([seed, round_index]).integers(0, 2**31 - 1))


def _relabel(trajs, offset: int) -> list:
    """Copies with ``group_id += offset``: groups of different rounds stay distinct."""
    return [dataclasses.replace(t, group_id=int(t.group_id) + offset) for t in trajs]


def _empty_train_batch(num_rows: int, seq_len: int):
    """All-padding TrainBatch (mask 0 everywhere): a step where no group carried a signal."""
    from rstarjax.rl import batch as batch_lib

    z = np.zeros((num_rows, seq_len), np.float32)
    zi = np.zeros((num_rows, seq_len), np.int32)
    return batch_lib.TrainBatch(tokens=zi + PAD_ID, positions=zi.copy(), segment_ids=zi.copy(), loss_mask=z,
                                old_logprobs=z.copy(), advantages=z.copy(), rollout_logprobs=z.copy())


def rl_step(trainer: Trainer, rollout_fn: RolloutFn, records: list, cfg: RLConfig, loss_cfg, seed: int,
            timer=None, more_records: Callable[[], list] | None = None) -> dict[str, float]:
    """One GRPO-RoC step on this process's prompts: rollouts (2G each) -> batch filter (rollouts
    ended by infrastructure errors excluded, equal-reward groups rejected) -> RoC keeps G ->
    advantages (eq. 7) -> TrainBatch -> update. Returns host metrics (rollout + filter + train).

    Rejected groups are not refilled (the official trainer's behaviour): their rows are padding
    (loss mask 0), so eq. 6's denominator counts only the kept groups' tokens. When no process has
    a group left, no update runs (``trainer.step`` does not advance; the caller draws new data).

    With ``loss_cfg.dynamic_sampling`` (DAPO): groups whose kept rewards are all equal are
    dropped, and while fewer than ``len(records)`` informative groups are held (on any process)
    and fewer than ``cfg.dynamic_sampling_max_rounds`` rounds ran, ``more_records()`` (the next
    prompts of the data iterator; None or StopIteration ends the refill) gets rolled out too.
    Extra informative groups beyond the quota are discarded (first come first kept). A shortfall
    after the last round is padded with empty rows (loss mask 0): the batch keeps its configured
    [len(records) * G, L] shape and the eq.-6 denominator counts only real tokens.
    """
    import time as _time

    from rstarjax.rl import advantages as adv_lib
    from rstarjax.rl import batch as batch_lib
    from rstarjax.rl import loss as loss_lib_
    from rstarjax.rl import metrics as metrics_lib

    quota = len(records)
    num_rows = quota * cfg.group_size
    dynamic = bool(getattr(loss_cfg, "dynamic_sampling", False))
    t0 = _time.perf_counter()
    all_trajs, all_kept, groups, extras, selections = [], [], [], [], []
    dropped, rounds, offset, batch_records = 0, 0, 0, records
    while True:
        out = rollout_fn(batch_records, cfg.rollouts_per_prompt, _round_seed(seed, rounds), trainer.step)
        trajs, extra = (out if isinstance(out, tuple) else (out, {}))
        selection = select_groups(trajs, len(batch_records), cfg, _round_seed(seed, rounds))
        selections.append(selection)
        kept = selection.kept
        rounds += 1
        if offset:
            trajs, kept = _relabel(trajs, offset), _relabel(kept, offset)
        offset += len(batch_records)
        all_trajs += trajs
        all_kept += kept
        extras.append(extra)
        if not dynamic:
            groups.append(kept)
            break
        informative, _ = informative_groups(kept, loss_cfg)
        dropped += len(batch_records) - len(informative)  # rejected, short or uninformative
        groups += informative
        short = len(groups) < quota
        if rounds >= cfg.dynamic_sampling_max_rounds or more_records is None or not _any_process(short):
            break
        try:
            batch_records = more_records()
        except StopIteration:  # finite data ran out: train on what was collected
            break
    t1 = _time.perf_counter()
    train_trajs = [t for g in groups[:quota] for t in g] if dynamic else groups[0]
    if train_trajs:
        _, adv = adv_lib.trajectory_advantages(  # eq. 7 per group (+ optional Kimi length reward)
            train_trajs, std_normalize=loss_cfg.std_normalize, length_penalty_coef=loss_cfg.length_penalty_coef)
        batch = batch_lib.make_train_batch(train_trajs, adv, seq_len=cfg.seq_len, pad_id=PAD_ID,
                                           num_rows=num_rows, overlong_filter=loss_cfg.overlong_filter)
    else:
        batch = _empty_train_batch(num_rows, cfg.seq_len)
    metrics = {}
    metrics.update(metrics_lib.rollout_metrics(all_trajs, prefix="rollout_all/"))
    metrics.update(metrics_lib.group_metrics(all_trajs, prefix="rollout_all/"))
    metrics.update(metrics_lib.rollout_metrics(train_trajs or all_kept, prefix="rollout/"))
    metrics.update(metrics_lib.roc_metrics(all_trajs, all_kept))
    metrics.update(selection_metrics(selections))
    if dynamic:
        n_groups = min(len(groups), quota)
        metrics.update({"dynamic_sampling/rounds": float(rounds),
                        "dynamic_sampling/groups_dropped": float(dropped),
                        "dynamic_sampling/groups_trained": float(n_groups),
                        "dynamic_sampling/groups_padded": float(quota - n_groups),
                        "dynamic_sampling/groups_surplus": float(max(len(groups) - quota, 0))})
    t2 = _time.perf_counter()
    update = _any_process(bool(train_trajs))
    metrics["filter/updated"] = float(update)
    if update:
        denom = None
        if loss_cfg.dr_grpo:  # Dr. GRPO's constant: the configured sequences of one update x max length
            rows_per_update = num_rows * jax.process_count() // trainer.cfg.mini_batches
            denom = loss_lib_.loss_denominator(batch.loss_mask, loss_cfg, num_sequences=rows_per_update,
                                               max_response_len=cfg.max_response_len)
        metrics.update(trainer.train(batch, denom=denom))
    t3 = _time.perf_counter()
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


def build_mesh(config) -> Mesh:
    return sharding_lib.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)


def build_model(config, mesh: Mesh) -> nnx.Module:
    """The policy: HF checkpoint at config.model.hf_path, or (model.random_init) a preset with
    random weights (tests, demos)."""
    from rstarjax.models import ModelConfig, Qwen3

    dtype = jnp.dtype(config.model.dtype)
    if not config.model.random_init:
        from rstarjax.models import load_hf
        return load_hf(config.model.hf_path, dtype=dtype, mesh=mesh, remat_policy=config.model.remat_policy)
    cfg = ModelConfig.preset(config.model.preset, dtype=dtype, remat_policy=config.model.remat_policy)
    return sharding_lib.create_sharded_model(lambda: Qwen3(cfg, rngs=nnx.Rngs(config.seed)), mesh)


def build_dataset(config, seed: int | None = None):
    """grain iterator over this process's share of the prompts (repeats when num_epochs == 0),
    shuffled with ``seed`` (default ``config.seed``; ``run_rl`` passes the stage's data seed)."""
    from rstarjax.rl import data as data_lib

    per_process = config.rl.prompts_per_step // jax.process_count()
    ds, report = data_lib.problem_dataset(
        config.data.train_path, per_process, seed=config.seed if seed is None else seed,
        num_epochs=config.data.num_epochs or None, shuffle=config.data.shuffle,
    )
    return ds, report


def stage_data_seed(seed: int, stage_start_step: int) -> int:
    """The data-shuffle seed of a stage that starts at global step ``stage_start_step``: each
    stage of a chain reads its data in a new order (stage 2 must not replay stage 1's), and a
    resumed stage, which records its start, in the same order again. Stage 1 (start 0) uses
    ``seed`` itself."""
    if stage_start_step == 0:
        return int(seed)
    return int(np.random.default_rng([int(seed), int(stage_start_step)]).integers(0, 2**31 - 1))


class StageError(ValueError):
    """A workdir / init_from combination that cannot be resumed or started (the message says why)."""


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def initial_state(trainer: Trainer, ckpt, config) -> dict:
    """Put the stage's starting state into ``trainer`` and return its record (the checkpoint meta
    of a resume, else ``{"step", "stage_start_step", "init_from", ...}``). The hand-off rules:

    * this workdir has a checkpoint of this stage: resume it (params, optimizer, step, RNG key,
      data-iterator state). A workdir holding another stage's checkpoints is refused: each stage
      of a chain gets its own ``--workdir``;
    * else ``checkpoint.init_from`` is an SFT checkpoint (its meta says ``stage: sft``): params
      only; step 0, a fresh optimizer (so the LR warmup runs);
    * else ``init_from`` is an RL checkpoint: params + optimizer state + global step, or with
      ``checkpoint.reset_optimizer`` params + step and a fresh optimizer (its schedule, warmup
      included, restarts with it: rStar2-Agent §4.3 resets the optimizer for stage 3);
    * else the model as built (``model.hf_path`` or the seeded preset), step 0.
    """
    from rstarjax.rl import checkpoint as ckpt_lib

    init_from = os.path.abspath(config.checkpoint.init_from) if config.checkpoint.init_from else ""
    if init_from and _same_dir(init_from, ckpt.directory):
        raise StageError(f"--config.checkpoint.init_from={config.checkpoint.init_from!r} is this run's own "
                         "checkpoint directory: give each stage its own --workdir (a workdir resumes by itself)")
    if ckpt.latest_step() is not None:
        meta = ckpt.read_meta()
        if meta.get("stage") == "sft":
            raise StageError(f"{ckpt.directory} holds an SFT run's checkpoints: give the RL stage its own "
                             "--workdir and start it with --config.checkpoint.init_from=SFT_WORKDIR/checkpoints")
        recorded = meta.get("init_from", "")
        # checkpoints that predate the stage record ("stage" absent) cannot tell: they resume
        if "stage" in meta and init_from and (not recorded or not _same_dir(recorded, init_from)):
            raise StageError(
                f"{ckpt.directory} holds checkpoints of another run (started from "
                f"{recorded or 'the base model'!r}, now at step {ckpt.latest_step()}), not of a stage started "
                f"from {init_from!r}: give this stage a new --workdir")
        abstract = ckpt_lib.abstract_like(trainer.state, trainer.state_sharding)
        trainer.state, meta = ckpt.restore(abstract)
        return dict(meta, resumed=True)
    if not init_from:
        return {"step": 0, "stage_start_step": 0}
    src = ckpt_lib.Checkpointer(init_from, ckpt_lib.CheckpointConfig(async_save=False))
    try:
        src_step = src.latest_step()
        if src_step is None:
            raise StageError(f"--config.checkpoint.init_from={config.checkpoint.init_from!r} holds no finished "
                             "checkpoint (did the previous stage save one?)")
        src_meta = src.read_meta(src_step)
        from_sft = src_meta.get("stage") == "sft"
        if from_sft or config.checkpoint.reset_optimizer:
            abstract = ckpt_lib.abstract_like(trainer.state.params, trainer.param_sharding)
            params, _, _ = ckpt_lib.restore_params(init_from, abstract, step=src_step)
            step = 0 if from_sft else int(src_meta.get("step", src_step))
            trainer.state = TrainState(params, trainer.state.opt_state,
                                       jax.device_put(jnp.int32(step), trainer.replicated))
            trainer.reset_optimizer()
        else:
            abstract = ckpt_lib.abstract_like(trainer.state, trainer.state_sharding)
            trainer.state, _ = src.restore(abstract, step=src_step)
    finally:
        src.close()
    # a new stage reads its data from the start, in a new order (stage_data_seed)
    return {"step": trainer.step, "stage_start_step": trainer.step, "init_from": init_from,
            "init_from_step": int(src_step), "init_from_stage": "sft" if from_sft else "rl"}


def setup_reference(trainer: Trainer, config, meta: dict) -> dict | None:
    """Choose the KL term's frozen reference policy (only with ``loss.kl_coef > 0``) and return
    the record of that choice, saved in every checkpoint's meta as ``"reference"``.

    * default: the initial policy, i.e. the params the trainer was built with (``build_model``:
      the HF weights, or the seeded random preset), before any checkpoint was restored. The
      Trainer copied them at construction;
    * ``checkpoint.update_reference`` (stage 3, rStar2-Agent §4.3): the policy loaded from
      ``checkpoint.init_from`` (the previous stage's latest checkpoint, by its step number).

    The reference is never saved: on resume it is REBUILT deterministically from this record (the
    same initial weights, or ``restore_params(init_from, step)``), so a SIGKILL-resumed run trains
    against the very same reference without doubling the checkpoint size.
    """
    from rstarjax.rl import checkpoint as ckpt_lib

    if config.loss.kl_coef <= 0:
        return None
    if not (config.checkpoint.update_reference and config.checkpoint.init_from):
        return {"source": "initial"}
    record = meta.get("reference")
    if record and record.get("source") == "init_from":  # resuming this stage: the same checkpoint again
        abstract = ckpt_lib.abstract_like(trainer.state.params, trainer.param_sharding)
        params, _, _ = ckpt_lib.restore_params(record["path"], abstract, step=int(record["step"]))
        trainer.set_reference(params)
        return dict(record)
    if "init_from_step" not in meta:
        raise ValueError("update_reference: the run resumed from a checkpoint without a reference "
                         "record; cannot tell which init_from step was the reference")
    trainer.set_reference()  # initial_state just loaded the previous stage's policy
    return {"source": "init_from", "path": os.path.abspath(config.checkpoint.init_from),
            "step": int(meta["init_from_step"])}


def run_rl(config, workdir: str, rollout_fn: RolloutFn | None = None, model: nnx.Module | None = None,
           on_update: Callable[[Trainer], None] | None = None) -> Trainer:
    """The RL entry point: GRPO-RoC updates until the global step reaches ``config.total_steps``,
    resumable from ``workdir``; the stage hand-off rules are ``initial_state``'s.

    ``rollout_fn`` defaults to the agent loop on a colocated serving engine; ``on_update`` is
    called once the starting state is in place (so the very first rollouts sample the restored
    policy) and after every update (the colocated engine takes the new params in memory there).
    """
    from rstarjax.rl import checkpoint as ckpt_lib
    from rstarjax.rl import loss as loss_lib_
    from rstarjax.rl import optim as optim_lib
    from rstarjax.rl import sft as sft_lib

    mesh = build_mesh(config)
    model = model if model is not None else build_model(config, mesh)
    # what rstarjax.export needs to rebuild the model from a checkpoint of this run alone
    tokenizer = sft_lib.build_tokenizer(config)
    if rollout_fn is None or len(tokenizer) <= model.config.vocab_size:
        export_meta = sft_lib.model_meta(model, tokenizer)  # raises when the vocabularies disagree
    else:  # a given rollout function (tests) on a preset whose table fits no tokenizer
        export_meta = {"model_config": model.config.to_hf_dict()}
    loss_cfg = loss_lib_.LossConfig(**dict(config.loss))
    trainer = Trainer(model, optim_lib.OptimConfig.from_config(config.optim), loss_cfg,
                      TrainerConfig.from_config(config.trainer), mesh=mesh)
    rl_cfg = RLConfig.from_config(config.rl)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), ckpt_lib.CheckpointConfig.from_config(config.checkpoint))
    owned_rollouts = rollout_fn is None
    try:
        meta = initial_state(trainer, ckpt, config)
        if owned_rollouts:
            rollout_fn, on_update = make_colocated_rollout_fn(config, trainer)
        return _train_stage(config, workdir, trainer, ckpt, meta, rollout_fn, on_update, rl_cfg, loss_cfg,
                            export_meta)
    finally:
        ckpt.close()  # waits for the last async save
        if owned_rollouts and hasattr(rollout_fn, "close"):
            rollout_fn.close()  # the code-execution pool it started


def _train_stage(config, workdir, trainer, ckpt, meta, rollout_fn, on_update, rl_cfg, loss_cfg,
                 export_meta) -> Trainer:
    """``run_rl``'s loop, from the stage's starting state to ``config.total_steps``."""
    import logging

    import tqdm

    from rstarjax.rl import checkpoint as ckpt_lib
    from rstarjax.rl import metrics as metrics_lib

    log = logging.getLogger(__name__)
    reference = setup_reference(trainer, config, meta)
    stage_start = int(meta.get("stage_start_step", 0))
    data_seed = int(meta.get("data_seed", stage_data_seed(config.seed, stage_start)))
    dataset, _ = build_dataset(config, seed=data_seed)
    data_iter = iter(dataset)
    if meta.get("resumed") and meta.get("data_state") is not None:
        data_iter.set_state(meta["data_state"])
    base_key = ckpt_lib.key_from_json(meta["rng"]) if "rng" in meta else jax.random.key(config.seed)
    if on_update is not None:
        on_update(trainer)  # the engine serves the restored policy from the first rollout on
    stage_record = {"stage": "rl", "init_from": meta.get("init_from", ""),
                    "init_from_step": meta.get("init_from_step"), "stage_start_step": stage_start,
                    "data_seed": data_seed, "stage_total_steps": config.total_steps, **export_meta}

    is_main = jax.process_index() == 0
    writer = metrics_lib.MetricsWriter(os.path.join(workdir, "logs"), enabled=is_main,
                                       tensorboard=config.logging.tensorboard)
    start = trainer.step
    if start >= config.total_steps and is_main:
        print(f"rstarjax: {workdir} is already at global step {start} >= total_steps={config.total_steps}: "
              "nothing to train (raise --config.total_steps to train on)", flush=True)
    bar = tqdm.tqdm(total=config.total_steps, initial=start, disable=not (is_main and config.logging.progress_bar),
                    desc="rl", dynamic_ncols=True)
    rejected_in_a_row = 0
    try:
        while trainer.step < config.total_steps:
            step = trainer.step
            try:
                records = next(data_iter)
            except StopIteration:
                break
            # one seed per (step, process), derived from the run key: same rollouts after a resume,
            # independent samples on every process (and for each batch drawn again at this step)
            step_key = jax.random.fold_in(base_key, step)
            if rejected_in_a_row:
                step_key = jax.random.fold_in(step_key, rejected_in_a_row)
            step_key = jax.random.fold_in(step_key, jax.process_index())
            seed = int(jax.random.randint(step_key, (), 0, 2**31 - 1))
            # dynamic sampling refills from the same iterator, so its checkpointed state covers
            # every prompt a step consumed
            metrics = rl_step(trainer, rollout_fn, records, rl_cfg, loss_cfg, seed,
                              more_records=lambda: next(data_iter))
            if trainer.step == step:  # every group was rejected: no update, as the official trainer
                rejected_in_a_row += 1
                log.warning("step %d: no group of the batch is left to train on (rejected %.0f%%, %d infra-short); "
                            "drawing the next batch", step + 1, 100 * metrics.get("filter/rejected_frac", 0.0),
                            metrics.get("filter/infra_short_groups", 0))
                if rejected_in_a_row >= rl_cfg.max_rejected_batches:
                    raise RuntimeError(
                        f"{rejected_in_a_row} rollout batches in a row left no group to train on at step {step + 1} "
                        "(every group's rewards were equal, or its rollouts hit infrastructure errors): the "
                        "policy solves all or none of these problems, or the environment is failing. Check the "
                        "data and the rollout metrics, or set --config.rl.reject_equal_reward=False")
                continue
            metrics["filter/rejected_batches"] = float(rejected_in_a_row)
            rejected_in_a_row = 0
            if on_update is not None:
                on_update(trainer)
            new_step = trainer.step
            if ckpt.should_save(new_step, config.total_steps):
                ckpt.save(new_step, trainer.state, {
                    "step": new_step, "rng": ckpt_lib.key_to_json(base_key),
                    "data_state": data_iter.get_state(), **stage_record,
                    **({"reference": reference} if reference else {}),
                })
            writer.write(new_step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', 0):.3f}",
                            len=f"{metrics.get('rollout/response_length_mean', 0):.0f}")
    finally:
        bar.close()
        writer.close()
    return trainer


def make_colocated_rollout_fn(config, trainer: Trainer):
    """The agent loop on a serving engine sharing the trainer's devices (kimi k1.5 §4.2 hybrid
    deployment): after each update the engine takes the new params in memory, no copy to disk."""
    from rstarjax.rl import agent_loop
    from rstarjax.rl import sft as sft_lib

    rollout_fn = agent_loop.make_rollout_fn(config, trainer.model(),
                                            fmt=sft_lib.chat_format(config.rl.get("chat_format", "rstar2")))
    return rollout_fn, lambda tr: rollout_fn.update_params(tr.model())
