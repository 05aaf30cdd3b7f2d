"""Shared defaults for every rstarjax run (rStar2-Agent §4.3 / §5.1 unless noted).

Presets (stage1.py, stage2.py, stage3.py, ...) start from ``get_config()`` here and change a few
fields. Each section is parsed into its typed dataclass (``rstarjax/recipes/config.py`` says which),
whose field comments document it. Paths that must come from the user (model, data) default to ""
and are rejected at start with a message that names the flag to set.

`--config=configs/base.py:filter` selects a mode through the config argument.
"""
import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.mode = arg or "rl"  # rl | filter (sft / eval / demo are added by their own presets)
    c.seed = 0
    # "paper" (rStar2-Agent as published: every section's defaults) | "rstar2_official" (what the
    # official rStar2-Agent code does, for the released checkpoint: rstarjax/recipes/config.py
    # PROFILES lists the keys it sets; a key also given on the command line keeps that value)
    c.profile = "paper"
    c.total_steps = 300  # optimizer steps in this stage (global step count at its end)
    # jax's persistent compilation cache, shared by every run and stage of this user ("" = off):
    # a resumed run or the next stage loads the programs instead of compiling them again
    c.compilation_cache_dir = "~/.cache/rstarjax/xla"

    # ---- policy model ----------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.preset = "qwen3-14b"  # ModelConfig.preset; the HF config.json wins when present
    c.model.hf_path = ""  # directory with config.json + *.safetensors (required for rl/filter)
    c.model.random_init = False  # True: the preset with random weights (tests / demos only)
    c.model.tokenizer_path = ""  # a dir with the model's tokenizer.json; default: hf_path
    # > 0: the small-vocabulary Qwen BPE of that many regular tokens; 0: the tokenizer.json in
    # tokenizer_path / hf_path says (Qwen3's full vocabulary when there is none)
    c.model.tokenizer_num_regular_tokens = 0
    c.model.dtype = "bfloat16"  # compute dtype; master weights stay float32
    c.model.remat_policy = "full"
    # LoRA (docs/lora.md): > 0 trains rank-r float32 adapters only, the base frozen in bfloat16
    # (Qwen3-1.7B on a 16 GB Colab GPU, Qwen3-14B on one 80 GB GPU); 0 = full fine-tuning
    c.model.lora_rank = 0
    c.model.lora_alpha = 32.0  # adapters scaled by lora_alpha / lora_rank
    c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

    # ---- data --------------------------------------------------------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.train_path = ""  # jsonl / json / parquet of problems (required; layouts: rstarjax/io/data.py)
    c.data.shuffle = True
    c.data.num_epochs = 0  # 0 = repeat forever
    # "integer": train on integer answers only (rStar2-Agent §4.2, the default); "any": also every
    # other answer the verifier can compare (docs/data.md)
    c.data.answer_filter = "integer"

    # ---- rollouts / GRPO-RoC (§2.2.3, §4.3) -------------------------------------------------
    c.rl = ml_collections.ConfigDict()
    c.rl.prompts_per_step = 512
    c.rl.group_size = 16  # G: rollouts per prompt kept for the update
    c.rl.oversample = 32  # 2G rollouts sampled before RoC down-samples to G
    c.rl.max_turns = 10
    c.rl.max_prompt_len = 2048
    c.rl.max_response_len = 8192  # tokens of model + tool text per trajectory
    c.rl.max_tool_response_chars = 2048
    c.rl.chat_format = "rstar2"  # rstar2 (paper Fig. 3) | compact (a short system prompt, as the demo)
    c.rl.temperature = 1.0
    c.rl.top_p = 1.0
    c.rl.top_k = -1
    c.rl.tool_timeout_s = 5.0  # per code execution; in (0, 600], the code pool's limit per call
    c.rl.num_tool_workers = 0  # code-pool workers; 0 = one per host core (each runs 4 sandboxes)
    c.rl.rollout_timeout_s = 3600.0  # a whole step's rollouts (> 0); past it the step fails loudly
    c.rl.roc = True  # False: the paper's GRPO baseline: G rollouts per prompt, all trained (oversample unused)
    c.rl.roc_variant = "paper"  # "topk": the official code's deterministic selection, exactly
    c.rl.roc_min_negatives = 2  # topk's per-class floors (the official run script's values)
    c.rl.roc_min_positives = 2
    # RoC's penalties: "paper" (eq. 4-5 from the rollout's counts) | "official_text" (read from the
    # decoded response as the official code does; with roc_variant="topk" its kept set, exactly)
    c.rl.roc_penalty = "paper"
    # §4.3 / the official run script: drop groups whose rollouts all earned the same reward (no
    # gradient) before RoC, without refilling; False keeps them with zero advantage
    c.rl.reject_equal_reward = True
    c.rl.max_rejected_batches = 20  # consecutive batches with no group to train: stop (cleanly if all solved)
    # Options of peer frameworks for what is trained on, off by default (rstarjax/rl/step.py):
    c.rl.dynamic_sampling = False  # DAPO: drop zero-variance groups, refill from the data ...
    c.rl.dynamic_sampling_max_rounds = 3  # ... in at most this many rollout rounds per step, the first included
    c.rl.overlong_filter = False  # DAPO: truncated rollouts get no loss; the paper found it harmful (§4.3.1)
    c.rl.length_penalty_coef = 0.0  # Kimi k1.5 length reward added to the answer reward
    # Kimi k1.5 partial rollouts (docs/training.md): at most this many tokens per rollout per step;
    # unfinished ones continue in the next step under the new weights. 0 = off (the paper's loop)
    c.rl.partial_rollout_tokens = 0
    c.rl.partial_reprefill = False  # True: re-prefill paused rollouts under the new weights; False: keep their KV
    c.rl.max_staleness = 0  # > 0: roll out the next steps during the update, at most this many versions behind

    # ---- reward (rstarjax/recipes/config.py RewardConfig) ------------------------------------------
    c.reward = ml_collections.ConfigDict()
    c.reward.mode = "answer"  # answer (eq. 3: the model's boxed answer) | official (the official compute_score)

    # ---- rollout serving engine (docs/serving.md; rstarjax/rl/agent_loop.py ServingConfig) ----
    c.serving = ml_collections.ConfigDict()
    c.serving.page_size = 16  # tokens per KV page
    c.serving.kv_pages = 0  # > 0: exactly this many pages; 0: sized from kv_memory_fraction
    c.serving.kv_memory_fraction = 0.9  # of the device memory free after the serving weights
    c.serving.num_slots = 0  # decode batch width; 0: min(256, pages) on GPU/TPU, 64 on CPU
    c.serving.dtype = ""  # serving weights, KV and compute dtype; "" = model.dtype (bfloat16)
    # Growth headroom kept free per live rollout when admitting new ones, as a fraction of the
    # maximum rollout length L = max_prompt_len + max_response_len (§3.2): 1.0 is the paper's
    # estimate and never preempts; smaller admits more rollouts (lengths are heavy-tailed) and
    # preempts the youngest when the pool runs out (it resumes by re-prefill, tokens kept).
    c.serving.admit_reserve_fraction = 0.125
    # Start each rollout run with no reserve (admit what the pool holds now) and double it at
    # each preemption, from one page up to admit_reserve_fraction (docs/serving.md "Admission by free pages")
    c.serving.adaptive_reserve = True
    c.serving.decode_steps = 16  # decode steps per device call (one host sync each)
    c.serving.prefill_chunk = 2048  # longest feed per forward row; longer ones go in chunks
    # serving slices (docs/serving.md "Serving slices"): devices per slice (weights split
    # Megatron-style, KV by kv head); 0 = one engine over the trainer's arrays as they are
    c.serving.tensor_parallel = 0
    c.serving.slices_per_host = 1  # slices on each process's devices; 0 = as many as fit
    # free the serving copy and the KV pool before each train step, make them again at the
    # weight hand-off after it (docs/serving.md "Memory plan"): room for the update
    c.serving.release_during_update = False
    # "disaggregated": rollout slices on the last serving.rollout_devices devices, the trainer on the
    # others (docs/training.md "Placement"); "colocated": rollouts on the trainer's devices
    c.serving.placement = "colocated"
    c.serving.rollout_devices = 0
    # disaggregated across processes: processes 0 .. trainer_processes - 1 train, the others
    # roll out, each driven by one of them (docs/training.md "Placement")
    c.serving.trainer_processes = 1

    # ---- policy loss (eq. 6; rstarjax/rl/loss.py) ---------------------------------------------
    c.loss = ml_collections.ConfigDict()
    c.loss.eps_low = 0.2  # epsilon_low
    c.loss.eps_high = 0.28  # epsilon_high (Clip-Higher)
    c.loss.kl_coef = 0.0  # the paper removes the KL term; > 0: k3 KL to a frozen reference policy
    c.loss.entropy_coef = 0.0  # and the entropy bonus
    # Options of peer frameworks, off by default (rstarjax/rl/loss.py and advantages.py document each):
    c.loss.advantage_estimator = "grpo"  # grpo (eq. 7) | dr_grpo (no std; constant eq.-6 normaliser)
    c.loss.policy_loss = "ppo_clip"  # ppo_clip (eq. 6, token ratio) | gspo (sequence-level ratio)
    c.loss.gspo_eps_low = 3e-4
    c.loss.gspo_eps_high = 4e-4
    c.loss.dual_clip_c = ml_collections.config_dict.placeholder(float)  # e.g. 3.0
    c.loss.tis_cap = ml_collections.config_dict.placeholder(float)  # truncated importance sampling
    # decoupled PPO (AReaL): ratio vs the recomputed proximal policy, tokens weighted by
    # pi_proximal / pi_behaviour and dropped above this cap (e.g. 5.0; inf = uncapped)
    c.loss.decoupled_cap = ml_collections.config_dict.placeholder(float)
    # eq. 6's token mean over the whole batch ("batch") | per micro-batch, weighted by its rows
    # (the official verl actor: "micro_batch")
    c.loss.token_mean = "batch"
    # with token_mean="micro_batch": rows divided by the rows "kept" | "configured" (sampled, before
    # RoC: verl's); micro_batch_tokens > 0: the token means over verl's token-budget micro-batches
    # (ppo_max_token_len_per_gpu) of micro_batch_gpus GPUs, as per-token weights
    c.loss.micro_batch_rows = "kept"
    c.loss.micro_batch_tokens = 0
    c.loss.micro_batch_gpus = 1

    # ---- optimizer ----------------------------------------------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 20
    c.optim.weight_decay = 0.01
    c.optim.grad_clip_norm = 1.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8

    # ---- trainer -------------------------------------------------------------------------------
    c.trainer = ml_collections.ConfigDict()
    c.trainer.micro_batch_size = 64  # global rows per gradient-accumulation micro-step
    c.trainer.mini_batches = 1  # optimizer updates per rollout batch
    c.trainer.recompute_old_logprobs = True
    c.trainer.skip_padding = True  # no forward/backward for micro-steps of padding rows only
    c.trainer.compute_dtype = ml_collections.config_dict.placeholder(str)  # None: model decides
    # an update with a non-finite loss / gradient / update is skipped (params kept, counted as
    # train/skipped_nonfinite); this many such steps in a row stop the run with an error
    c.trainer.max_nonfinite_steps = 3

    # ---- device mesh (data, fsdp, tensor); -1 = the rest of the devices --------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1

    # ---- multi-process (jax.distributed) -------------------------------------------------------
    c.distributed = ml_collections.ConfigDict()
    c.distributed.num_processes = 1  # > 1: initialize with the fields below
    c.distributed.process_id = 0
    c.distributed.coordinator_address = ""  # host:port of process 0
    c.distributed.auto = False  # True: jax.distributed.initialize() finds the cluster itself
    c.distributed.timeout_s = 300
    c.distributed.silence_s = 120.0  # a rollout process whose heartbeat stops this long counts as dead

    # ---- checkpoints -----------------------------------------------------------------------------
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 10
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True
    # the previous stage's WORKDIR/checkpoints: an SFT run gives params only (step 0, fresh
    # optimizer); an RL stage params + optimizer + global step (docs/training.md "Stage hand-offs")
    c.checkpoint.init_from = ""
    c.checkpoint.reset_optimizer = False  # stage 3: fresh optimizer state, LR warmup again (§4.3)
    c.checkpoint.update_reference = False  # stage 3: KL reference := the init_from policy (§4.3; kl_coef > 0)
    # SIGTERM / SIGINT: the last finished step is saved and the run exits (status 128 + signal)
    # within this many seconds; a second signal exits at once (docs/training.md "When a run is
    # interrupted"). A preempted TPU VM gets about 30 s.
    c.checkpoint.preemption_grace_s = 25.0

    # ---- logging -----------------------------------------------------------------------------------
    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.progress_bar = True
    # Weights & Biases (pip install -e ".[wandb]"): the same scalars as TensorBoard, plus the config
    c.logging.wandb = False
    c.logging.wandb_project = "rstarjax"
    c.logging.wandb_entity = ""  # "" = the logged-in user's default entity
    c.logging.wandb_name = ""  # "" = the workdir's name
    c.logging.wandb_tags = ""  # comma-separated; the mode is always added

    # ---- stage-3 difficulty filter (§4.3) -----------------------------------------------------------
    c.filter = ml_collections.ConfigDict()
    c.filter.k = 8  # rollouts per problem with the latest policy
    c.filter.output_path = ""  # default: WORKDIR/filtered.jsonl
    c.filter.batch_prompts = 64

    # ---- code sandbox (docs/code_env.md) ----------------------------------------------------------
    c.env = ml_collections.ConfigDict()
    # True: run where the sandbox cannot hide the host's files (datasets, answers) from model code
    c.env.allow_unconfined = False
    return c
