"""The rollout engines of a colocated run (kimi k1.5 §4.2 hybrid deployment: rollout and
training share the devices, new params arrive in memory) and the ``serving`` config section
that sizes them: one paged engine per serving slice of this process, the weight hand-off to
all of them once per update (across processes first in a multi-process run:
``handoff.ProcessHandoff``), and the scheduler that spreads rollouts over them.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from rstarjax.layout import Layout, layout_of
from rstarjax.models.config import DTYPES
from rstarjax.serving.decode_choice import decode_choice_rule
from rstarjax.serving.engine import Engine
from rstarjax.serving.handoff import ProcessHandoff, require_process_local, serve_copies, split_weights, stage_copies
from rstarjax.serving.programs import DECODE_GEMMS
from rstarjax.serving.sampling import SAMPLERS
from rstarjax.serving.scheduler import RolloutScheduler
from rstarjax.serving.slices import slice_meshes
from rstarjax.validation import one_of, require


PLACEMENTS = ("colocated", "disaggregated")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """The ``serving`` section: the rollout engine's KV page pool, decode batch and admission
    (docs/serving.md). The engine checks the sizes against the model and the device
    (``serving.sizing.plan_kv``)."""

    page_size: int = 16  # tokens per KV page
    kv_pages: int = 0  # > 0: exactly this many pages; 0: sized from kv_memory_fraction
    kv_memory_fraction: float = 0.9  # of the device memory free after the serving weights
    num_slots: int = 0  # decode batch width; 0: min(256, pages) on GPU/TPU, 64 on CPU
    dtype: str = ""  # serving weights, KV and compute dtype; "" = model.dtype
    # growth headroom kept free per live rollout at admission, as a fraction of the maximum
    # rollout length (rStar2-Agent §3.2); 1.0 never preempts
    admit_reserve_fraction: float = 0.125
    # start each rollout run with no reserve (admit what the pool holds) and double it, from one
    # page up to admit_reserve_fraction, at each preemption (serving.scheduler.adaptive_growth)
    adaptive_reserve: bool = True
    decode_steps: int = 16  # decode steps per device call (one host sync each)
    prefill_chunk: int = 2048  # longest feed per forward row; longer ones go in chunks
    # The decode step's attention (docs/serving.md "Decode kernels"): "auto" picks the platform's
    # default (serving.engine); "pallas_gpu_packed" is our kernel (models/decode_kernel.py), not
    # the CUDA default until a GPU measures it ("pallas_gpu_packed_append": the same, writing the
    # step's K/V itself; "pallas_gpu_packed_rope": also norming and rotating q/k;
    # "pallas_gpu_packed_layer": also the projections as Pallas GEMMs with the norms, SwiGLU and
    # residual adds fused in, models/decode_gemm.py); "pallas_mgpu_packed" the packed kernel's
    # work as a Mosaic GPU kernel for Hopper (models/decode_kernel_mgpu.py; "pallas_mgpu_packed_rope"
    # that kernel writing the K/V and norming and rotating q/k, "pallas_mgpu_packed_layer" that
    # with the Pallas GEMMs); "ragged" the
    # portable path, "reference" the oracle. One path per batch size: "ARM@ROWS,...,ARM", e.g.
    # "pallas_gpu_packed_layer@64,pallas_gpu_packed_rope" (serving/decode_choice.py)
    decode_attention: str = "auto"
    # "exact" draws with the float32 logits (the default); "fused" reads them in the compute dtype
    # in one pass, the same distribution but other tokens for a key (serving/sampling.py)
    sampler: str = "exact"
    # the decode program's GEMMs (serving.programs.DECODE_GEMMS): "xla" (its own choice) or
    # "cublas" (cuBLAS for all of them, the decode program alone; not the default until measured)
    decode_gemms: str = "xla"
    # Serving slices (docs/serving.md "Serving slices"): devices per slice, its weights split
    # Megatron-style and its KV pages by kv head; 0 = one engine over the trainer's arrays as
    # they are (no slices)
    tensor_parallel: int = 0
    slices_per_host: int = 1  # slices on this process's devices; 0 = as many as they hold
    # Free the serving copy and the KV pool before each train step and make them again at the
    # hand-off after it (docs/serving.md "Memory plan"): room for the update on the same devices
    release_during_update: bool = False
    # Where rollouts run (docs/training.md "Placement"): "colocated" on the trainer's devices, or
    # "disaggregated" on the last rollout_devices local devices, the trainer's mesh on the others
    placement: str = "colocated"
    rollout_devices: int = 0
    # disaggregated across processes: processes 0 .. trainer_processes - 1 train, every other
    # process rolls out on all of its devices (rstarjax.processes.rollout_processes_of)
    trainer_processes: int = 1

    def __post_init__(self):
        at_least_one = [(getattr(self, n) >= 1, f"{n}={getattr(self, n)} must be >= 1")
                        for n in ("page_size", "decode_steps", "prefill_chunk")]
        require(*at_least_one,
                (self.kv_pages >= 0, f"kv_pages={self.kv_pages} must be >= 0 (0 = sized from kv_memory_fraction)"),
                (0.0 < self.kv_memory_fraction <= 1.0,
                 f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]"),
                (self.num_slots >= 0, f"num_slots={self.num_slots} must be >= 0 (0 = the engine's default)"),
                (0.0 <= self.admit_reserve_fraction <= 1.0,  # (above 1 it only blocks admissions)
                 f"admit_reserve_fraction={self.admit_reserve_fraction} must be in [0, 1] (1.0 never preempts)"),
                (self.tensor_parallel >= 0,
                 f"tensor_parallel={self.tensor_parallel} must be >= 0 (0 = no slices: serve the trainer's arrays)"),
                (self.slices_per_host >= 0,
                 f"slices_per_host={self.slices_per_host} must be >= 0 (0 = as many as the local devices hold)"),
                (self.tensor_parallel >= 1 or self.slices_per_host == 1,
                 f"slices_per_host={self.slices_per_host} needs tensor_parallel >= 1 (devices per slice)"),
                (isinstance(self.adaptive_reserve, bool),
                 f"adaptive_reserve={self.adaptive_reserve!r} must be True or False"),
                (isinstance(self.release_during_update, bool),
                 f"release_during_update={self.release_during_update!r} must be True or False"),
                one_of("placement", self.placement, PLACEMENTS),
                ((self.placement == "disaggregated") == (self.rollout_devices >= 1),
                 f"rollout_devices={self.rollout_devices}: placement='disaggregated' needs rollout_devices >= 1 "
                 "(the devices its rollout slices take), and only it takes any"),
                (self.trainer_processes >= 1, f"trainer_processes={self.trainer_processes} must be >= 1"),
                (self.placement == "disaggregated" or self.trainer_processes == 1,
                 f"trainer_processes={self.trainer_processes}: only placement='disaggregated' sets processes "
                 "apart for rollouts (colocated, every process trains)"),
                (not (self.placement == "disaggregated" and self.release_during_update),
                 "release_during_update frees memory on the trainer's devices for the update; "
                 "disaggregated rollouts hold none there: turn it off"),
                one_of("dtype", self.dtype, ("", *DTYPES)),
                decode_choice_rule(self.decode_attention),
                one_of("sampler", self.sampler, SAMPLERS),
                one_of("decode_gemms", self.decode_gemms, tuple(DECODE_GEMMS)))

    def engine_options(self, max_len: int, num_slots: int | None = None) -> dict:
        """``Engine`` keyword arguments for rollouts of up to ``max_len`` tokens; ``num_slots``
        (> 0) overrides ``self.num_slots``."""
        return dict(max_len=int(max_len), page_size=int(self.page_size), kv_pages=int(self.kv_pages),
                    kv_memory_fraction=float(self.kv_memory_fraction),
                    num_slots=int(num_slots or self.num_slots), dtype=self.dtype or None,
                    decode_steps=int(self.decode_steps), prefill_chunk=int(self.prefill_chunk),
                    decode_attention=self.decode_attention, sampler=self.sampler,
                    decode_xla_options=DECODE_GEMMS[self.decode_gemms])

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def rollout_devices_of(self, devices) -> list:
        """The devices rollouts run on, of ``devices`` (this process's): all of them colocated,
        the last ``rollout_devices`` disaggregated."""
        devices = list(devices)
        return devices[-self.rollout_devices:] if self.disaggregated else devices

    def trainer_devices_of(self, devices) -> list:
        """The devices the trainer's mesh takes, of ``devices``: all of them colocated, the
        others than ``rollout_devices_of`` disaggregated."""
        devices = list(devices)
        return devices[:-self.rollout_devices] if self.disaggregated else devices

    def slices(self, devices) -> list:
        """The serving meshes over ``devices`` (this process's local devices; disaggregated: the
        rollout devices among them); [] when ``tensor_parallel`` is 0 (one engine over the
        trainer's arrays; disaggregated: one slice over all the rollout devices)."""
        devices = self.rollout_devices_of(devices)
        if not self.tensor_parallel:
            return [] if not self.disaggregated else slice_meshes(devices, tensor_parallel=len(devices))
        return slice_meshes(devices, tensor_parallel=self.tensor_parallel,
                            num_slices=self.slices_per_host)

    def admit_reserve_tokens(self, max_len: int) -> int:
        """The scheduler's growth reserve per live rollout, in tokens."""
        return int(float(self.admit_reserve_fraction) * max_len)


class ColocatedEngines:
    """One ``Engine`` per serving slice of this process (``serving.slices``; none configured:
    one engine over the model's arrays as they are, or in a multi-process run over all local
    devices; ``serving.placement='disaggregated'``: slices on the rollout devices only, the
    name notwithstanding, each taking its copy device to device), sized from ``serving`` for rollouts of up to ``max_len`` tokens, and the
    ``RolloutScheduler`` over them (``tool_timeout_s``: its wait on a tool's answer;
    ``timeout_s``: the bound on one ``run``)."""

    def __init__(self, model, *, serving: ServingConfig, max_len: int, vocab_limit: int | None,
                 tool_timeout_s: float, timeout_s: float, num_slots: int | None = None):
        """``num_slots`` (> 0) overrides ``serving.num_slots`` (evaluation and the demo)."""
        options = serving.engine_options(max_len, num_slots)
        meshes = serving.slices(jax.local_devices()) or [None]
        # Multi-process: the engines serve this process's own copy (serving.handoff), never the
        # trainer's global arrays; no slices configured = one slice over all local devices.
        self.handoff = None
        layout = layout_of(serving)
        if layout.kind is Layout.ROLLOUT_PROCESSES:
            # a rollout process (recipes.rollout_process): its own model, weights from the trainer's
            require_process_local(nnx.state(model), "the model of a rollout process")
        elif not layout.single_process:
            graphdef, state = nnx.split(model)
            self.handoff = ProcessHandoff(state)
            model = nnx.merge(graphdef, self.handoff(state))
            meshes = [m for m in meshes if m is not None] or [self.handoff.local]
        # One engine per slice, each with its own pool and slots; the scheduler admits
        # rollouts to whichever has the pages.
        self.engines = [Engine(model, vocab_limit=vocab_limit, mesh=mesh, **options)
                        for mesh in meshes]
        self.engine = self.engines[0]
        self.scheduler = RolloutScheduler(
            self.engines, max_rollout_len=self.engine.max_len,
            admit_reserve_tokens=serving.admit_reserve_tokens(self.engine.max_len),
            adaptive_reserve=serving.adaptive_reserve, tool_timeout_s=tool_timeout_s, timeout_s=timeout_s)

    @property
    def serving_dtype(self) -> str:
        """The dtype of the serving weights and KV pages (its name): what the sampler's log-probs are
        computed in (the trainer's log-prob gap alarm reads it)."""
        return self.engine.dtype.name

    def update_params(self, model_or_state) -> None:
        """Serve new weights (an NNX module, e.g. a LoRA policy over the served base, or the served
        model's state); the engines make their serving copies once, here."""
        self.serve_staged(self.stage_params(model_or_state))

    def stage_params(self, model_or_state) -> list:
        """The engines' serving copies of new weights (as ``update_params`` takes them), made now
        (one hand-off program for the host's slices: ``handoff.stage_copies``) and served by
        ``serve_staged``."""
        graphdef, state = split_weights(model_or_state)
        if self.handoff is not None:  # the one cross-process step of rollout, once per update
            state = self.handoff(state)
        return stage_copies(self.engines, state, graphdef)

    # what ``stage_params`` made, served (between scheduler runs), as ``handoff.update_engines`` does
    serve_staged = staticmethod(serve_copies)

    def release_memory(self) -> None:
        """Free every engine's serving copy and KV pool until the next ``update_params``
        (``serving.release_during_update``: called between the rollouts and the train step)."""
        for engine in self.engines:
            engine.release_memory()
