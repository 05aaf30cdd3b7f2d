"""The run's typed configuration: a ``configs/*.py`` ConfigDict parsed ONCE into dataclasses that
are passed down, so nothing below the recipes sees the ConfigDict.

One dataclass per config section, defined where the section is read: ``loss`` ->
``rl.loss.LossConfig``, ``rl`` -> ``rl.config.RLConfig`` (which derives the rollout layer's
``AgentConfig`` and ``SamplingParams``), ``optim`` -> ``rl.optim.OptimConfig``, ``trainer`` ->
``rl.trainer.TrainerConfig``, ``serving`` -> ``serving.colocated.ServingConfig``, ``checkpoint`` ->
``io.checkpoint.CheckpointConfig``; the sections only the recipes read are defined here. Each
dataclass checks its own fields (``validation.require``);
``parse`` adds the rules that span sections, files or devices, and reports every problem at once,
one line each, naming the flag that fixes it. No rule is written twice.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
import re
import typing
from collections.abc import Mapping

import ml_collections

from rstarjax.env.official_reward import REWARD_MODES
from rstarjax.io.checkpoint import CheckpointConfig
from rstarjax.io.data import ANSWER_FILTERS, DATA_HANDLINGS, dataset_problems
from rstarjax.layout import Layout, layout_of
from rstarjax.models.chat_template import CHAT_FORMATS, chat_format
from rstarjax.models.config import DTYPES, LORA_TARGETS, PRESETS, REMAT_POLICIES, ModelConfig
from rstarjax.models.hf_check import model_dir_problems
from rstarjax.models.kv_cache import pages_for
from rstarjax.recipes import demo_tasks
from rstarjax.rl.agent_loop import AgentConfig, require_tool_timeout_fits
from rstarjax.rl.config import RLConfig
from rstarjax.rl.loss import LossConfig
from rstarjax.rl.optim import OptimConfig
from rstarjax.rl.trainer import TrainerConfig
from rstarjax.serving.colocated import ServingConfig
from rstarjax.serving.sampling import SamplingParams
from rstarjax.validation import ConfigError, one_of, require

log = logging.getLogger(__name__)

# config.mode -> rstarjax.main.RECIPES (the function that runs it)
MODES = ("rl", "filter", "sft", "eval", "demo", "demo_compare")
RL_MODES = ("rl", "demo", "demo_compare")  # the modes that run an RL stage
SFT_MODES = ("sft", "demo", "demo_compare")  # the modes that run SFT (the demo's first phase)
DEMO_MODES = ("demo", "demo_compare")  # the modes of configs/demo.py

# Keys that moved: the flag to use instead (an old key fails with this message).
RENAMED = {
    "loss.dr_grpo": "--config.loss.advantage_estimator=dr_grpo",
    "loss.gspo": "--config.loss.policy_loss=gspo",
    "loss.dynamic_sampling": "--config.rl.dynamic_sampling",
    "loss.overlong_filter": "--config.rl.overlong_filter",
    "loss.length_penalty_coef": "--config.rl.length_penalty_coef",
}


# --config.profile: one switch for a group of settings. "paper" (the default) changes nothing: the
# sections' own defaults are rStar2-Agent's paper. "rstar2_official" makes a run do what the
# official rStar2-Agent code does (repository microsoft/rStar, the rstar2_agent recipe on verl;
# docs/algorithm.md "Paper vs. official code" lists every row), for evaluating or further
# training the released checkpoint. A profile writes its keys into the sections the config has;
# a key also given on the command line (--config.SECTION.KEY) keeps the command line's value.
PROFILES: dict[str, dict[str, object]] = {
    "paper": {},
    "rstar2_official": {
        # what the model sees: the official template, tool name, <reason> prefill, tool turn
        "rl.chat_format": "rstar2_official", "sft.chat_format": "rstar2_official",
        "eval.chat_format": "rstar2_official",
        # fused_compute_score's compute_score (microsoft/rStar ecbfb94, fused_compute_score/__init__.py)
        # on the whole response, imported by the program rstar2_agent/reward/server.py runs on
        # code-judge (MAX_EXECUTION_TIME=4: the whole scoring program, its imports included)
        "reward.mode": "official", "reward.time_limit_s": 4.0,
        # examples/run_qwen3-14b_rstar2_agent_weave.sh: data.train_batch_size=128 prompts a step (the
        # paper: 512); rollout.n=32 and down_sample_to_n=16 are the paper's 2G and G
        "rl.prompts_per_step": 128,
        # ... in its one stage (the paper: three, of 300 + 85 + 125 steps): trainer.total_training_steps=200,
        # trainer.total_epochs=15, data.max_prompt_length=2048, data.max_response_length=8192 (the
        # paper's stage 1; its stages 2-3 use 12K). A top-level key (total_steps) is written over the
        # stage config's own, as a section's key is (docs/algorithm.md "Steps per stage")
        "total_steps": 200, "data.num_epochs": 15, "rl.max_prompt_len": 2048, "rl.max_response_len": 8192,
        # data_preprocess/dapo_rstar2_agent_loop.py, then verl's RLHFDataset and sampler: prompts and
        # answers as written, repeats kept, in the official loader's order (io.data.DATA_HANDLINGS)
        "data.handling": "official",
        # rstar2_agent/down_sample/roc.py with the run script's settings
        "rl.roc_variant": "topk", "rl.roc_penalty": "official_text", "rl.roc_min_negatives": 2,
        "rl.roc_min_positives": 2, "rl.reject_equal_reward": True,
        # rstar2_agent_trainer.yaml multi_turn.max_assistant_turns; verl's max_tool_response_length
        "rl.max_turns": 5, "rl.max_tool_response_chars": 256,
        # code-judge's time limit as the rStar README starts it (MAX_EXECUTION_TIME=4): the wrapped
        # program stops itself then, the sandbox kills 1 s later (env/code_judge.py)
        "rl.tool_timeout_s": 4.0,
        # verl's policy loss: dual clip with clip_ratio_c=3; its actor: token means per micro-batch
        "loss.dual_clip_c": 3.0, "loss.token_mean": "micro_batch",
        # verl's get_constant_schedule_with_warmup, stepped once a rollout step: step 0 at rate 0
        "optim.warmup_from_zero": True,
        # ... of its micro-batches by token budget (use_dynamic_bsz, ppo_max_token_len_per_gpu=20480 on
        # 8 GPUs), each GPU's divided by its configured rows (train batch x rollout.n / GPUs)
        "loss.micro_batch_rows": "configured", "loss.micro_batch_tokens": 20480, "loss.micro_batch_gpus": 8,
        # examples/aime_eval.sh: verl's val_kwargs (greedy: temperature 0, top_p 1), n=16,
        # 2048 prompt / 30720 response tokens, 5 assistant turns
        "eval.temperature": 0.0, "eval.top_p": 1.0, "eval.top_k": -1, "eval.k": 16, "eval.max_turns": 5,
        "eval.max_response_len": 30720, "eval.max_prompt_len": 2048,
    },
}


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The ``reward`` section: how a finished rollout is scored."""

    # env.official_reward.REWARD_MODES: "answer" = rStar2-Agent eq. 3 (the last \boxed{} in the
    # model's last <answer> that holds one, verify.is_correct; no <answer> block, no answer);
    # "boxed" = the same, but the model's last \boxed{} where it wrote no <answer> block (a
    # policy without the tags); "official" = the official code's compute_score
    # (fused_compute_score: PRIME grader, then math-verify) on the whole decoded response, tool
    # outputs included
    mode: str = "answer"
    # wall-clock limit of one rollout's scoring in the sandbox (a run past it scores 0); the
    # official reward runs on code-judge under its 4 s limit (rstar2_official sets it)
    time_limit_s: float = AgentConfig.verify_timeout_s

    def __post_init__(self):
        require(one_of("mode", self.mode, REWARD_MODES),
                (math.isfinite(self.time_limit_s) and self.time_limit_s > 0,
                 f"time_limit_s={self.time_limit_s} must be a finite number > 0"),
                (self.mode != "official" or importlib.util.find_spec("pylatexenc") is not None,
                 "mode='official' needs the PRIME grader's pylatexenc: pip install pylatexenc "
                 "(or set --config.reward.mode=answer)"))


def comma_split(values) -> tuple[str, ...]:
    """A tuple setting given as ``--config.KEY=a,b`` arrives as ``("a,b",)``: its items, split as
    the comma-separated path settings are."""
    return tuple(part.strip() for v in values for part in str(v).split(",") if part.strip())


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The ``model`` section: where the policy and its tokenizer come from (``build.policy``)."""

    preset: str = "qwen3-14b"  # ModelConfig.preset; the HF config.json wins when present
    hf_path: str = ""  # directory with config.json + *.safetensors
    random_init: bool = False  # True: the preset with random weights (tests / demos only)
    tokenizer_path: str = ""  # a dir with the model's tokenizer.json; default: hf_path
    # > 0: the small-vocabulary Qwen BPE of that many regular tokens; 0: the tokenizer.json in
    # tokenizer_path / hf_path says (Qwen3's full vocabulary when there is none)
    tokenizer_num_regular_tokens: int = 0
    dtype: str = "bfloat16"  # compute dtype; master weights stay float32
    remat_policy: str = "full"
    # LoRA (docs/lora.md): rank > 0 trains float32 adapters W + (alpha / rank) A B on the
    # comma-separated projections of lora_targets, the base frozen in bfloat16; 0 = every weight
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: str = ",".join(LORA_TARGETS)

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        return comma_split((self.lora_targets,))

    def __post_init__(self):
        bad_targets = [t for t in self.lora_target_names if t not in LORA_TARGETS]
        require((self.lora_rank >= 0, f"lora_rank={self.lora_rank} must be >= 0 (0 = no LoRA)"),
                (self.lora_rank == 0 or self.lora_alpha > 0, f"lora_alpha={self.lora_alpha} must be > 0"),
                (not bad_targets and (self.lora_rank == 0 or self.lora_target_names),
                 f"lora_targets={self.lora_targets!r} must name some of {','.join(LORA_TARGETS)}"),
                one_of("dtype", self.dtype, DTYPES), one_of("remat_policy", self.remat_policy, REMAT_POLICIES),
                (not self.random_init or self.preset in PRESETS,
                 f"preset={self.preset!r} is unknown; known: {sorted(PRESETS)}"),
                (self.tokenizer_num_regular_tokens >= 0,
                 f"tokenizer_num_regular_tokens={self.tokenizer_num_regular_tokens} must be >= 0"))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The ``data`` section: the RL problems (``io.data``)."""

    train_path: str = ""  # jsonl / json / parquet of {"problem", "answer"} rows (docs/data.md)
    shuffle: bool = True
    num_epochs: int = 0  # 0 = repeat forever
    # the answers trained on (io.data.ANSWER_FILTERS): "integer" = rStar2-Agent §4.2's integers only
    # (the default); "any" = also every other answer the verifier can compare
    answer_filter: str = "integer"
    # what loading does to the rows (io.data.DATA_HANDLINGS): "paper" = strip, canonicalise, filter
    # (answer_filter), drop repeats; "official" = as the official code: as written, every row kept
    handling: str = "paper"

    def __post_init__(self):
        require((self.num_epochs >= 0, f"num_epochs={self.num_epochs} must be >= 0 (0 = repeat forever)"),
                one_of("answer_filter", self.answer_filter, ANSWER_FILTERS),
                one_of("handling", self.handling, DATA_HANDLINGS))


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The ``env`` section: the code sandbox (``rstarjax.env``, docs/code_env.md)."""

    # True: run even where the sandbox cannot hide the host's files (datasets, gold answers)
    # from model code (no root and no unprivileged user namespaces); False refuses to start
    allow_unconfined: bool = False


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ``mesh`` section: device mesh (data, fsdp, tensor); -1 = the rest of the devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.data, self.fsdp, self.tensor

    def __post_init__(self):
        sizes = list(self.sizes)
        require((sizes.count(-1) <= 1 and all(s >= 1 or s == -1 for s in sizes),
                 f"data, fsdp, tensor = {sizes}: each must be >= 1, with at most one -1 (= the rest)"))

    def resolved(self, num_devices: int) -> dict[str, int] | None:
        """The axis sizes on ``num_devices`` devices, or None when they do not fit."""
        known = 1
        for s in self.sizes:
            known *= s if s != -1 else 1
        if (-1 in self.sizes and num_devices % known) or (-1 not in self.sizes and known != num_devices):
            return None
        sizes = dict(zip(("data", "fsdp", "tensor"), self.sizes))
        return {k: (num_devices // known if v == -1 else v) for k, v in sizes.items()}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The ``distributed`` section: multi-process runs (``jax.distributed``)."""

    num_processes: int = 1  # > 1: initialize with the fields below
    process_id: int = 0
    coordinator_address: str = ""  # host:port of process 0
    auto: bool = False  # True: jax.distributed.initialize() finds the cluster itself
    timeout_s: int = 300
    # disaggregated placement across processes: how long the rollout process's heartbeat may stop
    # before the trainer process counts it as dead, saves its last finished step and stops
    silence_s: float = 120.0

    def __post_init__(self):
        n, i, address = self.num_processes, self.process_id, self.coordinator_address
        host, _, port = address.rpartition(":")
        explicit = n > 1 or i != 0 or bool(address)
        require((n >= 1, f"num_processes={n} must be >= 1"),
                (0 <= i < max(n, 1), f"process_id={i} must be in [0, num_processes={n})"),
                (not (self.auto and explicit), "auto=True finds the processes, ids and coordinator itself "
                 "(TPU pods, SLURM, Open MPI): drop num_processes / process_id / coordinator_address"),
                (n <= 1 or self.auto or (bool(host) and port.isdigit()),
                 f"coordinator_address={address!r}: with num_processes={n} give process 0's HOST:PORT"),
                (self.timeout_s >= 1, f"timeout_s={self.timeout_s} must be >= 1"),
                (self.silence_s >= 10, f"silence_s={self.silence_s} must be >= 10 (the heartbeat beats every 2 s)"))


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """The ``logging`` section: WORKDIR/logs/metrics.jsonl always; TensorBoard and Weights & Biases
    receive the same scalars (docs/metrics.md lists them)."""

    tensorboard: bool = True
    progress_bar: bool = True
    wandb: bool = False  # also log to Weights & Biases (the optional [wandb] extra); WANDB_MODE=offline works
    wandb_project: str = "rstarjax"
    wandb_entity: str = ""  # "" = the logged-in user's default entity
    wandb_name: str = ""  # the run's name; "" = the workdir's name
    wandb_tags: str = ""  # comma-separated; the mode (rl, sft, ...) is always added

    def __post_init__(self):
        require((not self.wandb or bool(self.wandb_project), "wandb_project is empty: name a W&B project"),
                (not self.wandb or importlib.util.find_spec("wandb") is not None,
                 'wandb=True needs the wandb package: pip install -e ".[wandb]" (or set --config.logging.wandb=False)'))


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """The ``filter`` section: the stage-3 difficulty filter (rStar2-Agent §4.3)."""

    k: int = 8  # rollouts per problem with the latest policy
    output_path: str = ""  # default: WORKDIR/filtered.jsonl
    batch_prompts: int = 64

    def __post_init__(self):
        require((self.k >= 1, f"k={self.k} must be >= 1"),
                (self.batch_prompts >= 1, f"batch_prompts={self.batch_prompts} must be >= 1"),
                # written only after every rollout: a directory there failed at the very end
                (not os.path.isdir(self.output_path),
                 f"output_path={self.output_path!r} is a directory: give the .jsonl file to write"))


def trainer_rules(compute_dtype) -> list[tuple[bool, str]]:
    """``TrainerConfig``'s rule on ``compute_dtype``, for a section that hands it one (SFT builds its
    trainer only after the model: a bad dtype would be found there)."""
    try:
        TrainerConfig(compute_dtype=compute_dtype)
    except ConfigError as e:
        return [(False, line) for line in str(e).splitlines()]
    return []


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The ``sft`` section: non-reasoning SFT (rStar2-Agent §5.1: 3 epochs, lr 5e-6, 4 % warm-up,
    cosine decay, batch 128)."""

    data_path: str = ""  # jsonl / parquet of {"messages": [...]} (OpenAI style, with tool calls)
    chat_format: str = "rstar2"  # models.chat_template.CHAT_FORMATS
    epochs: int = 3
    batch_size: int = 128  # conversations per optimizer step
    learning_rate: float = 5e-6
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip_norm: float = 1.0
    seq_len: int = 4096  # packed row length; longer conversations are dropped (and counted)
    micro_batch_size: int = 0  # rows per gradient-accumulation micro-step; 0 = all rows at once
    max_steps: int = 0  # > 0: stop early (CI / demo); the schedule still spans max_steps
    seed: int = 0
    compute_dtype: str | None = None
    export_hf: bool = False  # also write WORKDIR/hf at the end
    # an update whose loss or norms are not finite is skipped; after this many in a row the run
    # stops with an error (it diverged: lower learning_rate), as RL's trainer.max_nonfinite_steps
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        at_least_one = [(getattr(self, n) >= 1, f"{n}={getattr(self, n)} must be >= 1")
                        for n in ("epochs", "batch_size", "seq_len", "max_nonfinite_steps")]
        require(*at_least_one,
                (math.isfinite(self.learning_rate) and self.learning_rate > 0,
                 f"learning_rate={self.learning_rate} must be a finite number > 0"),
                (0.0 <= self.warmup_ratio < 1.0, f"warmup_ratio={self.warmup_ratio} must be in [0, 1)"),
                (0 <= self.seed < 2**32, f"seed={self.seed} must be in [0, 2**32)"),
                (self.micro_batch_size >= 0, f"micro_batch_size={self.micro_batch_size} must be >= 0"),
                # plan[:max_steps]: -1 would silently drop the last step
                (self.max_steps >= 0, f"max_steps={self.max_steps} must be >= 0 (0 = every step of the epochs)"),
                # the cosine ends at learning_rate * min_lr_ratio: < 0 would ascend, > 1 grow
                (0.0 <= self.min_lr_ratio <= 1.0, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]"),
                (self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0"),
                *trainer_rules(self.compute_dtype),
                one_of("chat_format", self.chat_format, CHAT_FORMATS))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The ``eval`` section (rStar2-Agent §5.1): k samples per problem at temperature 0.6, up to
    30K tokens and 30 turns; pass@1 over k, maj@k, pass@k."""

    paths: str = ""  # comma-separated jsonl / parquet benchmark files (AIME / MATH-500 layouts)
    names: tuple = ()  # dataset names; default the file stems
    limit: int = 0  # > 0: first N problems of each file
    k: int = 16
    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = -1
    max_turns: int = 30
    max_response_len: int = 30 * 1024
    max_prompt_len: int = 2048
    num_slots: int = 64
    timeout_s: float = 24 * 3600.0
    # "": the format the model records (its checkpoint's meta, its HF export's chat template),
    # else "rstar2" (a plain HF model). Prompts of another format than the model was trained on
    # score it low with no error, so only a format named here (or by a profile) overrides it.
    chat_format: str = ""

    @property
    def path_list(self) -> list[str]:
        return [p for p in str(self.paths).split(",") if p]

    def __post_init__(self):
        object.__setattr__(self, "names", comma_split(self.names))
        rules = [(self.k >= 1, f"k={self.k} must be >= 1"), (self.limit >= 0, f"limit={self.limit} must be >= 0"),
                 (self.max_prompt_len >= 1, f"max_prompt_len={self.max_prompt_len} must be >= 1"),
                 (self.num_slots >= 0, f"num_slots={self.num_slots} must be >= 0 (0 = serving.num_slots)"),
                 (not self.names or len(self.names) == len(self.path_list),
                  f"names={','.join(self.names)!r} gives {len(self.names)} names for the {len(self.path_list)} "
                  "files of eval.paths: one name per file, in order (or none: the file stems)"),
                 one_of("chat_format", self.chat_format, {"", *CHAT_FORMATS})]
        try:  # the rollout layer's own rules on the values it takes from this section
            RLConfig().agent(**self.budgets()), self.sampling()
        except ValueError as e:  # (in this section's names: its timeout_s is the agent's rollout_timeout_s)
            rules += [(False, re.sub(r"^rollout_timeout_s\b", "timeout_s", line)) for line in str(e).splitlines()]
        require(*rules)

    def budgets(self) -> dict:
        """The evaluation's budgets, over the RL runs' in ``RLConfig.agent`` (the tool's own limits
        stay the ``rl`` section's)."""
        return dict(max_turns=self.max_turns, max_response_len=self.max_response_len, rollout_timeout_s=self.timeout_s)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(0, self.top_k))


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The ``demo`` section (configs/demo.py documents every field)."""

    model: dict = dataclasses.field(default_factory=dict)  # ModelConfig fields of the demo's tiny Qwen3
    task_kinds: tuple = ()  # () = all of demo_tasks.TASK_KINDS
    in_head_fraction: dict = dataclasses.field(default_factory=dict)  # kind -> share of in-head SFT traces
    recover_fraction: dict = dataclasses.field(default_factory=dict)  # kind -> share of recovery SFT traces
    num_sft_problems: int = 11000
    num_rl_problems: int = 4096
    num_eval_problems: int = 256
    num_slots: int = 64
    export_hf: bool = True
    overwrite: bool = False
    sft_checkpoint: str = ""  # an earlier run's WORKDIR/sft/checkpoints: start RL from it, skip SFT

    def __post_init__(self):
        object.__setattr__(self, "task_kinds", comma_split(self.task_kinds))
        unknown = [k for k in self.task_kinds if k not in demo_tasks.ALL_KINDS]
        counts = [("num_rl_problems", 1), ("num_eval_problems", 1),
                  ("num_sft_problems", 0 if self.sft_checkpoint else 1)]  # with sft_checkpoint SFT is skipped
        rules = [(getattr(self, n) >= least, f"{n}={getattr(self, n)} must be >= {least}") for n, least in counts]
        rules += [(not unknown, f"task_kinds={','.join(self.task_kinds)!r}: {unknown} unknown; choose among "
                                f"{','.join(demo_tasks.ALL_KINDS)} (none = {','.join(demo_tasks.TASK_KINDS)})"),
                  (self.num_slots >= 0, f"num_slots={self.num_slots} must be >= 0 (0 = serving.num_slots)")]
        for name in ("in_head_fraction", "recover_fraction"):  # kind -> the share of its SFT traces
            for kind, share in dict(getattr(self, name)).items():
                rules += [(kind in demo_tasks.ALL_KINDS,
                           f"{name}.{kind}: no such task kind; choose among {','.join(demo_tasks.ALL_KINDS)}"),
                          (isinstance(share, (int, float)) and 0.0 <= share <= 1.0,
                           f"{name}.{kind}={share} must be a share in [0, 1]")]
        require(*rules)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run: ``mode`` picks the recipe (``rstarjax.main.RECIPES``)."""

    mode: str = "rl"
    seed: int = 0
    profile: str = "paper"  # PROFILES: the group of settings the run started from
    total_steps: int = 300  # optimizer steps at the end of this stage (the global step count)
    # jax's persistent compilation cache ("" = off; rstarjax/io/compile_cache.py)
    compilation_cache_dir: str = "~/.cache/rstarjax/xla"
    model: ModelSource = dataclasses.field(default_factory=ModelSource)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    serving: ServingConfig = dataclasses.field(default_factory=ServingConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    filter: FilterConfig = dataclasses.field(default_factory=FilterConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    sft: SFTConfig | None = None  # the sections of configs/sft.py, eval.py, demo.py
    eval: EvalConfig | None = None
    demo: DemoConfig | None = None

    def agent(self) -> AgentConfig:
        """The rollouts' budgets of an RL stage (``rl``) with the run's reward (``reward``)."""
        return self.rl.agent(self.reward.mode, verify_timeout_s=self.reward.time_limit_s)

    def eval_agent(self) -> AgentConfig:
        """The evaluation's budgets (``eval``) with the run's reward."""
        return self.rl.agent(self.reward.mode, verify_timeout_s=self.reward.time_limit_s, **self.eval.budgets())


# section name -> its dataclass (a section absent from the ConfigDict keeps the defaults; sft,
# eval and demo stay None, and the modes that need them say so)
SECTIONS = {"model": ModelSource, "data": DataConfig, "rl": RLConfig, "reward": RewardConfig, "loss": LossConfig,
            "optim": OptimConfig,
            "trainer": TrainerConfig, "serving": ServingConfig, "mesh": MeshConfig, "distributed": DistributedConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig, "filter": FilterConfig, "env": EnvConfig,
            "sft": SFTConfig,
            "eval": EvalConfig, "demo": DemoConfig}
_TOP_LEVEL = ("mode", "seed", "profile", "total_steps", "compilation_cache_dir")
# the sections of every run's ConfigDict (configs/base.py); sft, eval and demo come with their presets
BASE_SECTIONS = ("model", "data", "rl", "reward", "serving", "loss", "optim", "trainer", "mesh", "distributed",
                 "checkpoint", "logging", "filter", "env")


def _field_default(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def section_config(name: str, **changes) -> ml_collections.ConfigDict:
    """The ``name`` section as a ConfigDict: every field of its dataclass (``SECTIONS``) at the
    dataclass's default, the one place that default is written, with ``changes`` over them. A
    field that defaults to None becomes a placeholder of its declared type, so that
    ``--config.SECTION.KEY=VALUE`` can parse a value for it."""
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    unknown = set(changes) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise KeyError(f"{name} has no fields {sorted(unknown)}")
    values = {}
    for field in dataclasses.fields(cls):
        value = changes.get(field.name, _field_default(field))
        if value is None:
            [declared] = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
            value = ml_collections.config_dict.placeholder(declared)
        values[field.name] = value
    return ml_collections.ConfigDict(values)


def default_config(mode: str = "rl") -> ml_collections.ConfigDict:
    """configs/base.py's ConfigDict: the top-level keys at ``RunConfig``'s defaults and each of
    ``BASE_SECTIONS`` at its dataclass's (``section_config``)."""
    c = ml_collections.ConfigDict()
    for key in _TOP_LEVEL:
        c[key] = mode if key == "mode" else getattr(RunConfig, key)
    for name in BASE_SECTIONS:
        c[name] = section_config(name)
    return c


_SETTING = re.compile(r"(?<![\w.-])(" + "|".join(SECTIONS) + r")\.(\*|[A-Za-z_]\w*)")


def as_flags(message: str) -> str:
    """``message`` with each setting it names in the config's own terms, ``SECTION.KEY`` (``serving.kv_pages``,
    ``rl.max_response_len``; ``distributed.*``: the whole section), written as the flag that sets it
    (``--config.serving.kv_pages``). The layers below the recipes name settings so; the recipes
    turn their messages into the command line's (one place: a flag is spelled nowhere below).
    A ``SECTION.NAME`` that is not a key of the section (``serving.sizing``) is left as it is."""
    def flag(m: re.Match) -> str:
        section, key = m.groups()
        known = key == "*" or key in {f.name for f in dataclasses.fields(SECTIONS[section])}
        return f"--config.{section}.{key}" if known else m.group(0)
    return _SETTING.sub(flag, message)


def _plain(value):
    """ConfigDict / FrozenConfigDict values (nested sections such as demo.model) as plain dicts."""
    return value.to_dict() if hasattr(value, "to_dict") else value


def profile_sections(config, profile: str, explicit=frozenset()) -> dict[str, dict]:
    """The sections of ``config`` as plain dicts with ``PROFILES[profile]`` written in: a profile
    key lands in a section the config has (or in ``reward``, which every run has), unless the
    command line gave it (``explicit``: dotted keys such as "rl.max_turns")."""
    sections = {name: {k: _plain(v) for k, v in dict(config[name]).items()} for name in SECTIONS if name in config}
    for dotted, value in PROFILES[profile].items():
        if dotted in _TOP_LEVEL:  # a top-level key (total_steps): parse reads it
            continue
        name, key = dotted.split(".", 1)
        if dotted in explicit or (name not in sections and name != "reward"):
            continue
        sections.setdefault(name, {})[key] = value
    return sections


# The float settings for which inf means something (no cap, no upper clip: LossConfig's
# comments); everywhere else inf is a value no run can use (an ``int(inf)`` sizing a reserve,
# a thread's ``join(inf)`` overflowing, an inf loss term) and NaN never is one.
INFINITY_ALLOWED = frozenset({"loss.decoupled_cap", "loss.tis_cap", "loss.dual_clip_c", "loss.eps_high",
                              "loss.gspo_eps_high"})


def non_finite_settings(name: str, items: Mapping) -> dict[str, float]:
    """The float values of section ``name`` that no run can use: NaN anywhere, inf outside
    ``INFINITY_ALLOWED``. (``--config.rl.rollout_timeout_s=inf`` parsed, then crashed the first
    rollout step with an OverflowError.)"""
    return {k: v for k, v in items.items() if isinstance(v, float) and not math.isfinite(v)
            and (math.isnan(v) or f"{name}.{k}" not in INFINITY_ALLOWED)}


def _names_setting(line: str, key: str) -> bool:
    """Whether a rule's message names the setting ``key`` (not a longer key that ends in it)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}\b", line) is not None


def _parse_section(name: str, section: Mapping, errors: list[str]):
    cls = SECTIONS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    items = dict(section)
    for key in items:
        if key not in fields:
            hint = RENAMED.get(f"{name}.{key}")
            errors.append(f"--config.{name}.{key} " + (f"was replaced: use {hint}" if hint else
                                                      f"is not a key of this section (known: {sorted(fields)})"))
    lines: list[str] = []
    try:
        parsed = cls(**{k: v for k, v in items.items() if k in fields})
    except (ConfigError, ValueError, TypeError, OverflowError) as e:
        lines, parsed = str(e).splitlines(), None
    # a non-finite value the section's own rules let through (or named only in passing) gets its line
    lines += [f"{key}={value} must be a finite number" for key, value in non_finite_settings(name, items).items()
              if key in fields and not any(_names_setting(line, key) for line in lines)]
    errors.extend(as_flags(f"--config.{name}.{line}") for line in lines)
    return None if lines else parsed


def parse(config, num_devices: int | None = None, num_processes: int = 1, explicit=frozenset()) -> RunConfig:
    """The typed RunConfig of a ConfigDict; ConfigError listing every problem (one per line) with
    the flag that fixes it. ``num_devices``: also check the mesh and the batch sizes against the
    devices (None skips the device checks; ``rstarjax.main`` runs them once JAX is up).
    ``config.profile`` (``PROFILES``) is applied first; ``explicit``: the dotted keys the command
    line set, which keep their values (``rstarjax.main`` passes them)."""
    mode = config.get("mode")
    if mode not in MODES:
        raise ConfigError(f"config.mode={mode!r} is unknown; choose one of {sorted(MODES)} "
                          "(e.g. --config=configs/stage3.py:filter)")
    errors: list[str] = []
    for key in config:
        if key not in SECTIONS and key not in _TOP_LEVEL:
            errors.append(f"--config.{key} is not a config section (known: {sorted(SECTIONS)})")
    profile = config.get("profile", RunConfig.profile)
    if profile not in PROFILES:
        raise ConfigError(f"invalid config:\n  --config.profile={profile!r} is unknown; choose one of {sorted(PROFILES)}")
    raw = profile_sections(config, profile, frozenset(explicit))
    sections = {name: _parse_section(name, raw[name], errors) for name in SECTIONS if name in raw}
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    steps = PROFILES[profile].get("total_steps") if "total_steps" not in explicit else None
    run = RunConfig(mode=mode, seed=int(config.get("seed", RunConfig.seed)), profile=profile,
                    total_steps=int(config.get("total_steps", RunConfig.total_steps) if steps is None else steps),
                    compilation_cache_dir=str(config.get("compilation_cache_dir",
                                                         RunConfig.compilation_cache_dir)),
                    **sections)
    errors = _run_rules(run)
    if not errors and num_devices is not None:
        errors = device_rules(run, num_devices, num_processes)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    for warning in run_warnings(run):  # valid, but likely not what was meant: said at the start
        log.warning(warning)
    return run


def wandb_init_args(run: RunConfig, workdir: str) -> dict | None:
    """``wandb.init``'s arguments for this run, or None when ``logging.wandb`` is off: the project,
    entity, run name (default: the workdir's name), tags (the mode, then ``logging.wandb_tags``)
    and the whole typed config with the workdir."""
    lg = run.logging
    if not lg.wandb:
        return None
    workdir = os.path.abspath(workdir)
    tags = [run.mode] + list(comma_split((lg.wandb_tags,)))
    return {"project": lg.wandb_project, "entity": lg.wandb_entity or None,
            "name": lg.wandb_name or os.path.basename(workdir), "tags": list(dict.fromkeys(tags)),
            "config": {**dataclasses.asdict(run), "workdir": workdir}}


def _require_file(path: str, flag: str, what: str) -> list[str]:
    if not path:
        return [f"{flag} is empty: set {flag}=/path/to/{what}"]
    if not os.path.exists(path):
        return [f"{flag}={path!r} does not exist: point it at {what}"]
    return []


def _problems_file(path: str, flag: str, what: str, kind: str = "problems") -> list[str]:
    """``_require_file``, then what its first rows say (``io.data.dataset_problems``)."""
    return _require_file(path, flag, what) or [as_flags(f"{flag}={path!r} {p}") for p in dataset_problems(path, kind)]


def run_warnings(run: RunConfig) -> list[str]:
    """What a valid config does that its user may not mean: ``parse`` logs each line at the start
    of the run (and ``check_config`` shows them), without refusing it."""
    warning = truncated_sampling_warning(run)
    return [warning] if warning else []


def truncated_sampling_warning(run: RunConfig) -> str | None:
    """The warning of an RL stage that samples with top-p < 1 or top-k > 0, else None.

    The rollouts are then drawn from the truncated distribution pi / Z (Z: the mass top-p /
    top-k keep), while the log-prob the sampler records and the trainer recomputes is the
    untruncated ``log_softmax(logits / T)`` (verl's choice, docs/algorithm.md): the importance
    ratio and the loss leave the truncation out. Allowed (some want it), but said."""
    rl = run.rl
    flags = [flag for flag, on in ((f"--config.rl.top_p={rl.top_p:g}", rl.top_p < 1.0),
                                   (f"--config.rl.top_k={rl.top_k}", rl.top_k > 0)) if on]
    if run.mode not in RL_MODES or not flags:
        return None
    # top-p keeps at least top_p of the mass (the token crossing it included); top-k any share
    bound = f"at most -log(top_p) = {-math.log(rl.top_p):.3g} nats" if rl.top_k <= 0 else "unbounded with top-k"
    return (f"{' and '.join(flags)}: the RL rollouts are drawn from the truncated distribution, but the "
            "log-prob the sampler records and the trainer recomputes is the untruncated "
            "log_softmax(logits / rl.temperature) (as verl's), so the importance ratio ignores the truncation: "
            f"each drawn token's behaviour log-prob is understated by -log(the mass kept), {bound}, and the "
            "sampler/trainer log-prob gap metrics cannot show it (both sides agree). Set --config.rl.top_p=1.0 "
            "--config.rl.top_k=-1 (the defaults) to train on the distribution sampled (docs/algorithm.md).")


def _tool_timeout_rules(run: RunConfig) -> list[str]:
    """The code-judge protocol's own limit on ``rl.tool_timeout_s`` (``require_tool_timeout_fits``),
    said at start, not when the rollouts are built after the model."""
    if run.mode in (*RL_MODES, "filter"):
        agent, fmt = run.agent(), run.rl.chat_format
    elif run.mode == "eval" and run.eval is not None and run.eval.chat_format:
        agent, fmt = run.eval_agent(), run.eval.chat_format
    else:
        return []
    if fmt not in CHAT_FORMATS:  # refused by its section's own rule
        return []
    try:
        require_tool_timeout_fits(agent, chat_format(fmt))
    except ConfigError as e:
        return [as_flags(str(e))]
    return []


def _run_rules(run: RunConfig) -> list[str]:
    """The rules a mode puts on several sections or on files."""
    errs: list[str] = []
    mode, m, ck = run.mode, run.model, run.checkpoint
    if not 0 <= run.seed < 2**32:  # jax's and numpy's seeds
        errs.append(f"--config.seed={run.seed} must be in [0, 2**32)")
    if mode in ("rl", "filter", "sft", "eval") and not m.random_init:
        errs += _require_file(m.hf_path, "--config.model.hf_path", "a HF model dir (config.json + *.safetensors)")
        if m.hf_path and os.path.exists(m.hf_path) and not os.path.isdir(m.hf_path):
            errs.append(f"--config.model.hf_path={m.hf_path!r} is a file: give the HF model's directory")
        elif m.hf_path and os.path.isdir(m.hf_path) and not os.path.exists(os.path.join(m.hf_path, "config.json")):
            errs.append(f"--config.model.hf_path={m.hf_path!r} has no config.json")
        elif m.hf_path and os.path.isdir(m.hf_path):  # its headers against its config, its tokenizer's size
            errs += [as_flags(f"--config.model.hf_path={m.hf_path!r}: {p}") for p in
                     model_dir_problems(m.hf_path, m.tokenizer_path, m.tokenizer_num_regular_tokens)]
    errs += _tokenizer_path_rules(m)
    if mode in ("rl", "filter"):
        errs += _problems_file(run.data.train_path, "--config.data.train_path", "a jsonl/parquet of problems")
        if ck.init_from and not os.path.isdir(ck.init_from):
            errs.append(f"--config.checkpoint.init_from={ck.init_from!r} is not a directory "
                        "(give the previous stage's WORKDIR/checkpoints)")
    if mode in RL_MODES:
        rl, tr = run.rl, run.trainer
        if run.total_steps < 1:
            errs.append(f"--config.total_steps={run.total_steps} must be >= 1")
        if rl.temperature <= 0:
            errs.append(f"--config.rl.temperature={rl.temperature} must be > 0 for RL sampling")
        if run.loss.decoupled_cap is not None and not tr.recompute_old_logprobs:
            errs.append(f"--config.loss.decoupled_cap={run.loss.decoupled_cap} needs "
                        "--config.trainer.recompute_old_logprobs=True: decoupled PPO's proximal policy is the "
                        "trainer's recomputed log-probs (without them it equals the behaviour policy)")
        if run.loss.tis_cap is not None and not tr.recompute_old_logprobs:
            errs.append(f"--config.loss.tis_cap={run.loss.tis_cap} needs --config.trainer.recompute_old_logprobs=True: "
                        "its weight is the trainer's recomputed log-prob over the sampler's (without them it is "
                        "exactly 1, no correction)")
        if rl.max_staleness and run.loss.tis_cap is None and run.loss.decoupled_cap is None:
            errs.append(f"--config.rl.max_staleness={rl.max_staleness} trains on rollouts that older policies "
                        "sampled: give it an off-policy correction, --config.loss.decoupled_cap (decoupled PPO, "
                        "e.g. 5.0) or --config.loss.tis_cap (truncated importance sampling)")
        if rl.max_staleness and run.serving.release_during_update:
            errs.append("--config.serving.release_during_update=True frees the engines' memory for the update, "
                        f"while --config.rl.max_staleness={rl.max_staleness} keeps them rolling out during it: "
                        "turn one off")
        rows = rl.prompts_per_step * rl.group_size
        if rows % tr.mini_batches:
            errs.append(f"--config.trainer.mini_batches={tr.mini_batches} must divide the {rows} rows per step "
                        f"(prompts_per_step * group_size)")
        elif (rows // tr.mini_batches) % (tr.micro_batch_size or rows // tr.mini_batches):
            errs.append(f"--config.trainer.micro_batch_size={tr.micro_batch_size} must divide the mini-batch of "
                        f"{rows // tr.mini_batches} rows (prompts_per_step * group_size / mini_batches)")
    if run.serving.disaggregated and mode != "rl":
        errs.append(f"--config.serving.placement='disaggregated' is for RL stages (mode='rl'), not mode={mode!r}")
    if mode == "rl" and (ck.reset_optimizer or ck.update_reference) and not ck.init_from:
        errs.append("stage-3 options (checkpoint.reset_optimizer / update_reference) need "
                    "--config.checkpoint.init_from=STAGE2_WORKDIR/checkpoints")
    for name, modes in (("sft", ("sft", *DEMO_MODES)), ("eval", ("eval",)), ("demo", DEMO_MODES)):
        if mode in modes and getattr(run, name) is None:
            source = "demo" if mode in DEMO_MODES else mode
            errs.append(f"mode={mode!r} needs a --config.{name} section (configs/{source}.py has it)")
    if mode in DEMO_MODES and run.demo is not None and run.demo.sft_checkpoint \
            and not os.path.isdir(run.demo.sft_checkpoint):
        errs.append(f"--config.demo.sft_checkpoint={run.demo.sft_checkpoint!r} is not a directory "
                    "(give an earlier demo run's WORKDIR/sft/checkpoints)")
    if mode == "filter":
        errs += _filter_rules(run)
    if ck.init_from and mode in ("sft", *DEMO_MODES):  # these recipes never read it
        start = "--config.demo.sft_checkpoint=OLD_WORKDIR/sft/checkpoints" if mode in DEMO_MODES else \
            "--config.model.hf_path (a checkpoint's policy: rstarjax.export to HF first)"
        errs.append(f"--config.checkpoint.init_from={ck.init_from!r} is not read by mode={mode!r}: drop it; "
                    f"to start from earlier weights use {start}")
    if mode in DEMO_MODES and run.demo is not None:
        errs += _demo_model_rules(run)
    errs += _kv_pages_rules(run)
    if mode == "sft" and run.sft is not None:
        errs += _problems_file(run.sft.data_path, "--config.sft.data_path",
                               'a jsonl/parquet of {"messages": [...]} chat records', "conversations")
    errs += _tool_timeout_rules(run)
    if mode == "eval" and run.eval is not None:
        if not run.eval.path_list:
            errs.append("--config.eval.paths is empty: set --config.eval.paths=aime24.jsonl,math500.parquet")
        for path in run.eval.path_list:
            errs += _problems_file(path, "--config.eval.paths", "a benchmark jsonl/parquet")
    return errs


def _tokenizer_path_rules(m: ModelSource) -> list[str]:
    """A ``model.tokenizer_path`` that is not there, or holds no tokenizer.json, was silently
    replaced by Qwen3's full tokenizer (``models.tokenizer.load_tokenizer_for``)."""
    path, flag = m.tokenizer_path, "--config.model.tokenizer_path"
    if not path:
        return []
    if not os.path.isdir(path):
        return [f"{flag}={path!r} is not a directory: give the one holding the model's tokenizer.json "
                "(or leave it empty)"]
    if not m.tokenizer_num_regular_tokens and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return [f"{flag}={path!r} has no tokenizer.json: point it at the model's tokenizer "
                "(or set --config.model.tokenizer_num_regular_tokens)"]
    return []


def _filter_rules(run: RunConfig) -> list[str]:
    """The stage-3 filter's output must not be its input, and its k rollouts must differ."""
    errs, out, data = [], run.filter.output_path, run.data.train_path
    if out and data and os.path.exists(data) and os.path.realpath(out) == os.path.realpath(data):
        errs.append(f"--config.filter.output_path={out!r} is --config.data.train_path: the filtered set would "
                    "overwrite the problems it is read from; write it elsewhere (default: WORKDIR/filtered.jsonl)")
    if run.filter.k > 1 and run.rl.temperature == 0:  # greedy rollouts of one problem are all one rollout
        errs.append(f"--config.rl.temperature=0 samples the same rollout --config.filter.k={run.filter.k} times: "
                    "give a temperature > 0 (e.g. 1.0) or --config.filter.k=1")
    return errs


def _demo_model_rules(run: RunConfig) -> list[str]:
    """``demo.model``: ModelConfig fields over the ``model.preset``; a wrong one failed only once the
    data was generated and the tokenizer built (``recipes.demo.demo_policy``)."""
    try:
        ModelConfig.preset(run.model.preset, **dict(run.demo.model))
    except (TypeError, ValueError) as e:
        reason = str(e).replace("ModelConfig.__init__() got an ", "")
        return [f"--config.demo.model (ModelConfig fields over model.preset={run.model.preset!r}): {reason}"]
    return []


def _kv_pages_rules(run: RunConfig) -> list[str]:
    """An explicit ``serving.kv_pages`` too small for one maximum-length rollout: the engine says so
    (``serving.sizing.plan_kv``), but only once the model is built; the page count needs no model."""
    sv = run.serving
    if not sv.kv_pages or run.mode == "sft":
        return []
    budgets = ((run.eval.max_prompt_len, run.eval.max_response_len, "eval") if run.mode == "eval" and run.eval
               else (run.rl.max_prompt_len, run.rl.max_response_len, "rl"))
    prompt, response, section = budgets
    need = pages_for(prompt + response, sv.page_size)
    if sv.kv_pages >= need:
        return []
    return [f"--config.serving.kv_pages={sv.kv_pages} cannot hold one maximum-length rollout: {prompt + response} "
            f"tokens (--config.{section}.max_prompt_len + max_response_len) need {need} pages of "
            f"--config.serving.page_size={sv.page_size}; set --config.serving.kv_pages={need} or more "
            "(0 = sized from memory)"]


def trainer_device_count(sv, num_devices: int, num_processes: int = 1) -> int:
    """The devices the trainer's mesh spans, of ``num_devices`` in ``num_processes`` processes:
    all of them colocated; disaggregated in one process the others than ``rollout_devices``;
    across processes the training processes' own (``serving.trainer_processes`` of them)."""
    if layout_of(sv, num_processes, 0).kind is Layout.ROLLOUT_PROCESSES:
        return sv.trainer_processes * (num_devices // num_processes)
    return num_devices - sv.rollout_devices if sv.disaggregated else num_devices


def mesh_hint(sizes: tuple[int, ...], num_devices: int) -> str:
    """A fix for mesh axis ``sizes`` (data, fsdp, tensor; -1 = the rest) that do not fit
    ``num_devices``: name the fixed axes that do not divide the devices, or else suggest leaving
    fsdp to take the rest (when it does not already)."""
    names = ("data", "fsdp", "tensor")
    odd = [f"--config.mesh.{n}={v}" for n, v in zip(names, sizes) if v not in (-1, 0) and num_devices % v]
    if odd:
        return f": {' and '.join(odd)} {'does' if len(odd) == 1 else 'do'} not divide {num_devices}"
    if sizes[1] != -1 and -1 not in sizes:
        return ", e.g. --config.mesh.fsdp=-1 (the devices the other axes leave)"
    return ": the axes set take more devices than there are, or a product that does not divide them"


def device_rules(run: RunConfig, num_devices: int, num_processes: int = 1) -> list[str]:
    """The rules the devices and processes put on the mesh and the batch sizes."""
    sv = run.serving
    across = layout_of(sv, num_processes, 0).kind is Layout.ROLLOUT_PROCESSES
    if across:  # processes 0 .. T - 1 train, the others roll out (rl.remote)
        per, trainers = num_devices // num_processes, sv.trainer_processes
        if sv.rollout_devices != per or sv.tensor_parallel not in (0, per):
            return [f"--config.serving.placement='disaggregated' across processes: the training processes train "
                    f"on their {per} devices each, every other process rolls out on all of its own as one slice "
                    f"(--config.serving.rollout_devices={per}, --config.serving.tensor_parallel=0); got "
                    f"rollout_devices={sv.rollout_devices}, tensor_parallel={sv.tensor_parallel}"]
        if trainers >= num_processes or (num_processes - trainers) % trainers:
            return [f"--config.serving.trainer_processes={trainers} of {num_processes} processes: each training "
                    f"process drives as many rollout processes as the others, so the {num_processes - trainers} "
                    f"left must be a positive multiple of {trainers}"]
    elif sv.trainer_processes > 1:
        return [f"--config.serving.trainer_processes={sv.trainer_processes} needs a multi-process run with "
                "placement='disaggregated' (processes apart for rollouts); this run has one process"]
    elif sv.disaggregated and sv.rollout_devices >= num_devices:
        return [f"--config.serving.rollout_devices={sv.rollout_devices} must leave the trainer some of the "
                f"{num_devices} devices of its process"]
    # the trainer's mesh: the training processes' devices, or the others than the rollout slices'
    num_devices = trainer_device_count(sv, num_devices, num_processes)
    num_processes = sv.trainer_processes if across else num_processes
    sizes = run.mesh.resolved(num_devices)
    if sizes is None:
        return [f"mesh (data, fsdp, tensor)={list(run.mesh.sizes)} does not fit the {num_devices} devices "
                f"{'the rollout slices leave' if sv.disaggregated else 'present'}: "
                f"make data*fsdp*tensor == {num_devices}{mesh_hint(run.mesh.sizes, num_devices)}"]
    errs = []
    if run.mode in SFT_MODES and run.sft.micro_batch_size % (sizes["data"] * sizes["fsdp"]):
        errs.append(f"--config.sft.micro_batch_size={run.sft.micro_batch_size} must be a multiple of "
                    f"data*fsdp={sizes['data'] * sizes['fsdp']} (each device takes an equal share of every "
                    "micro-batch; 0 takes the step's rows whole)")
    if run.mode in RL_MODES:
        rl, tr = run.rl, run.trainer
        if rl.prompts_per_step % max(num_processes, 1):
            errs.append(f"--config.rl.prompts_per_step={rl.prompts_per_step} must be a positive multiple of the "
                        f"{num_processes} processes")
        mbs = tr.micro_batch_size or rl.prompts_per_step * rl.group_size // tr.mini_batches
        dp = sizes["data"] * sizes["fsdp"]
        if mbs % dp and tr.micro_batch_size:
            errs.append(f"--config.trainer.micro_batch_size={mbs} must be a multiple of data*fsdp={dp} "
                        "(each device takes an equal share of every micro-batch)")
        elif mbs % dp:  # 0: one micro-batch of the whole mini-batch, whose rows are derived
            errs.append(f"the {mbs} rows of a mini-batch (--config.rl.prompts_per_step={rl.prompts_per_step} x "
                        f"--config.rl.group_size={rl.group_size} / --config.trainer.mini_batches={tr.mini_batches}; "
                        f"--config.trainer.micro_batch_size=0 takes them whole) must be a multiple of "
                        f"data*fsdp={dp} (each device takes an equal share of every micro-batch)")
    local = sv.rollout_devices if sv.disaggregated else num_devices // max(num_processes, 1)
    where = "given to rollouts (serving.rollout_devices)" if sv.disaggregated else "of each process"
    if sv.tensor_parallel > local:
        errs.append(f"--config.serving.tensor_parallel={sv.tensor_parallel} exceeds the {local} devices {where} "
                    "(a serving slice stays on one host)")
    elif sv.tensor_parallel and sv.slices_per_host * sv.tensor_parallel > local:
        errs.append(f"--config.serving.slices_per_host={sv.slices_per_host} slices of tensor_parallel="
                    f"{sv.tensor_parallel} devices need {sv.slices_per_host * sv.tensor_parallel}, there are "
                    f"{local} {where}: lower it, or 0 = as many as fit")
    return errs
