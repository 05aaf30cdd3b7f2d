"""How many KV pages (and decode slots) an engine gets, from memory or from an explicit count.

``plan_kv`` is the one place that decides; ``Engine`` calls it with the device's free memory
(after the serving weights are placed), and tests call it with the memory of a device we do
not have (e.g. 80 GB for the stage configs at Qwen3-1.7B / 8B shapes), so the arithmetic that
decides whether a configuration starts is the same code either way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstarjax.models.config import ModelConfig
from rstarjax.models.kv_cache import kv_bytes_per_token, pages_for
from rstarjax.models.qwen3 import Qwen3, serving_weights
from rstarjax.validation import ConfigError

MAX_AUTO_SLOTS = 256  # decode batch width when sized from memory (GPU/TPU decode is
#                       weight-bandwidth bound up to a few hundred rows)
DEFAULT_CPU_SLOTS = 64  # no memory statistics (CPU): a dense-equivalent pool of this many rows
GB = 1e9


@dataclasses.dataclass(frozen=True)
class KVPlan:
    page_size: int
    num_pages: int
    num_slots: int
    pages_per_rollout: int  # pages of one maximum-length rollout
    page_bytes: int  # K and V of one page over all layers
    free_bytes: int | None  # device memory free when sizing (None: unknown, CPU)
    source: str  # "kv_pages" | "memory" | "dense-equivalent"

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_length_rollouts(self) -> int:
        """Maximum-length rollouts the pool holds at once (the dense-cache equivalent)."""
        return self.num_pages // self.pages_per_rollout

    def describe(self) -> str:
        return (f"{self.num_pages} pages x {self.page_size} tokens = {self.kv_tokens} KV tokens "
                f"({self.kv_bytes / GB:.2f} GB, {self.source}), {self.num_slots} slots, "
                f"{self.max_length_rollouts} maximum-length rollouts")


def free_device_bytes(device: jax.Device | None = None) -> int | None:
    """Bytes the allocator can still hand out on ``device``; None where unknown (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def serving_weight_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of the serving copy of the weights (matmul weights in ``dtype``, norms as
    stored), from the abstract model (``nnx.eval_shape``: nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = jax.eval_shape(lambda s: serving_weights(nnx.merge(graphdef, s), dtype), state)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(shapes)))


def decode_weight_bytes_read(cfg: ModelConfig, batch: int, dtype=jnp.bfloat16) -> int:
    """Weight bytes one decode step of ``batch`` rows reads (its HBM roofline's weight term):
    the serving copy, except that an untied input embedding is only gathered, ``batch`` rows of
    it; a tied one is read whole as the LM head. (Qwen3-8B: 1.24 GB of its 16.4 GB are the
    input table.)"""
    total = serving_weight_bytes(cfg, dtype)
    if not cfg.tie_word_embeddings:
        row = cfg.hidden_size * jnp.dtype(dtype).itemsize
        total -= cfg.vocab_size * row - batch * row
    return total


def plan_kv(cfg: ModelConfig, *, max_len: int, page_size: int = 16, kv_pages: int = 0,
            kv_memory_fraction: float = 0.9, num_slots: int = 0, dtype=jnp.bfloat16,
            free_bytes: int | None = None) -> KVPlan:
    """Pages and slots for an engine whose rollouts reach ``max_len`` tokens.

    - ``kv_pages > 0``: exactly that many pages.
    - else, with ``free_bytes`` known (GPU/TPU: free device memory after the serving
      weights): ``kv_memory_fraction`` of it, in pages (the rest is left for activations).
    - else (CPU): a dense-equivalent pool, ``num_slots`` (default 64) maximum-length rows.

    Slots (the decode batch width): ``num_slots`` if given, else ``min(256, pages)`` when
    sized from memory. Raises ``ConfigError`` with the numbers and the settings that fix it
    (``serving.kv_pages``: the recipes write them as flags) when the pool cannot hold one
    maximum-length rollout."""
    if page_size < 1 or max_len < 2:
        raise ValueError(f"need page_size >= 1 and max_len >= 2, got {page_size}, {max_len}")
    if not 0.0 < kv_memory_fraction <= 1.0:
        raise ValueError(f"serving.kv_memory_fraction must be in (0, 1], got "
                         f"{kv_memory_fraction}")
    page_bytes = kv_bytes_per_token(cfg, dtype) * page_size
    per_rollout = pages_for(max_len, page_size)
    if kv_pages > 0:
        num_pages, source = int(kv_pages), "kv_pages"
    elif free_bytes is not None:
        num_pages, source = int(kv_memory_fraction * max(0, free_bytes) // page_bytes), "memory"
    else:
        num_pages = (num_slots or DEFAULT_CPU_SLOTS) * per_rollout
        source = "dense-equivalent"
    if num_pages < per_rollout:
        have = (f"{free_bytes / GB:.2f} GB free on the device after the weights, "
                if free_bytes is not None else "")
        # a given page count is used as it is: the fraction then changes nothing, so it is not offered
        raise_fraction = ("" if source == "kv_pages" else
                          f"raise serving.kv_memory_fraction (now {kv_memory_fraction}), ")
        raise ConfigError(
            f"the KV pool cannot hold one maximum-length rollout: {max_len} tokens need "
            f"{per_rollout} pages of {page_size} tokens ({per_rollout * page_bytes / GB:.2f} "
            f"GB), the pool has {num_pages} pages ({num_pages * page_bytes / GB:.2f} GB; "
            f"{have}source: {source}). Set serving.kv_pages={per_rollout} or more, "
            f"{raise_fraction}or lower rl.max_prompt_len / rl.max_response_len.")
    if num_slots <= 0:
        num_slots = min(MAX_AUTO_SLOTS, num_pages) if source != "dense-equivalent" \
            else DEFAULT_CPU_SLOTS
    return KVPlan(page_size=int(page_size), num_pages=num_pages, num_slots=int(num_slots),
                  pages_per_rollout=per_rollout, page_bytes=int(page_bytes),
                  free_bytes=free_bytes, source=source)


# ---- the memory plan of a colocated run on one device --------------------------------------------
# Activation bytes of one update per trained token and per (layer x hidden unit), by remat policy.
# Measured with XLA's memory analysis of the compiled train step (its peak less the float32
# weights, AdamW moments and gradients, 16 bytes per parameter) at Qwen3-1.7B (28 layers x 2,048)
# on rows of 8,192 tokens, bf16, jax 0.11.2 (docs/training.md "On a GPU"; docs/launch.md "One GPU"):
# full 38.0 / 48.4 / 69.2 GB at 1 / 2 / 4 rows on an H100 (10.4 GB per row, 1.27 MB per token);
# attention 77 GB and dots_attention 110 GB at 4 rows on an H200; dots 46.2 GB, none 76.4 GB at one
# row on an H100. Other shapes scale by layers x hidden (predicted, not measured).
ACTIVATION_BYTES = {"full": 22.1, "attention": 26.4, "dots": 39.8, "dots_attention": 44.0,
                    "none": 104.3}
ACTIVATION_BYTES["dots_no_batch"] = ACTIVATION_BYTES["dots"]  # not measured: taken as dots
# Remat policies fastest first, by the update's MFU at 4 x 8K on an H200 (docs/launch.md):
# dots_attention 45.4 %, attention 41.3 %, full 39.5 %.
REMAT_BY_SPEED = ("dots_attention", "attention", "full")


def lora_trained_params(cfg: ModelConfig, rank: int, targets=None) -> int:
    """Parameters of rank-``rank`` LoRA adapters (A: in x r, B: r x out) on ``targets``."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * h, cfg.num_key_value_heads * h
    widths = {"q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d,
              "gate_proj": d + f, "up_proj": d + f, "down_proj": f + d}
    targets = tuple(targets or cfg.lora_targets)
    return cfg.num_hidden_layers * rank * sum(widths[t] for t in targets)


def served_dtype(cfg: ModelConfig, serving_dtype=None) -> jnp.dtype:
    """The dtype of the engine's serving copy and KV pages: ``serving.dtype``, else the model's
    compute dtype (``model.dtype``), as ``Engine`` picks it (``dtype or model.config.dtype``)."""
    return jnp.dtype(serving_dtype or cfg.dtype)


def page_bytes_of(cfg: ModelConfig, page_size: int, serving_dtype=None) -> int:
    """K and V of one page over all layers, in the serving dtype."""
    return kv_bytes_per_token(cfg, served_dtype(cfg, serving_dtype)) * page_size


def engine_pool_bytes(*, page_bytes: int, free_after_serving: int, kv_memory_fraction: float | None = None,
                      kv_pages: int = 0) -> int | None:
    """The KV pool a run's own settings give the engine (``plan_kv``'s page count, in bytes):
    ``kv_pages`` pages, else ``kv_memory_fraction`` of the memory free once the serving copy is
    placed; None when the run leaves the pool to the plan (neither given)."""
    if kv_pages > 0:
        return int(kv_pages) * page_bytes
    if kv_memory_fraction is None:
        return None
    return int(kv_memory_fraction * max(0, free_after_serving) // page_bytes) * page_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device holds in a colocated RL step (the trainer's state, the engine's serving
    copy and KV pool, the update's gradients and activations), and at which phase it peaks."""
    params: int  # float32 master weights that train (LoRA: the adapters) + the frozen bf16 base
    optimizer: int  # AdamW's two float32 moments of the trained weights
    reference: int  # loss.kl_coef > 0: the KL term's float32 copy of the trained weights (else 0)
    grads: int  # float32 gradients; two copies when micro-steps accumulate
    activations: int  # the update's saved activations: micro rows x row length x per token
    serving: int  # the engine's serving copy (serving.dtype, else model.dtype)
    kv_pool: int  # the engine's KV pages
    released_in_update: bool  # serving.release_during_update: serving + pool freed for the update
    device: int  # bytes the process may allocate (0: unknown)

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.reference

    @property
    def rollout_peak(self) -> int:
        return self.state + self.serving + self.kv_pool

    @property
    def update_peak(self) -> int:
        held = 0 if self.released_in_update else self.serving + self.kv_pool
        return self.state + self.grads + self.activations + held

    @property
    def peak(self) -> int:
        return max(self.rollout_peak, self.update_peak)

    def as_dict(self) -> dict:
        names = ("params", "optimizer", "reference", "grads", "activations", "serving", "kv_pool", "device")
        out = {f"{n}_gb": round(getattr(self, n) / GB, 2) for n in names}
        out.update(state_gb=round(self.state / GB, 2), rollout_peak_gb=round(self.rollout_peak / GB, 2),
                   update_peak_gb=round(self.update_peak / GB, 2), peak_gb=round(self.peak / GB, 2),
                   released_in_update=self.released_in_update)
        return out


def plan_memory(cfg: ModelConfig, *, rows: int, seq_len: int, micro_batch: int = 0,
                remat_policy: str | None = None, lora_rank: int = 0, kv_pool_bytes: int = 0,
                release_during_update: bool = False, device_bytes: int = 0, serving_dtype=None,
                kl_reference: bool = False) -> MemoryPlan:
    """The memory plan of a colocated step on one device: ``rows`` trained rows of ``seq_len``
    tokens, ``micro_batch`` rows per micro-step (0: all at once), ``kv_pool_bytes`` of KV pages.

    Full fine-tuning keeps 16 bytes per parameter for the update (float32 weights, two AdamW
    moments, gradients; 4 more for the accumulator when micro-steps accumulate); LoRA keeps the
    base in bf16 (2 bytes) and 16 per adapter parameter. ``kl_reference`` (``loss.kl_coef > 0``):
    the trainer's frozen reference copy of what trains (``rl/trainer.py`` ``ref_params``: the
    float32 params it splits off, with LoRA the adapters only), 4 bytes per trained parameter.
    The serving copy is the bytes of ``served_dtype`` per parameter (2 in bf16).
    Activations: ``ACTIVATION_BYTES[remat]`` x layers x hidden per token of a micro-step, measured
    at Qwen3-1.7B in bf16 (other shapes predicted); a model computing in float32 (``cfg.dtype``,
    ``model.dtype``) is taken at twice that, its saved activations being twice as wide (a
    prediction, never measured)."""
    remat = remat_policy or cfg.remat_policy
    if remat not in ACTIVATION_BYTES:
        raise ValueError(f"remat_policy={remat!r}: the plan knows {sorted(ACTIVATION_BYTES)}")
    micro = micro_batch or rows
    if rows < 1 or seq_len < 1 or micro < 1 or rows % micro:
        raise ValueError(f"need rows >= 1, seq_len >= 1 and a micro_batch that divides rows, "
                         f"got rows={rows}, seq_len={seq_len}, micro_batch={micro_batch}")
    total = cfg.num_params
    if lora_rank:
        trained = lora_trained_params(cfg, lora_rank)
        params = 4 * trained + 2 * total
    else:
        trained = total
        params = 4 * trained
    grads = 4 * trained * (2 if micro < rows else 1)
    # ACTIVATION_BYTES was measured computing in bf16: scale by the compute dtype's width
    per_token = (ACTIVATION_BYTES[remat] * cfg.num_hidden_layers * cfg.hidden_size
                 * jnp.dtype(cfg.dtype).itemsize / 2)
    return MemoryPlan(params=int(params), optimizer=int(8 * trained),
                      reference=int(4 * trained) if kl_reference else 0, grads=int(grads),
                      activations=int(per_token * micro * seq_len),
                      serving=int(served_dtype(cfg, serving_dtype).itemsize * total),
                      kv_pool=int(kv_pool_bytes), released_in_update=bool(release_during_update),
                      device=int(device_bytes))


def kl_reference_fix(plan: MemoryPlan) -> str:
    """The fix of a plan the KL term's reference copy is what keeps from fitting."""
    return f"loss.kl_coef=0 (no KL term: no {plan.reference / GB:.1f} GB reference copy of the trained weights)"


@dataclasses.dataclass(frozen=True)
class ColocatedChoice:
    """What ``choose_colocated`` picked: the remat policy, the micro-batch, the KV pool, the
    ``serving.kv_memory_fraction`` that gives that pool, and the plan; ``problems`` (each naming
    the settings, ``SECTION.KEY``) when nothing fits."""
    remat_policy: str
    micro_batch: int
    kv_pages: int
    kv_memory_fraction: float
    plan: MemoryPlan
    problems: tuple[str, ...] = ()


def choose_colocated(cfg: ModelConfig, *, rows: int, seq_len: int, device_bytes: int,
                     min_pool_rollouts: int = 8, page_size: int = 16, lora_rank: int = 0,
                     remat_policies=REMAT_BY_SPEED, micro_batches=None,
                     release_during_update: bool = False, margin: float = 0.05, serving_dtype=None,
                     kl_reference: bool = False) -> ColocatedChoice:
    """The fastest remat policy (``remat_policies`` in order), then the largest micro-batch (a
    divisor of ``rows``), whose update fits ``device_bytes`` less ``margin`` beside the serving
    copy and a KV pool of at least ``min_pool_rollouts`` rollouts of ``seq_len`` tokens; the pool
    gets the rest. The engine sizes its pool as ``kv_memory_fraction`` of the memory free after
    the trainer's state and its serving copy; the fraction returned gives the chosen pool.
    ``serving_dtype`` and ``kl_reference``: ``plan_memory``'s."""
    usable = int(device_bytes * (1.0 - margin))
    page_bytes = page_bytes_of(cfg, page_size, serving_dtype)
    rollout_bytes = page_bytes * pages_for(seq_len, page_size)
    micro_batches = micro_batches or sorted((m for m in range(1, rows + 1) if rows % m == 0), reverse=True)
    for remat in remat_policies:
        for micro in micro_batches:
            bare = plan_memory(cfg, rows=rows, seq_len=seq_len, micro_batch=micro, remat_policy=remat,
                               lora_rank=lora_rank, release_during_update=release_during_update,
                               device_bytes=device_bytes, serving_dtype=serving_dtype,
                               kl_reference=kl_reference)
            room = usable - (bare.rollout_peak if release_during_update else bare.update_peak)
            if release_during_update:  # the pool only has to fit beside the state and serving copy
                fits = bare.update_peak <= usable and room >= min_pool_rollouts * rollout_bytes
            else:
                fits = room >= min_pool_rollouts * rollout_bytes
            if not fits:
                continue
            pages = int(room // page_bytes)
            plan = dataclasses.replace(bare, kv_pool=pages * page_bytes)
            free_after_serving = device_bytes - bare.state - bare.serving
            # half a page over: the engine's floor(fraction x free / page) is then exactly ``pages``
            fraction = min(1.0, (pages + 0.5) * page_bytes / free_after_serving)
            return ColocatedChoice(remat, micro, pages, fraction, plan)
    smallest = plan_memory(cfg, rows=rows, seq_len=seq_len, micro_batch=1, remat_policy=remat_policies[-1],
                           lora_rank=lora_rank, release_during_update=release_during_update,
                           device_bytes=device_bytes, serving_dtype=serving_dtype, kl_reference=kl_reference)
    need = smallest.update_peak + (0 if release_during_update else min_pool_rollouts * rollout_bytes)
    fixes = []
    if smallest.reference and need - smallest.reference <= usable:  # the KL term's copy is what breaks it
        fixes.append(kl_reference_fix(smallest))
    if not lora_rank:
        fixes.append("train LoRA adapters only (model.lora_rank=16)")
    if not release_during_update:
        fixes.append("free the serving copy and the pool during the update "
                     "(serving.release_during_update=True)")
    fixes.append(f"shorter rows (rl.max_response_len, now {seq_len} tokens with the prompt)")
    fixes.append("more devices (mesh.fsdp)")
    reference = f", KL reference {smallest.reference / GB:.1f}" if smallest.reference else ""
    problem = (f"one micro-batch row (trainer.micro_batch_size=1, "
               f"model.remat_policy={remat_policies[-1]}) needs {need / GB:.1f} GB with a pool of "
               f"{min_pool_rollouts:g} rollouts, the device has {usable / GB:.1f} GB usable "
               f"(state {smallest.state / GB:.1f}{reference}, gradients {smallest.grads / GB:.1f}, activations "
               f"{smallest.activations / GB:.1f}, serving copy {smallest.serving / GB:.1f} GB): "
               + "; or ".join(fixes))
    return ColocatedChoice(remat_policies[-1], 1, 0, 0.0, smallest, (problem,))


def update_room_problems(cfg: ModelConfig, *, rows: int, seq_len: int, micro_batch: int,
                         free_bytes: int | None, remat_policy: str | None = None, lora_rank: int = 0,
                         release_during_update: bool = False, page_size: int = 16,
                         margin: float = 0.05, kv_memory_fraction: float | None = None,
                         kv_pages: int = 0, serving_dtype=None, kl_reference: bool = False) -> list[str]:
    """The start check of a colocated run on one device, made once the trainer's state (weights,
    AdamW moments, the KL reference) is in place: what the step still needs (the update's
    gradients and activations; unless ``release_during_update``, beside the serving copy and the
    KV pool) against ``free_bytes`` less ``margin``. The pool is the run's own when it gives one
    (``kv_pages`` pages, or ``kv_memory_fraction`` of what the serving copy leaves, as the engine
    takes it), else one maximum-length rollout's (the least any engine holds). One line naming
    the settings (``SECTION.KEY``) when it does not fit; [] when it does or the free memory is
    unknown (CPU). ``kl_reference``: the run keeps one (already in ``free_bytes``'s use); named
    as a fix when the update would fit without it."""
    if free_bytes is None:
        return []
    p = plan_memory(cfg, rows=rows, seq_len=seq_len, micro_batch=micro_batch,
                    remat_policy=remat_policy, lora_rank=lora_rank,
                    release_during_update=release_during_update, serving_dtype=serving_dtype,
                    kl_reference=kl_reference)
    page_bytes = page_bytes_of(cfg, page_size, serving_dtype)
    pool = engine_pool_bytes(page_bytes=page_bytes, free_after_serving=free_bytes - p.serving,
                             kv_memory_fraction=kv_memory_fraction, kv_pages=kv_pages)
    pool_given = pool is not None
    if not pool_given:
        pool = page_bytes * pages_for(seq_len, page_size)
    held = 0 if release_during_update else p.serving + pool
    need = p.grads + p.activations + held
    if need <= free_bytes * (1.0 - margin):
        return []
    micro = micro_batch or rows
    fixes = []
    if held and pool_given:  # the run's pool is beside the update: a smaller one makes room
        fixes.append(f"a smaller KV pool (serving.kv_pages, now {kv_pages})" if kv_pages > 0 else
                     f"a smaller KV pool (serving.kv_memory_fraction, now {kv_memory_fraction})")
    if p.reference and need <= (free_bytes + p.reference) * (1.0 - margin):
        fixes.append(kl_reference_fix(p))
    fixes.append(f"fewer rows per micro-step (trainer.micro_batch_size, now {micro})"
                 if micro > 1 else "shorter rows (rl.max_prompt_len / rl.max_response_len)")
    if (remat_policy or cfg.remat_policy) != "full":
        fixes.append(f"model.remat_policy=full (now {remat_policy or cfg.remat_policy})")
    if not release_during_update:
        fixes.append("serving.release_during_update=True")
    if not lora_rank:
        fixes.append("model.lora_rank=16")
    kv = (f"a {pool / GB:.1f} GB KV pool" if pool_given else f"one rollout's KV {pool / GB:.1f}")
    return [f"the update does not fit beside the weights and AdamW moments: it needs {need / GB:.1f} GB "
            f"(gradients {p.grads / GB:.1f}, activations {p.activations / GB:.1f} for {micro} row(s) of "
            f"{seq_len} tokens" + (f", serving copy {p.serving / GB:.1f}, {kv}" if held else "")
            + f"), the device has {free_bytes / GB:.1f} GB free (memory plan: serving/sizing.py); "
            + "; or ".join(fixes)]


# ---- what a colocated run on one device leaves to the plan ----------------------------------------
def device_bytes_limit(device: jax.Device | None = None) -> int | None:
    """Bytes the allocator may hand out on ``device`` in all (``bytes_limit``); None where the
    backend keeps no memory statistics (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def size_colocated(cfg: ModelConfig, *, rows: int, seq_len: int, device_bytes: int,
                   micro_batch: int | None = None, kv_memory_fraction: float | None = None,
                   kv_pages: int = 0, page_size: int = 16, lora_rank: int = 0,
                   release_during_update: bool = False, remat_policy: str | None = None,
                   remat_policies: tuple[str, ...] = (), rollouts: int = 0, serving_dtype=None,
                   kl_reference: bool = False) -> ColocatedChoice:
    """The micro-batch and the KV pool's share of a colocated run on one device of ``device_bytes``,
    each from the memory plan where the run leaves it open (None), the run's own where it set it.

    The remat policy is the run's (``remat_policy``, default ``cfg.remat_policy``), or with
    ``remat_policies`` (fastest first) the plan's: ``fastest_remat_keeping_the_pool`` of their
    choices, ``rollouts`` being a step's. With the pool open, ``choose_colocated`` picks the
    largest micro-batch (or checks the given one) beside a pool of at least 8 maximum-length
    rollouts, else of one, and gives the pool the rest. With the pool set (``kv_memory_fraction``
    of the memory the trainer's state and the serving copy leave, or ``kv_pages``), the
    micro-batch is the largest whose update fits beside that pool. ``problems`` (one line, naming
    the flags) when nothing fits. ``serving_dtype`` and ``kl_reference``: ``plan_memory``'s."""
    same_run = dict(rows=rows, seq_len=seq_len, device_bytes=device_bytes, micro_batch=micro_batch,
                    kv_memory_fraction=kv_memory_fraction, kv_pages=kv_pages, page_size=page_size,
                    lora_rank=lora_rank, release_during_update=release_during_update, serving_dtype=serving_dtype)
    if remat_policies:
        choices = [size_colocated(cfg, **same_run, remat_policy=remat, kl_reference=kl_reference)
                   for remat in remat_policies]
        return fastest_remat_keeping_the_pool(choices, pages_for(seq_len, page_size), rollouts)
    remat = remat_policy or cfg.remat_policy
    micro_batches = None if micro_batch is None else (micro_batch or rows,)
    page_bytes = page_bytes_of(cfg, page_size, serving_dtype)
    per_rollout = pages_for(seq_len, page_size)
    bare = plan_memory(cfg, rows=rows, seq_len=seq_len, remat_policy=remat, lora_rank=lora_rank,
                       serving_dtype=serving_dtype, kl_reference=kl_reference)
    pool_bytes = engine_pool_bytes(page_bytes=page_bytes, free_after_serving=device_bytes - bare.state - bare.serving,
                                   kv_memory_fraction=kv_memory_fraction, kv_pages=kv_pages)
    pools = (8, 1) if pool_bytes is None else (pool_bytes / (per_rollout * page_bytes),)
    for pool in pools:
        choice = choose_colocated(cfg, rows=rows, seq_len=seq_len, device_bytes=device_bytes,
                                  min_pool_rollouts=pool, page_size=page_size, lora_rank=lora_rank,
                                  remat_policies=(remat,), micro_batches=micro_batches,
                                  release_during_update=release_during_update, serving_dtype=serving_dtype,
                                  kl_reference=kl_reference)
        if choice.problems:
            continue
        if pool_bytes is None:
            return choice
        return dataclasses.replace(  # the run's own pool, not the room the plan would give it
            choice, kv_pages=int(pool_bytes // page_bytes), plan=dataclasses.replace(choice.plan, kv_pool=int(pool_bytes)),
            kv_memory_fraction=0.0 if kv_pages > 0 else float(kv_memory_fraction))
    if micro_batch is None and pool_bytes is None:
        return choice  # choose_colocated's own problem: one row of the slowest remat does not fit
    given = [f"trainer.micro_batch_size={micro_batch}" if micro_batch is not None else "",
             f"serving.kv_pages={kv_pages}" if kv_pages > 0 else
             (f"serving.kv_memory_fraction={kv_memory_fraction}" if pool_bytes is not None else "")]
    given = [g for g in given if g]
    problem = (f"the memory plan (serving/sizing.py) finds no room on this {device_bytes / GB:.1f} GB device for "
               f"{' with '.join(given)} ({rows} rows of {seq_len} tokens, remat {remat}"
               + (f", a {pool_bytes / GB:.1f} GB KV pool" if pool_bytes is not None else "")
               + "): leave " + " and ".join(g.split("=")[0] for g in given) + " out to let the plan size "
               + ("it" if len(given) == 1 else "them") + ", or set smaller values")
    if kl_reference and not size_colocated(cfg, **same_run, remat_policy=remat).problems:
        problem += "; or " + kl_reference_fix(choice.plan)  # the KL term's copy is what breaks the fit
    return dataclasses.replace(choice, problems=(problem,))


def fastest_remat_keeping_the_pool(choices: list[ColocatedChoice], pages_per_rollout: int,
                                   rollouts: int) -> ColocatedChoice:
    """Of one sizing per remat policy (``choices``, fastest policy first, the slowest last), the
    fastest that fits and whose KV pool holds as many maximum-length rollouts at once as the
    slowest's does, or all of a step's ``rollouts`` (0: no cap): on one device the rollouts are
    most of a step (46.5 of 49 s on an H200, docs/launch.md) and the update a few percent, so a
    faster update (45.4 % against 39.5 % MFU) must not cost the rollouts concurrency. The slowest
    policy's choice (its problems included) when none does better."""
    def held(c: ColocatedChoice) -> int:
        return c.kv_pages // pages_per_rollout
    slowest = choices[-1]
    if slowest.problems:  # the policy with the smallest activations does not fit: none does
        return slowest
    need = held(slowest) if rollouts <= 0 else min(held(slowest), rollouts)
    return next(c for c in choices if not c.problems and held(c) >= need)


def describe_choice(choice: ColocatedChoice, *, device_bytes: int, planned: tuple[str, ...],
                    kv_pages: int = 0) -> str:
    """One line for the start of a run: the micro-batch, the pool and the predicted peak;
    ``planned``: the config keys the plan chose (the others are the run's own)."""
    p = choice.plan

    def tag(key):
        return "plan" if key in planned else "given"
    pool = (f"serving.kv_pages={kv_pages} (given)" if kv_pages > 0 else
            f"serving.kv_memory_fraction={choice.kv_memory_fraction:.4f} ({tag('serving.kv_memory_fraction')})")
    reference = f", KL reference {p.reference / GB:.1f}" if p.reference else ""
    return (f"memory plan (serving/sizing.py) for {device_bytes / GB:.1f} GB: "
            f"model.remat_policy={choice.remat_policy} ({tag('model.remat_policy')}), "
            f"trainer.micro_batch_size={choice.micro_batch} ({tag('trainer.micro_batch_size')}), {pool}: "
            f"a {p.kv_pool / GB:.1f} GB KV pool; predicted peak {p.peak / GB:.1f} GB "
            f"(weights + AdamW {(p.params + p.optimizer) / GB:.1f}{reference}, gradients {p.grads / GB:.1f}, "
            f"activations {p.activations / GB:.1f}, serving copy {p.serving / GB:.1f})")
