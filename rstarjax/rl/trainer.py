"""The trainer core: the policy's state on the mesh and one jitted, sharded, micro-batched update
whose gradient is that of a given per-micro-batch loss (RL: eq. 6; SFT: a masked NLL).

State lives outside the NNX module (``nnx.split``): ``TrainState(params, opt_state, step)`` is a
plain pytree, so it can be jitted with explicit in/out shardings, donated, checkpointed by Orbax
and sent to the rollout engine in memory.

LoRA (``model.config.lora_rank`` > 0, models/lora.py): the trained ``params`` are the adapters
(``nnx.LoRAParam``) only, so the gradient, the optimizer state and the checkpoint cover them
alone; the frozen bf16 base is ``Trainer.frozen``, an argument of every jitted program (never a
constant baked into one), and ``Trainer.model()`` is the merged plain model the rollouts serve.

Micro-batching is exact: every micro-batch's loss is divided by the normaliser of the *whole*
(mini-)batch (its token count, eq. 6's ``sum_i |o_i|``, unless a constant is given), so the sum of
the micro-batch gradients equals the full-batch gradient, whatever the split.

``forward_logprobs`` is the one function that turns (params, batch) into per-token log-probs and
entropies: the update, the old-log-prob recompute and the reference policy all use it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rstarjax import processes
from rstarjax.models import lora as lora_lib
from rstarjax.models import sharding as sharding_lib
from rstarjax.rl import logprob_gap
from rstarjax.rl import loss as loss_lib
from rstarjax.rl import optim as optim_lib
from rstarjax.rl.batch import BATCH_KEYS, REF_KEY
from rstarjax.validation import require

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The ``trainer`` section."""

    micro_batch_size: int = 0  # global rows per micro-batch; 0 = the whole mini-batch at once
    mini_batches: int = 1  # optimizer updates per rollout batch (verl's ppo_mini_batch split)
    # Cast params to this dtype before the forward (f32 master copy kept); None leaves the
    # precision to the model (ModelConfig.dtype already computes in bf16 from f32 params).
    compute_dtype: str | None = None
    recompute_old_logprobs: bool = True  # old log-probs from a trainer forward, not the sampler
    # Micro-batches whose rows are all padding (rejected groups, unused packed rows) skip their
    # forward and backward; ``train`` first moves a mini-batch's real rows into its first
    # micro-batches (``micro_major_order``). False computes every row, as before.
    skip_padding: bool = True
    # An update whose loss, gradient norm or update norm is not finite is skipped (params and
    # optimizer state kept, ``train/skipped_nonfinite`` logged); the RL loop stops after this many
    # steps with a skipped update in a row (a diverged run: retrying only burns compute).
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        require((self.micro_batch_size >= 0, f"micro_batch_size={self.micro_batch_size} must be >= 0 (0 = all rows)"),
                (self.max_nonfinite_steps >= 1, f"max_nonfinite_steps={self.max_nonfinite_steps} must be >= 1"),
                (self.mini_batches >= 1, f"mini_batches={self.mini_batches} must be >= 1"),
                (self.compute_dtype is None or _is_dtype(self.compute_dtype),
                 f"compute_dtype={self.compute_dtype!r} is not a dtype name"))


def _is_dtype(name) -> bool:
    try:
        jnp.dtype(name)
    except TypeError:
        return False
    return True


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
    """TrainBatch (dataclass) or mapping -> dict of the arrays of ``BATCH_KEYS``."""
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


def micro_major_order(nonempty: np.ndarray, *, mini_rows: int, num_micro: int, offset: int = 0) -> np.ndarray:
    """Row order (indices into a block of rows) that puts each mini-batch's real rows into its
    first micro-batches, so that the micro-batches left are all padding and ``skip_padding``
    skips them. Pure, on the host.

    ``nonempty[i]``: whether row i of the block trains any token. The block's row i is row
    ``offset + i`` of the global batch (a multi-process run: this process's rows), whose
    contiguous ``mini_rows``-row slices are the mini-batches, each split by
    ``split_micro_batches`` into ``num_micro`` strided micro-batches (row r -> micro-batch
    r % num_micro, at slot r // num_micro). No row leaves its mini-batch (the mini-batches,
    hence the optimizer updates, are unchanged) and real rows keep their relative order; only
    positions inside a mini-batch change, which leaves its gradient, a sum over its rows, as
    it was (up to float summation order). Within a micro-batch, slots fill in row order, i.e.
    device by device: only whole skipped micro-batches save time (every device computes its
    fixed-shape rows, real or not, in a micro-step that runs)."""
    nonempty = np.asarray(nonempty, bool)
    if mini_rows < 1 or num_micro < 1 or mini_rows % num_micro:
        raise ValueError(f"a mini-batch of {mini_rows} rows does not split into {num_micro} micro-batches")
    rows = offset + np.arange(nonempty.size)
    mini, within = rows // mini_rows, rows % mini_rows
    micro, slot = within % num_micro, within // num_micro
    order = np.arange(nonempty.size)
    for k in np.unique(mini):
        positions = np.flatnonzero(mini == k)
        targets = positions[np.lexsort((slot[positions], micro[positions]))]  # micro-major
        sources = positions[np.argsort(~nonempty[positions], kind="stable")]  # real rows first
        order[targets] = sources
    return order


def forward_logprobs(graphdef, rest, params, batch: Mapping[str, jax.Array], compute_dtype,
                     with_entropy: bool = True, temperature: float = 1.0):
    """Log-prob of each target token under ``params`` and the entropy at its position, [B, L]
    (entropy None with ``with_entropy=False``), of the policy's logits divided by
    ``temperature`` (static; the rollouts' sampling temperature, ``Trainer``)."""
    if compute_dtype is not None:
        params = cast_floating(params, compute_dtype)
    model = nnx.merge(graphdef, params, rest)
    # f32 log-softmax from the hidden states, the vocabulary a chunk at a time (never [B, L, V])
    return model.token_logprobs(batch["tokens"], positions=batch["positions"],
                                segment_ids=batch["segment_ids"], with_entropy=with_entropy,
                                temperature=temperature)


def guarded_update(optimizer: optax.GradientTransformation, params, opt_state, grads, loss):
    """One optimizer update with its non-finite guard -> (params, opt_state, grad_norm,
    update_norm, finite). One scalar says whether the update is usable: inf or nan in the loss
    or either norm makes their sum non-finite. A non-finite update is skipped (params and
    Adam's state stay as they were; the LR schedule moves on, as verl's) but the step still counts, so
    the host loop's clock (metrics, checkpoints, data order, RNG) runs on and it decides when
    to stop.

    The choice is a branch (``lax.cond``), on the device, not an elementwise select: the update
    norm that ``finite`` needs is known only once every update is computed, so a select cannot
    fuse into the update and reads the new and the old parameters and moments once more (on the
    H200 profile of a Qwen3-1.7B step, ~10 of the optimizer's 22 ms were in fusions named for
    it). ``benchmarks/optimizer_guard.py`` compares the two."""
    grad_norm = optax.global_norm(grads)
    updates, new_state = optimizer.update(grads, opt_state, params)
    update_norm = optax.global_norm(updates)
    finite = jnp.isfinite(loss + grad_norm + update_norm)
    params, opt_state = jax.lax.cond(
        finite, lambda: (optax.apply_updates(params, updates), new_state),
        lambda: (params, optim_lib.advance_schedule(opt_state)))  # the schedule moves on regardless
    return params, opt_state, grad_norm, update_norm, finite


# ---- a run that diverged: the updates ``guarded_update`` skipped, counted by the loops ------------
class NonFiniteTraining(RuntimeError):
    """``NonFiniteStreak.limit`` steps in a row had their update skipped as non-finite."""


# the per-update quantities the jitted step checks (``guarded_update``), logged under a prefix
NONFINITE_QUANTITIES = ("loss", "grad_norm", "update_norm")


def nonfinite_quantities(metrics: dict, prefix: str = "train") -> list[str]:
    """The checked quantities of a step's metrics that are inf or nan (a mean over the step's
    updates is nan when any of them was)."""
    keys = [f"{prefix}/{name}" for name in NONFINITE_QUANTITIES]
    return [f"{k.split('/', 1)[1]}={metrics[k]}" for k in keys if k in metrics and not np.isfinite(metrics[k])]


@dataclasses.dataclass
class NonFiniteStreak:
    """Steps in a row whose update the trainer skipped as non-finite (``PREFIX/skipped_nonfinite``),
    and when to give up: a diverged run would otherwise go on skipping every update, burning its
    compute and logging nan, and end as if it had trained. ``prefix``: the metrics' section
    ("train": RL, "sft": SFT); ``flags``: its learning-rate and limit settings, for the error
    (``SECTION.KEY``: the recipes' ``as_flags`` spells them as flags)."""

    limit: int  # trainer.max_nonfinite_steps / sft.max_nonfinite_steps
    prefix: str = "train"
    flags: tuple[str, str] = ("optim.learning_rate", "trainer.max_nonfinite_steps")
    count: int = 0
    first_step: int = 0

    def observe(self, step: int, metrics: dict, last_saved: int | None) -> NonFiniteTraining | None:
        """Count finished step ``step``; the error to raise once ``limit`` are reached in a row."""
        if metrics.get(f"{self.prefix}/skipped_nonfinite", 0.0) <= 0:
            self.count = 0
            return None
        self.count += 1
        self.first_step = self.first_step if self.count > 1 else step
        what = ", ".join(nonfinite_quantities(metrics, self.prefix)) or "update"
        log.warning("step %d: non-finite %s: the update was skipped (%d in a row; the run stops at %d)",
                    step, what, self.count, self.limit)
        if self.count < self.limit:
            return None
        steps = f"step {step}" if self.count == 1 else f"steps {self.first_step}-{step}"
        saved = f"step {last_saved}" if last_saved is not None else "none yet"
        return NonFiniteTraining(
            f"{steps}: {self.count} updates in a row were not finite, the last with {what}; each was "
            f"skipped, so the parameters are still those of step {self.first_step - 1} (newest checkpoint: "
            f"{saved}). The run diverged or its data is bad: lower {self.flags[0]}, check "
            f"the data, or allow more with {self.flags[1]}")


def make_train_step(graphdef, rest, optimizer: optax.GradientTransformation, micro_loss: loss_lib.MicroLoss,
                    num_micro: int, compute_dtype=None, micro_sharding: NamedSharding | None = None,
                    skip_padding: bool = False, temperature: float = 1.0):
    """Pure ``(TrainState, batch dict, denom) -> (TrainState, metrics)``: one optimizer update
    whose gradient is the sum over ``num_micro`` micro-batches of ``micro_loss``'s.

    ``skip_padding``: a micro-batch without a trained token (loss mask all 0) adds nothing to
    the loss, the gradient or the metrics (all masked sums), so the micro-batches after the
    last one with a trained token are skipped (``Trainer.train`` arranges the rows so that
    those are all the padding ones; the count is global, so every device stops together).

    Non-finite guard: an update whose loss, gradient norm or update norm is inf or nan leaves
    the params and optimizer state unchanged; the step counter still advances and the metrics
    say so (``skipped_nonfinite`` = 1, ``update_norm``), so the caller can count and stop.

    ``denom`` <= 0: the normaliser is the batch's loss-mask sum (eq. 6's sum_i |o_i|; SFT's
    token mean); > 0: that constant (Dr. GRPO). Either way it is the WHOLE batch's, so the
    micro-batch gradients add up to the full-batch gradient exactly.

    ``temperature``: the log-probs (and entropy) are the policy's at the rollouts' sampling
    temperature (``forward_logprobs``).
    """

    def loss_of(params, micro, denom):
        logprobs, entropy = forward_logprobs(graphdef, rest, params, micro, compute_dtype, micro_loss.with_entropy,
                                             temperature)
        return micro_loss.fn(logprobs, entropy, micro, denom)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def step(state: TrainState, batch: Mapping[str, jax.Array], denom: jax.Array):
        batch = {k: batch[k] for k in micro_loss.keys}
        if micro_loss.normaliser == "rows":  # loss.token_mean="micro_batch": the batch's trained rows
            default = jnp.sum(jnp.any(batch["loss_mask"] > 0, axis=1).astype(jnp.float32))
        elif micro_loss.normaliser == "sequences":  # GSPO: the batch's trained sequences
            default = loss_lib.trained_sequences(batch["loss_mask"], batch["segment_ids"])
        else:  # eq. 6: the batch's trained tokens
            default = jnp.sum(batch["loss_mask"])
        denom = jnp.where(denom > 0, denom, jnp.maximum(default, 1.0))
        micros = {k: split_micro_batches(v, num_micro) for k, v in batch.items()}
        if micro_sharding is not None:
            micros = jax.lax.with_sharding_constraint(micros, micro_sharding)
        zero_grads = jax.tree.map(jnp.zeros_like, state.params)

        def accumulate(carry, micro):
            grads, loss_sum, metric_sum = carry
            (loss, metrics), g = grad_fn(state.params, micro, denom)
            grads = jax.tree.map(jnp.add, grads, g)
            metric_sum = jax.tree.map(jnp.add, metric_sum, metrics)
            return grads, loss_sum + loss, metric_sum

        metric_shapes = jax.eval_shape(lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micros), denom))
        zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes[0][1])
        init = (zero_grads, jnp.float32(0.0), zero_metrics)
        if skip_padding:
            # Loop up to the last micro-batch with a trained token, each indexed by the loop
            # counter: the ones after it (all of the padding, rows arranged by
            # ``micro_major_order``) never run. (A ``lax.cond`` per micro-step, or an index
            # read from an array, measured slower on CPU.)
            trained = jnp.any(micros["loss_mask"] > 0, axis=tuple(range(1, micros["loss_mask"].ndim)))
            count = jnp.max(jnp.where(trained, jnp.arange(1, num_micro + 1), 0))
            grads, loss, metrics = jax.lax.fori_loop(
                0, count, lambda i, carry: accumulate(
                    carry, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), micros)),
                init)
        else:
            (grads, loss, metrics), _ = jax.lax.scan(lambda c, m: (accumulate(c, m), None), init, micros)
        params, opt_state, grad_norm, update_norm, finite = guarded_update(
            optimizer, state.params, state.opt_state, grads, loss)
        # Loss metrics that are token sums over ``denom`` add up exactly across micro-steps.
        metrics = dict(metrics)
        metrics.update(loss=loss, grad_norm=grad_norm, update_norm=update_norm, tokens=denom,
                       skipped_nonfinite=1.0 - finite.astype(jnp.float32))
        return TrainState(params, opt_state, state.step + 1), metrics

    return step


class Trainer:
    """Owns the train state on the mesh and the jitted update.

    ``trainer.update(batch, micro_loss)`` is one optimizer update of any per-micro-batch loss
    (SFT uses it with ``loss.NLL``). ``trainer.train(batch)`` is the RL update of one rollout
    batch: the old log-probs (optionally recomputed), the reference policy's (with the KL term),
    then ``mini_batches`` updates of eq. 6. ``trainer.model()`` rebuilds an NNX module that views
    the current params (what the colocated rollout engine serves).

    ``loss_cfg`` may be None for a trainer that never runs the RL update (SFT); ``optimizer``
    replaces the one ``optim_cfg`` describes (its learning rate is then not reported).

    ``logit_temperature``: the temperature the rollouts were sampled at (``rl.temperature``).
    Every log-prob the trainer computes (old, reference, the loss's) is of
    ``softmax(logits / logit_temperature)``, the distribution the sampler drew from and whose
    log-probs it recorded (``serving/sampling.py``), as verl's actor divides its logits by the
    rollout temperature. 1.0 (the paper's, and SFT's) changes nothing.
    """

    def __init__(self, model: nnx.Module, optim_cfg: optim_lib.OptimConfig | None,
                 loss_cfg: loss_lib.LossConfig | None, cfg: TrainerConfig, mesh: Mesh | None = None,
                 optimizer: optax.GradientTransformation | None = None, logit_temperature: float = 1.0):
        if not logit_temperature > 0:
            raise ValueError(f"logit_temperature must be > 0 (the rollouts' sampling temperature), "
                             f"got {logit_temperature}")
        self.logit_temperature = float(logit_temperature)
        self.cfg = cfg
        self.loss_cfg = loss_cfg
        # weight sets this trainer made: one per RL update of a rollout batch, whatever its
        # mini-batches (``step`` counts optimizer updates). The unit of rl.max_staleness and of
        # every trajectory's policy_version (AReaL's versions: one per published policy); it
        # counts from 0 in each process, as rollouts in flight never outlive it
        self.policy_version = 0
        self.policy_loss = loss_lib.policy_micro_loss(loss_cfg) if loss_cfg is not None else None
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(1, -1, 1)
        self.optimizer = (optimizer if optimizer is not None
                          else optim_lib.make_optimizer(optim_cfg, cfg.mini_batches))
        self._schedule = optim_lib.lr_schedule(optim_cfg, cfg.mini_batches) if optimizer is None else None
        self.lora = getattr(getattr(model, "config", None), "lora_rank", 0) > 0
        # the dtypes the forward computes in: the model's (ModelConfig.dtype) and, where set, the
        # params' cast (trainer.compute_dtype); the coarser bounds how close its log-probs can
        # come to the sampler's (the log-prob gap alarm, rl/metrics.py)
        model_dtype = getattr(getattr(model, "config", None), "dtype", None)
        self.forward_dtypes = tuple(jnp.dtype(d).name for d in (model_dtype, cfg.compute_dtype) if d is not None)
        # What trains: every parameter, or with LoRA the adapters only; the rest (the frozen
        # base with LoRA, else nothing) goes into every program as its first argument.
        self.graphdef, params, frozen = nnx.split(model, nnx.LoRAParam if self.lora else nnx.Param, ...)
        self.param_sharding = sharding_lib.state_shardings(params, self.mesh)
        self.frozen_sharding = sharding_lib.state_shardings(frozen, self.mesh)
        self.frozen = jax.device_put(frozen, self.frozen_sharding)
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
        self._steps: dict[tuple[int, loss_lib.MicroLoss], Callable] = {}
        self._logprob_fns: dict[int, Callable] = {}
        # (row, column) in the caller's batch of the trained tokens whose sampler / trainer
        # log-prob gap passed ``train``'s ``gap_threshold`` in the last call (the first few).
        self.logprob_gap_outliers = np.zeros((0, 2), np.int64)
        # The frozen reference policy of the KL term (k3, ``loss_cfg.kl_coef > 0``): a copy of the
        # initial params unless ``set_reference`` replaces it. None (no memory) without the KL.
        self.ref_params = self._copy_params(params) if self._kl else None
        # waits that must end before the next update donates ``state`` (``hold_state``)
        self._state_holds: list[Callable[[], object]] = []

    @property
    def _kl(self) -> bool:
        return self.loss_cfg is not None and self.loss_cfg.kl_coef > 0

    # ------------------------------------------------------------------ jitted functions
    @property
    def data_parallel_size(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def num_micro(self, rows: int) -> int:
        """Micro-batches of a ``rows``-row mini-batch (raises when the sizes do not fit)."""
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
        if not self._kl:
            raise ValueError("set_reference needs loss.kl_coef > 0 (without the KL term no reference is kept)")
        params = self.state.params if params is None else params
        self.ref_params = self._copy_params(jax.device_put(params, self.param_sharding))

    def _micro_sharding(self) -> NamedSharding:
        # [M, B/M, L]: each micro-batch's rows are spread over all data-parallel devices
        return NamedSharding(self.mesh, P(None, *self.batch_sharding.spec))

    def step_fn(self, rows: int, micro_loss: loss_lib.MicroLoss | None = None,
                skip_padding: bool = False) -> Callable:
        """The jitted ``(state, batch, denom) -> (state, metrics)`` for ``rows``-row mini-batches
        of ``micro_loss`` (default: the policy loss, eq. 6); ``skip_padding``: the step that
        stops after the last micro-batch with a trained token (``make_train_step``)."""
        micro_loss = micro_loss or self.policy_loss
        num_micro = self.num_micro(rows)
        key = (num_micro, micro_loss, skip_padding and num_micro > 1)
        if key not in self._steps:
            graphdef, optimizer, dtype, micro_sharding = (self.graphdef, self.optimizer, self.cfg.compute_dtype,
                                                          self._micro_sharding())

            temperature = self.logit_temperature

            def step(frozen, state, batch, denom):
                return make_train_step(graphdef, frozen, optimizer, micro_loss, num_micro, dtype,
                                       micro_sharding, key[2], temperature)(state, batch, denom)

            self._steps[key] = _WithFrozen(jax.jit(
                step,
                in_shardings=(self.frozen_sharding, self.state_sharding, self._batch_shardings(micro_loss.keys),
                              self.replicated),
                out_shardings=(self.state_sharding, self.replicated),
                donate_argnums=(1,),
            ), self)
        return self._steps[key]

    def logprob_fn(self, rows: int) -> Callable:
        """Jitted ``(params, batch) -> log-probs [B, L]``, micro-batched like the step."""
        num_micro = self.num_micro(rows)
        if num_micro not in self._logprob_fns:
            micro_sharding = self._micro_sharding()
            graphdef, dtype, temperature = self.graphdef, self.cfg.compute_dtype, self.logit_temperature
            skip = self.cfg.skip_padding

            def fn(rest, params, batch):
                def forward(m):
                    return forward_logprobs(graphdef, rest, params, m, dtype, False,
                                            temperature)[0].astype(jnp.float32)

                def forward_or_zeros(m):  # a padding micro-batch's log-probs are never read (mask 0)
                    return jax.lax.cond(jnp.any(m["loss_mask"] > 0), forward,
                                        lambda m: jnp.zeros(m["tokens"].shape, jnp.float32), m)

                micros = {k: split_micro_batches(batch[k], num_micro) for k in BATCH_KEYS}
                micros = jax.lax.with_sharding_constraint(micros, micro_sharding)
                lp = jax.lax.map(forward_or_zeros if skip else forward, micros)
                return jnp.swapaxes(lp, 0, 1).reshape(batch["tokens"].shape)  # undo the strided split

            self._logprob_fns[num_micro] = _WithFrozen(jax.jit(
                fn, in_shardings=(self.frozen_sharding, self.param_sharding, self._batch_shardings()),
                out_shardings=self.batch_sharding,
            ), self)
        return self._logprob_fns[num_micro]

    # ------------------------------------------------------------------ host API
    def put_batch(self, batch) -> dict[str, jax.Array]:
        """Host arrays of a TrainBatch -> global arrays on the mesh.

        Single process: the full batch. Multi-process: each process passes *its own* rows (its
        data shard); the global batch is their concatenation in process order.
        """
        return {k: self._put_rows(v) for k, v in batch_to_dict(batch).items()}

    def _put_rows(self, rows) -> jax.Array:
        """One [rows, L] host array (this process's rows) -> a global array sharded as the batch."""
        if processes.training_count() == 1:
            return jax.device_put(np.asarray(rows), self.batch_sharding)
        return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(rows))

    def arrange_rows(self, arrays: Mapping[str, np.ndarray], mini_batches: int = 1,
                     whole_batch: bool = False) -> dict[str, np.ndarray]:
        """Host rows of a batch of ``mini_batches`` mini-batches, reordered by
        ``micro_major_order`` (real rows first in their micro-batches: ``skip_padding``): this
        process's rows (``put_batch``'s multi-process input), or with ``whole_batch`` the
        global batch (the same arrays on every process)."""
        order = self.row_order(arrays, mini_batches, whole_batch)
        return {k: np.asarray(v)[order] for k, v in arrays.items()}

    def row_order(self, arrays: Mapping[str, np.ndarray], mini_batches: int = 1,
                  whole_batch: bool = False) -> np.ndarray:
        """The permutation ``arrange_rows`` applies: its row i is the caller's row ``order[i]``."""
        local = np.shape(arrays["tokens"])[0]
        rows = local if whole_batch else local * processes.training_count()
        offset = 0 if whole_batch else jax.process_index() * local
        if rows % mini_batches:
            raise ValueError(f"batch of {rows} rows does not split into mini_batches={mini_batches}")
        mini_rows = rows // mini_batches
        return micro_major_order(np.asarray(arrays["loss_mask"]).any(axis=1), mini_rows=mini_rows,
                                 num_micro=self.num_micro(mini_rows), offset=offset)

    def compute_logprobs(self, batch: Mapping[str, jax.Array], params=None) -> jax.Array:
        """Log-probs of ``batch``'s tokens under ``params`` (default the current policy), [B, L]."""
        params = self.state.params if params is None else params
        with jax.set_mesh(self.mesh):
            return self.logprob_fn(batch["tokens"].shape[0])(params, {k: batch[k] for k in BATCH_KEYS})

    def update(self, batch: Mapping[str, jax.Array], micro_loss: loss_lib.MicroLoss, denom: float = 0.0) -> dict:
        """One optimizer update of ``micro_loss`` on ``batch`` (global arrays on the mesh, at least
        ``micro_loss.keys``); returns its metrics, on device. ``denom``: see ``make_train_step``."""
        denom_arr = jax.device_put(jnp.float32(denom), self.replicated)
        rows = batch["tokens"].shape[0]
        # The step that skips padding micro-batches only when the batch has one: its loop of
        # unknown length measured ~10 % slower than the plain scan on CPU with none to skip.
        num_micro = self.num_micro(rows)
        skip = self.cfg.skip_padding and num_micro > 1 and not bool(jax.device_get(
            _every_micro_batch_trained(batch["loss_mask"], num_micro)))
        self._release_state()
        with jax.set_mesh(self.mesh):
            self.state, metrics = self.step_fn(rows, micro_loss, skip)(self.state, batch, denom_arr)
        return metrics

    def hold_state(self, wait: Callable[[], object]) -> None:
        """Something reads the arrays of ``state`` behind the caller's back (a checkpoint's copy
        off the device: ``Checkpointer.wait_copied``): the next update, which donates them,
        calls ``wait()`` first. Rollouts and log-probs, which only read them, go on meanwhile."""
        self._state_holds.append(wait)

    def _release_state(self) -> None:
        holds, self._state_holds = self._state_holds, []
        for wait in holds:
            wait()

    def verl_loss_scale(self, arrays: Mapping[str, np.ndarray], denom: float | None) -> np.ndarray:
        """``loss.verl_loss_scale`` of each contiguous mini-batch of this process's host rows:
        ``denom`` (the configured rows of one update, loss.micro_batch_rows="configured") or the
        mini-batch's sequences as the rows."""
        if processes.training_count() > 1 and not denom:
            raise ValueError("loss.micro_batch_tokens with micro_batch_rows='kept' runs in one process only")
        cfg, n = self.loss_cfg, self.cfg.mini_batches
        mask, seg = np.asarray(arrays["loss_mask"]), np.asarray(arrays["segment_ids"])
        size = mask.shape[0] // n
        parts = []
        for i in range(n):
            m, s = mask[i * size:(i + 1) * size], seg[i * size:(i + 1) * size]
            rows = denom or max(sum(len(np.unique(r[r > 0])) for r in s), 1)
            parts.append(loss_lib.verl_loss_scale(m, s, rows, cfg.micro_batch_tokens, cfg.micro_batch_gpus))
        return np.concatenate(parts) if parts else np.zeros(mask.shape, np.float32)

    def group_loss_scale(self, arrays: Mapping[str, np.ndarray], group_ids) -> np.ndarray:
        """``loss.group_token_mean_scale`` of this process's host rows (loss.token_mean="group"):
        each contiguous mini-batch of the GLOBAL batch (the processes' rows in process order)
        is its own block. Multi-process: a group's rows are all on one process (``rl_step``
        splits the prompts by group), so a group's tokens in a mini-batch are counted where it
        is and only the number of groups per mini-batch is summed over the processes (one small
        all-gather); the weights are those of the global batch."""
        mask = np.asarray(arrays["loss_mask"])
        gid = np.asarray(group_ids)
        if gid.shape != mask.shape:
            raise ValueError(f"group_ids {gid.shape} must be laid out as the batch's rows {mask.shape} "
                             "(this process's rows)")
        local, count, n = mask.shape[0], processes.training_count(), self.cfg.mini_batches
        rows = local * count
        if rows % n:
            raise ValueError(f"batch of {rows} rows does not split into mini_batches={n}")
        offset = jax.process_index() * local if count > 1 else 0
        block = (offset + np.arange(local)) // (rows // n)  # the global mini-batch of each row
        groups = loss_lib.trained_groups(mask, gid, block, n)
        if count > 1:
            groups = processes.allgather(groups).sum(axis=0)
        return loss_lib.group_token_mean_scale(mask, gid, block, groups)

    def train(self, batch, denom: float | None = None, gap_threshold: float | None = None,
              gap_mask: np.ndarray | None = None, group_ids: np.ndarray | None = None) -> dict[str, float]:
        """The RL update: old log-probs (optionally recomputed), then ``mini_batches`` optimizer
        updates of eq. 6.

        ``batch``: a TrainBatch / mapping of host arrays (this process's rows) or the dict
        ``put_batch`` returned. ``denom``: a constant loss normaliser (Dr. GRPO); default the
        token count of each mini-batch (eq. 6). ``gap_threshold`` (with
        ``recompute_old_logprobs``): count the trained tokens whose sampler and trainer
        log-probs differ by more than this (``train/logprob_gap_tokens_over``, global) and keep
        where the first of this process's rows are in ``logprob_gap_outliers``. ``gap_mask`` (host
        [rows, L], this process's rows): measure the gap there instead of on every trained token
        (partial rollouts: the tokens the current policy sampled). ``group_ids`` (host [rows, L]
        int, this process's rows, 0 = no group; loss.token_mean="group" needs them, other
        modes ignore them): the group of each token, for eq. 6's per-group token means
        (``group_loss_scale``; the weights move with their rows when they are reordered).
        """
        self.logprob_gap_outliers = np.zeros((0, 2), np.int64)
        order = None  # the caller's row of each row put on the mesh (None: the same order)
        if gap_mask is not None and _is_global(batch):
            raise ValueError("gap_mask needs the batch as host arrays (it is put on the mesh with them)")
        by_group = getattr(self.loss_cfg, "token_mean", None) == "group"
        if by_group and group_ids is None:
            raise ValueError("loss.token_mean='group' needs group_ids (the group of each token, host [rows, L]; "
                             "rl_step passes them)")
        scale = None
        if not _is_global(batch):
            arrays = batch_to_dict(batch)
            if by_group:  # eq. 6's token mean per group, as token weights
                arrays[loss_lib.LOSS_SCALE_KEY] = self.group_loss_scale(arrays, group_ids)
            elif self.policy_loss is not None and loss_lib.LOSS_SCALE_KEY in self.policy_loss.keys:  # verl's micro-batches, as token weights
                arrays[loss_lib.LOSS_SCALE_KEY] = self.verl_loss_scale(arrays, denom)
            # real rows first in their micro-batches: the padding ones skipped, and with
            # token_mean="micro_batch" the micro-batches verl's actor forms (its rows in order)
            if self.cfg.skip_padding or getattr(self.loss_cfg, "token_mean", None) == "micro_batch":
                order = self.row_order(arrays, self.cfg.mini_batches)
                arrays = {k: np.asarray(v)[order] for k, v in arrays.items()}
            if gap_mask is not None:  # in the same row order, laid out as the loss mask
                gap_mask = self._put_rows(np.asarray(gap_mask, np.float32)[slice(None) if order is None else order])
            scale = arrays.pop(loss_lib.LOSS_SCALE_KEY, None)
            batch = self.put_batch(arrays)
        elif self.policy_loss is not None and loss_lib.LOSS_SCALE_KEY in self.policy_loss.keys:
            what = "token_mean='group'" if by_group else "micro_batch_tokens > 0"
            raise ValueError(f"loss.{what} needs the batch as host arrays (its weights are computed there)")
        batch = {k: batch[k] for k in BATCH_KEYS}
        if scale is not None:
            batch[loss_lib.LOSS_SCALE_KEY] = self._put_rows(scale)
        measured = batch["loss_mask"] if gap_mask is None else gap_mask
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.cfg.recompute_old_logprobs:
            recomputed = jax.block_until_ready(self.compute_logprobs(batch))  # timed apart
            metrics["time/old_logprobs"] = time.perf_counter() - t0
            threshold = np.inf if gap_threshold is None else float(gap_threshold)
            gap, positions = logprob_gap.gap_on_device(batch["rollout_logprobs"], recomputed,
                                                         measured, threshold, self.replicated)
            if gap_threshold is None:  # no threshold, no count
                gap.pop("train/logprob_gap_tokens_over")
            metrics.update(gap)
            self.logprob_gap_outliers = _local_positions(
                positions, batch["tokens"].shape[0] // processes.training_count(), order)
            batch["old_logprobs"] = recomputed
        if self._kl:
            if self.ref_params is None:
                raise ValueError("kl_coef > 0 but the trainer holds no reference params (set_reference)")
            # same jitted forward as the old-log-prob recompute, outside the gradient
            batch[REF_KEY] = self.compute_logprobs(batch, self.ref_params)
        rows = batch["tokens"].shape[0]
        n = self.cfg.mini_batches
        if rows % n:
            raise ValueError(f"batch of {rows} rows does not split into mini_batches={n}")
        # A mini-batch without a trained token (all rejected groups) is no update: AdamW would
        # otherwise still move the weights (momentum, weight decay) on a zero gradient. Within a
        # step that trains it keeps its place in the LR schedule (verl steps its scheduler once a
        # rollout step); a step with nothing to train is no step (the caller skips it).
        empty = np.asarray(jax.device_get(_mini_batch_tokens(batch["loss_mask"], n))) == 0
        per_update = []
        for i in range(n):
            if empty[i]:
                if not empty.all():
                    self._advance_schedule()
                continue
            # contiguous mini-batches (verl's order); each has its own token-mean normaliser
            mini = batch
            if n > 1:
                with jax.set_mesh(self.mesh):
                    mini = {k: v[i * rows // n:(i + 1) * rows // n] for k, v in batch.items()}
                    mini = jax.device_put(mini, self._batch_shardings(tuple(batch)))
            per_update.append(self.update(mini, self.policy_loss, denom or 0.0))
        if per_update:
            self.policy_version += 1
        host, trained = jax.device_get((per_update, jnp.sum(batch["loss_mask"])))
        metrics["time/update"] = time.perf_counter() - t0 - metrics.get("time/old_logprobs", 0.0)
        for k in host[0] if host else ():
            metrics[f"train/{k}"] = float(np.mean([h[k] for h in host]))
        metrics["train/updates"] = float(len(host))
        metrics["train/trained_tokens"] = float(trained)  # loss-mask tokens, all processes' rows
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

    def _advance_schedule(self) -> None:
        """The LR schedule's count one update on (``optim.advance_schedule``), nothing else."""
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(optim_lib.advance_schedule, out_shardings=self.state_sharding.opt_state)(
                self.state.opt_state)
        self.state = TrainState(self.state.params, opt_state, self.state.step)

    def reset_optimizer(self) -> None:
        """Fresh optimizer state (rStar2-Agent §4.3, stage 3); the step counter is kept."""
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_sharding.opt_state)(
                self.state.params)
        self.state = TrainState(self.state.params, opt_state, self.state.step)

    @property
    def rest(self):
        """The non-trained state (``frozen``), under its pre-LoRA name."""
        return self.frozen

    def model(self) -> nnx.Module:
        """The policy as a plain ``Qwen3``: a module over the current params (no copy), or with
        LoRA the adapters merged into a new copy of the weights, on the devices in one jitted
        program (``models.lora.merged_model``): what the HF export writes and SFT hands on."""
        if self.lora:
            return lora_lib.merged_model(self.lora_model(), self.mesh)
        return nnx.merge(self.graphdef, self.state.params, self.frozen)

    def served_model(self) -> nnx.Module:
        """The policy as the rollouts' engines take it (``update_params``), with no copy: with
        LoRA the unmerged adapters and base, which the weight hand-off merges and casts into
        the serving copy in its one program (``models.qwen3.serving_weights``); no merged copy
        of the model is ever made for serving."""
        return self.lora_model()

    def lora_model(self) -> nnx.Module:
        """The module over the current params and the frozen base (no copy): with LoRA the
        unmerged adapters and base."""
        return nnx.merge(self.graphdef, self.state.params, self.frozen)

    def set_frozen(self, frozen) -> None:
        """Replace the frozen (non-trained) state, e.g. a LoRA run's base weights by a previous
        stage's full policy; same structure, placed on its shardings."""
        self.frozen = jax.device_put(frozen, self.frozen_sharding)


class _WithFrozen:
    """A jitted program whose first argument is the trainer's frozen state, bound at call time
    (so ``set_frozen`` takes effect); ``lower`` as the jitted function's, for memory analysis."""

    def __init__(self, jitted, trainer: "Trainer"):
        self.jitted, self.trainer = jitted, trainer

    def __call__(self, *args):
        return self.jitted(self.trainer.frozen, *args)

    def lower(self, *args):
        return self.jitted.lower(self.trainer.frozen, *args)


def _is_global(batch) -> bool:
    return isinstance(batch, Mapping) and all(isinstance(batch.get(k), jax.Array) for k in BATCH_KEYS)


@functools.partial(jax.jit, static_argnums=1)
def _every_micro_batch_trained(loss_mask, num_micro: int):
    """Whether each of ``split_micro_batches``' micro-batches has a trained token (a replicated
    scalar: the same answer on every process)."""
    return jnp.all(jnp.any(split_micro_batches(loss_mask, num_micro) > 0, axis=(1, 2)))


@functools.partial(jax.jit, static_argnums=1)
def _mini_batch_tokens(loss_mask, mini_batches: int):
    """Trained tokens of each contiguous mini-batch, as scalars (replicated: readable on every
    process of a multi-process run)."""
    rows = loss_mask.shape[0] // mini_batches
    return tuple(jnp.sum(loss_mask[i * rows:(i + 1) * rows]) for i in range(mini_batches))


def _local_positions(positions: np.ndarray, local_rows: int, order: np.ndarray | None
                     ) -> np.ndarray:
    """Global (row, column) pairs -> this process's rows, in the caller's row order (``order``:
    the permutation ``row_order`` applied before the batch went on the mesh)."""
    first = jax.process_index() * local_rows
    mine = positions[(positions[:, 0] >= first) & (positions[:, 0] < first + local_rows)].copy()
    mine[:, 0] -= first
    if order is not None:
        mine[:, 0] = np.asarray(order)[mine[:, 0]]
    return mine.astype(np.int64).reshape(-1, 2)
