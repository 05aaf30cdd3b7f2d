"""The prepared device check: the main job end to end, the parts' speed, and profiles.

    python benchmarks/gpu_check.py --commit $(git rev-parse --short HEAD)   # one H100/H200, ~6 min
    python benchmarks/gpu_check.py --shape tiny                             # anywhere (CPU), ~1 min

A session lent a GPU has minutes of device time, so everything it should learn runs from this
one command, each part in its own process with its own time limit (a part that fails or runs
out of time costs only itself):

* ``env``: device, driver, jax / flax / orbax versions; the code pool started once (whether its
  sandboxes are confined here: where not, the RL jobs get ``env.allow_unconfined``, ``allows_unconfined``).
* ``main``: ``python -m rstarjax.main --config=configs/stage1.py`` with only the model, the data
  and sizes overridden: a Qwen3-1.7B-shaped HF directory with random bf16 weights written on
  the spot, a synthetic problem file, 2 prompts x 2G = 32 rollouts with the real code pool, a
  4,096-token response budget, 2 RL steps, one checkpoint. Random weights earn reward 0
  everywhere, so ``rl.reject_equal_reward=False`` (else every group would be dropped). Reported
  per step from the run's own metrics: rollout (prefill, decode, tool wait), RoC/batch, old
  log-probs, update, hand-off, checkpoint seconds, decode and trained tokens/s, peak device
  memory, preemptions and re-prefilled tokens.
* ``h100`` (optional, issue 45: stage 1 as a user runs it on one 80 GB H100, with tool calls):
  a random bf16 Qwen3-1.7B, the demo's problems (``recipes/demo_tasks.py``: the Python tool
  answers them) and 2,400 of its tool traces (every one calls the tool; its code really run).
  The memory plan (``serving/sizing.py`` ``size_colocated``, from the device's own
  ``bytes_limit``) predicts the remat policy, the micro-batch, the KV pool's share and the peak,
  or refuses the shape naming the flags (the part then fails with that message); the job is
  given none of them and sizes them itself from the same plan
  (``recipes/build.sized_by_memory_plan``, its line recorded as ``run_plan``). Then
  ``configs/sft.py`` for 120 steps of 16 traces (lr 5e-4 after a 10 % warm-up, ~60-100 s of
  training: the random model learns the tool-call format), and ``configs/stage1.py`` from its checkpoint with only model,
  data and sizes overridden: 2 prompts x 2G = 32 rollouts (G = 8, as the H200 runs), 8,192-token
  responses, prompts up to 1,024 tokens, no fixed ``serving.kv_pages`` (the engine sizes the pool
  from what is free; the scheduler queues what it does not hold), 4 RL steps and a checkpoint.
  Reported per step: rollout (decode, prefill/extend, tool wait), old log-probs, update and its
  MFU, hand-off, checkpoint wait, compile seconds, decode and trained tokens/s, tool calls per
  rollout and the share of rollouts that called, peak device memory against the plan's; the
  programs each step compiled (``JAX_LOG_COMPILES``), and the prefill-phase ones step 2
  compiled, new shapes apart from shapes step 1 had compiled (the step-2 recompile, 058d7df).
  Predicted on an H100 (not yet run): inputs ~45 s (the random model's write 25 s, the traces
  10 s), SFT ~150 s (start 15 s, compile 30 s, 120 steps of ~9K tokens ~60 s at ~0.5 s each,
  the 20.6 GB checkpoint ~40 s),
  RL ~190 s (start and restore 25 s, step 1 ~80 s with its compiles, steps 2-4 ~15 s each when
  the SFT taught the format, the checkpoints at steps 2 and 4 ~40 s, mostly behind the steps);
  ~7 min in all, at most 90 + 220 + 250 s
  (its time limits). Its result is also written to ``h100_result.json`` as it stands when a
  phase fails or runs out of time. A model the SFT did not teach decodes every rollout to 8,192 tokens: the
  RL phase then runs into its limit and reports the steps it finished.
* ``ckpt`` (optional, issue 45): what one save of the 1.7B train state (20.6 GB) adds to a step:
  the shipped copy behind the next rollouts (``checkpoint.background_copy``, the rollouts emulated
  by ~10 s of HBM-bound work) and the copy in the loop, each through pinned host memory and
  pageable memory (``checkpoint.pinned_host_transfer``), each write waited for and deleted,
  beside a plain ``jax.device_get`` of the same arrays (~150-160 s on an H100, predicted); an arm
  starts only where its predicted seconds fit what the part's limit leaves, and a part killed in
  an arm keeps the setup's figures and the arms it finished.
* ``lora`` (optional, issue 45 item 5): ``configs/stage1.py`` on Qwen3-8B-shaped random weights
  (the preset's, no HF directory written) with LoRA rank 16, sized by the memory plan as
  ``h100`` is (``--h100-mem-fraction`` holds it to 80 GB too): 2 prompts x 2G = 32 rollouts of up
  to 2,048 tokens, 2 RL steps and a checkpoint; the plan's peak beside the measured one. Random
  weights call no tool, so this shows whether the 8B LoRA step fits one GPU and what it costs,
  nothing of tool use (~3 min predicted, at most 300 s).
* ``serving_<preset>``: decode tokens/s and fraction of the HBM roofline at 64 and 256 rollouts, Qwen3-1.7B
  and 8B shapes (``benchmarks/serving.py --device gpu``), with a trace of one decode call each.
* ``kernels2``, ``gemms``, ``decode`` (optional, issue 46): the decode kernels alone at 256 rows x 4K
  (jax's Triton kernel, then ours, ``models/decode_kernel.py``, in predicted order), our decode
  GEMMs alone (``models/decode_gemm.py``, each of ``GEMM_BLOCKINGS``) against XLA's ops of the
  same work at 64 and 256 rows (<= 100 s), and the engine's decode step at 256/64/32 rows with
  each attention path and sampler, alternating, median of 3, the fused-GEMM arm with the
  ``gemms`` part's best blocking (docs/serving.md "Our decode kernel": about 7 minutes on an
  H100 or H200).
* ``train_1x8k``, ``train_4x8k``: train-step MFU at 1 x 8K and 4 x 8K tokens, Qwen3-1.7B, bf16
  (``benchmarks/bench_trainer.py``), with a trace of one step each.

``--parts`` runs the parts in the order it lists them (``env`` always first). ``--budget-s S``
holds the whole command to S seconds (a lent device runs at most 10 minutes a command): list the
parts a loan should learn in their priority order, and each part's limit is cut to what is left; a part that would start with under 45 s left is
skipped and said so in the table.

``--shape tiny`` runs the same parts at the ``tiny`` model shape with small sizes, so a test
keeps this script working between lent sessions. Output (``--out``, default ``$OUT`` when set):
``gpu_check.json`` (every part's full result), ``gpu_check.log`` (every part's output),
``main_metrics.jsonl`` (the main job's metrics log) and ``traces.tar`` (the traces, continued in
``traces_2.tar``... past 15 MiB; for
``benchmarks/profile_summary.py``). One JSON line per part is printed as it ends, and a summary
table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# ``python benchmarks/gpu_check.py`` puts only benchmarks/ on sys.path: this process imports
# rstarjax too (agent_model_overrides, best_decode_choices), and a lent device has it installed
# nowhere (its wheels go to /tmp/site), so the repository root goes on the path here, after this
# script's folder and before site-packages (the parts' processes get it as PYTHONPATH, main())
if ROOT not in sys.path:
    sys.path.insert(1 if sys.path and os.path.abspath(sys.path[0] or os.curdir) == HERE else 0, ROOT)

from hardware import bf16_peak_flops, hbm_peak_gbps  # noqa: E402  (benchmarks/, this script's folder)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one check. ``gpu``: what the issue asks of one H100/H200; ``tiny``: the
    same parts small enough for a CPU test."""
    model: str  # ModelConfig preset of the main job's random HF model
    tokenizer_regular_tokens: int  # 0: Qwen3's full tokenizer
    prompts: int
    samples: int  # 2G rollouts per prompt
    group: int  # G kept after RoC
    response_len: int
    prompt_len: int
    micro_batch: int
    steps: int
    serving_presets: tuple[str, ...]  # one part each: a part's JSON line comes at its end
    serving_batches: str
    serving_quick: bool
    train_preset: str
    train_seq: int
    train_batches: tuple[int, ...]
    train_repeats: int
    timeouts: dict  # part -> seconds


SHAPES = {
    "gpu": Shape(model="qwen3-1.7b", tokenizer_regular_tokens=0, prompts=2, samples=16, group=8,
                 response_len=4096, prompt_len=512, micro_batch=8, steps=2,
                 serving_presets=("qwen3-1.7b", "qwen3-8b"), serving_batches="64,256",
                 serving_quick=False, train_preset="qwen3-1.7b", train_seq=8192,
                 train_batches=(1, 4), train_repeats=3,
                 timeouts={"env": 60, "main": 330, "serving_qwen3-1.7b": 70,
                           "serving_qwen3-8b": 80, "train_1x8k": 60, "train_4x8k": 70,
                           "blocking": 75, "remat": 75, "kernels": 150, "ckpt": 200}),
    "tiny": Shape(model="tiny", tokenizer_regular_tokens=4000, prompts=2, samples=4, group=2,
                  response_len=48, prompt_len=1024, micro_batch=0, steps=2,
                  serving_presets=("tiny",), serving_batches="4", serving_quick=True,
                  train_preset="tiny", train_seq=256, train_batches=(1,), train_repeats=1,
                  # main: 400 s ran out on 2 cores at load ~28 (2026-11-28); ~2 min idle
                  timeouts={"env": 60, "main": 900, "serving_tiny": 200, "train_1x256": 200,
                            "blocking": 200, "remat": 200, "kernels": 200, "ckpt": 200}),
}

PAGE_SIZE = 16  # configs/base.py serving.page_size
TINY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# ---- running a part ---------------------------------------------------------------------------
@dataclasses.dataclass
class PartResult:
    name: str
    ok: bool
    seconds: float
    result: dict
    error: str = ""
    skipped: bool = False  # not started: the command's --budget-s had too little left for it


@dataclasses.dataclass
class Budget:
    """The command's wall-clock budget (``--budget-s``): a lent device runs at most 10 minutes a
    command, so one command can list every part the loan should learn, in priority order, and
    each part's time limit is cut to what the budget has left (its own benchmark's
    ``--budget-s`` too, so it stops cleanly and keeps the rows it measured); a part that would
    start with less than ``MIN_PART_S`` left is skipped and said so in the table."""
    deadline: float | None = None  # time.perf_counter() at which the command must be done

    def clip(self, seconds: float) -> float:
        if self.deadline is None:
            return seconds
        return max(1.0, min(seconds, self.deadline - time.perf_counter()))

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()


BUDGET = Budget()
MIN_PART_S = 45.0  # a part given less than this measures nothing on a GPU (a jax start alone is ~15 s)


def run_part(name: str, argv: list[str], timeout_s: float, log, env: dict | None = None,
             cwd: str = ROOT) -> tuple[int | None, str]:
    """Run one part's command, its output appended to ``log``; (exit status or None when it
    ran past ``timeout_s`` and was killed with its whole process group, its output)."""
    timeout_s = BUDGET.clip(timeout_s)
    log.write(f"\n===== {name} (limit {timeout_s:.0f} s): {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the main job's code pool and verifier too
        try:  # the pool's zygote runs in its own session and may still hold the pipe
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = "(the part's output pipe stayed open after the kill: its log is lost)\n"
        code = None
    log.write(out or "")
    log.write(f"===== {name}: {ended(code, timeout_s)}\n")
    log.flush()
    return code, out or ""


def ended(code: int | None, limit_s: float) -> str:
    """How a part's process ended, for its error and the table: "exited N", or where
    ``run_part`` killed it (exit status None) that it ran out of its time limit."""
    return f"ran out of its {limit_s:.0f} s time limit (killed)" if code is None else f"exited {code}"


def json_lines(text: str) -> list[dict]:
    """The JSON objects a part printed a line each, in order; a line that only starts like one
    (a log line, output cut mid-line by a kill) is skipped, not the end of the rows."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return [r for r in rows if isinstance(r, dict)]


def last_json_line(text: str) -> dict:
    rows = json_lines(text)
    return rows[-1] if rows else {}


def tail(text: str, n: int = 600) -> str:
    return text[-n:].strip()


# ---- env -----------------------------------------------------------------------------------------
ENV_SCRIPT = r"""
import json, importlib.metadata as md, jax
out = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
       "device_kind": jax.devices()[0].device_kind, "python": __import__("sys").version.split()[0]}
for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy"):
    try:
        out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
        out[pkg] = None
stats = jax.devices()[0].memory_stats() or {}
out["bytes_limit_gb"] = stats.get("bytes_limit", 0) / 1e9
print(json.dumps(out))
"""


def nvidia_smi() -> dict:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        name, driver, memory = [x.strip() for x in q.stdout.strip().splitlines()[0].split(",")]
        return {"gpu": name, "driver": driver, "gpu_memory": memory}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


# The code pool as the RL jobs will start it, once: whether its sandboxes are confined here
# (isolation.confinement_gap) and a call runs
CODE_POOL_SCRIPT = r"""
import json
from rstarjax.env import CodeExecutor
from rstarjax.env.isolation import confinement_gap
with CodeExecutor(num_workers=1, lean_workers=0, slots_per_worker=1) as ex:
    iso = ex.isolation
    ran = ex.run("print(6 * 7)", timeout=30).text.strip() == "42"
print(json.dumps({"ran": ran, "gap": confinement_gap(iso),
                  **{k: iso.get(k) for k in ("root", "userns", "fresh_root", "pidns", "uid_drop", "seccomp",
                                             "own_tmp", "call_budget")}}))
"""


def part_env(shape: Shape, args, log, env) -> dict:
    limit = BUDGET.clip(shape.timeouts["env"])
    code, out = run_part("env", [sys.executable, "-c", ENV_SCRIPT], limit, log, env)
    result = last_json_line(out)
    result.update(nvidia_smi())
    result.update(commit=args.commit, date=datetime.date.today().isoformat(), shape=args.shape)
    if code != 0:
        raise RuntimeError(f"jax did not start ({ended(code, limit)}): {tail(out)}")
    code, out = run_part("env/code_pool", [sys.executable, "-c", CODE_POOL_SCRIPT], shape.timeouts["env"], log, env)
    result["code_pool"] = last_json_line(out) if code == 0 else {"ran": False, "error": tail(out)[-300:]}
    return result


def allows_unconfined(results: dict) -> bool:
    """Whether the RL jobs get ``env.allow_unconfined=True``: where the env part found the code
    pool running but unconfined here (its sandboxes could read this machine's files), rather than
    have the job refuse and the loan lose its parts; a lent machine holds only random weights and
    generated problems. The table's ``code pool`` row says which."""
    part = results.get("env")
    pool = (part.result or {}).get("code_pool", {}) if part is not None else {}
    return bool(pool.get("ran")) and pool.get("gap") is not None


# ---- main: the stage-1 job end to end ------------------------------------------------------------
MAKE_INPUTS = r"""
import json, sys
import jax.numpy as jnp
from flax import nnx
from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf
from rstarjax.models.chat_template import RSTAR2, encode_prompt
preset, regular, hf_dir, data_path, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
tok = load_tokenizer(regular or None)
overrides = {} if not regular else dict(vocab_size=tok.num_tokens, bos_token_id=tok.endoftext_id,
                                        eos_token_id=tok.eos_id, max_position_embeddings=8192)
cfg = ModelConfig.preset(preset, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, **overrides)
save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), hf_dir, tokenizer=tok, dtype=jnp.bfloat16)
rows = [{"problem": f"What is {100 + 7 * i} + {500 + 13 * i}?", "answer": str(600 + 20 * i)} for i in range(n)]
with open(data_path, "w") as f:  # 3 digits each: every prompt has the same length
    f.writelines(json.dumps(r) + "\n" for r in rows)
lengths = [len(encode_prompt(tok, r["problem"], RSTAR2)) for r in rows]  # as the rollouts encode them
print(json.dumps({"params_b": cfg.num_params / 1e9, "vocab": cfg.vocab_size,
                  "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                  "prompt_tokens_mean": sum(lengths) / len(lengths)}))
"""


def stage1_argv(workdir: str, overrides: dict, unconfined: bool = False) -> list[str]:
    """The README's main command on configs/stage1.py with ``overrides`` (dotted keys), the RL
    jobs' one form; ``unconfined`` adds env.allow_unconfined=True (``allows_unconfined``)."""
    o = {**overrides, **({"env.allow_unconfined": True} if unconfined else {})}
    return ([sys.executable, "-m", "rstarjax.main", f"--config={ROOT}/configs/stage1.py",
             f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in o.items()])


def main_job_argv(shape: Shape, hf_dir: str, data_path: str, workdir: str, unconfined: bool = False) -> list[str]:
    """The README's main command on configs/stage1.py; every override is the model, the data
    or a size, except reject_equal_reward (random weights: all rewards 0)."""
    rollouts = shape.prompts * shape.samples
    row = shape.prompt_len + shape.response_len
    kv_pages = rollouts * math.ceil(row / PAGE_SIZE) + 64  # every rollout at full length
    o = {
        "model.hf_path": hf_dir, "data.train_path": data_path,
        "total_steps": shape.steps, "rl.prompts_per_step": shape.prompts,
        "rl.oversample": shape.samples, "rl.group_size": shape.group,
        "rl.max_prompt_len": shape.prompt_len, "rl.max_response_len": shape.response_len,
        "rl.reject_equal_reward": False, "trainer.micro_batch_size": shape.micro_batch,
        "serving.kv_pages": kv_pages, "checkpoint.every_steps": shape.steps,
        "logging.progress_bar": False,
    }
    if shape.model == "tiny":  # CPU: float32 and no remat, as the tiny tests run it
        o.update({"model.dtype": "float32", "model.remat_policy": "none"})
    return stage1_argv(workdir, o, unconfined)


STEP_KEYS = {  # summary name -> metrics.jsonl key
    "rollout_s": "time/rollout", "prefill_s": "timing/rollout_prefill_s",
    "decode_s": "timing/rollout_decode_s", "tool_wait_s": "timing/tool_exec_wait_s",
    "verify_wait_s": "timing/verify_wait_s", "roc_batch_s": "time/prepare",
    "old_logprobs_s": "time/old_logprobs", "update_s": "time/update", "train_s": "time/train",
    "handoff_s": "time/handoff", "checkpoint_s": "time/checkpoint", "checkpoint_copy_s": "time/checkpoint_copy",
    "checkpoint_copy_wait_s": "time/checkpoint_copy_wait",
    "generated_tokens": "timing/rollout_generated_tokens",
    "decode_steps": "timing/rollout_decode_steps", "decode_kv_tokens": "timing/rollout_decode_kv_tokens",
    "prefill_tokens": "timing/rollout_prefill_tokens", "preemptions": "timing/rollout_preemptions",
    "trained_tokens": "train/trained_tokens", "peak_device_gb": "perf/device_peak_gb",
    "max_pages_in_use": "timing/rollout_max_pages_in_use", "max_live": "timing/rollout_max_live",
    "logprob_gap_max": "train/logprob_gap_max", "response_len_mean": "rollout_all/response_length_mean",
    "tool_calls_mean": "rollout_all/tool_calls_mean",
}


def step_summary(m: dict, prompt_tokens: int) -> dict:
    """One step's figures from its metrics line; ``prompt_tokens``: the tokens its prompts
    needed prefilled once (more means something was prefilled again: preemption or tool turns)."""
    s = {name: m.get(key) for name, key in STEP_KEYS.items()}
    if s["decode_s"] and s["generated_tokens"]:
        s["decode_tok_s"] = s["generated_tokens"] / s["decode_s"]
    if s["train_s"] and s["trained_tokens"]:
        s["trained_tok_s"] = s["trained_tokens"] / s["train_s"]
    if s["prefill_tokens"] is not None:
        s["reprefilled_tokens"] = max(0, int(s["prefill_tokens"]) - prompt_tokens)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if v is not None}


def part_main(shape: Shape, args, log, env, scratch: str, unconfined: bool = False) -> dict:
    hf_dir, data_path = os.path.join(scratch, "hf"), os.path.join(scratch, "problems.jsonl")
    workdir = os.path.join(scratch, "run")
    t0 = time.perf_counter()
    limit = BUDGET.clip(shape.timeouts["main"])
    code, out = run_part("main/inputs", [sys.executable, "-c", MAKE_INPUTS, shape.model,
                                         str(shape.tokenizer_regular_tokens), hf_dir, data_path,
                                         str(4 * shape.prompts * shape.steps)],
                         limit, log, env)
    if code != 0:
        raise RuntimeError(f"writing the random HF model failed ({ended(code, limit)}): {tail(out)}")
    result = {"model": shape.model, **last_json_line(out), "inputs_s": round(time.perf_counter() - t0, 1),
              "rollouts_per_step": shape.prompts * shape.samples, "response_len": shape.response_len}
    left = BUDGET.clip(shape.timeouts["main"] - (time.perf_counter() - t0))
    t1 = time.perf_counter()
    code, out = run_part("main", main_job_argv(shape, hf_dir, data_path, workdir, unconfined), left, log, env)
    result["job_s"] = round(time.perf_counter() - t1, 1)
    result["exit"] = code
    metrics_path = os.path.join(workdir, "logs", "metrics.jsonl")
    lines = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
        if args.out:
            with open(os.path.join(args.out, "main_metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)
    prompt_tokens = prompt_token_count(shape, result.pop("prompt_tokens_mean", None))
    result["steps"] = [step_summary(m, prompt_tokens.get(i, 0)) for i, m in enumerate(lines)]
    ckpts = os.path.join(workdir, "checkpoints")
    result["checkpoints"] = sorted(d for d in os.listdir(ckpts) if d.isdigit()) if os.path.isdir(ckpts) else []
    if code != 0:  # the steps it finished are kept
        raise PartFailed(f"the main job {ended(code, left)}: {tail(out)} (after {len(lines)} steps)", result)
    return result


def prompt_token_count(shape: Shape, prompt_tokens_mean: float | None) -> dict[int, int]:
    """Step i -> prompt tokens its rollouts prefill once (each group's prompt once, shared by
    its samples; the inputs process counted them as the rollouts encode them). The problems all
    have the same token length, so the data order (shuffled) does not matter; more prefilled
    tokens than this were prefilled again."""
    if prompt_tokens_mean is None:
        return {}
    return {i: int(round(prompt_tokens_mean * shape.prompts)) for i in range(shape.steps)}


# ---- h100: stage 1 as a user runs it on one 80 GB GPU, with tool calls --------------------------
@dataclasses.dataclass(frozen=True)
class RLShape:
    """The RL steps' sizes the ``h100`` and ``lora`` parts share: ``prompts`` x ``samples``
    rollouts a step (Resample-on-Correct keeps ``group`` of each prompt's), their token caps."""
    prompts: int
    samples: int
    group: int
    prompt_len: int
    response_len: int
    steps: int


@dataclasses.dataclass(frozen=True)
class AgentShape(RLShape):
    """The ``h100`` part's sizes: a short SFT on the demo's tool traces (the random model learns
    the tool-call format), then stage 1 from it at 2 prompts x 2G = 32 rollouts (G = 8: the H200
    runs' count, so the tables compare), the micro-batch, remat policy and KV pool from the memory
    plan."""
    model: str
    tokenizer_regular_tokens: int
    sft_traces: int
    sft_steps: int
    sft_batch: int
    sft_seq: int
    sft_lr: float
    plan_device_gb: float  # the plan's device where jax reports none (CPU); else the device's own
    timeouts: dict


AGENT_SHAPES = {
    "gpu": AgentShape(model="qwen3-1.7b", tokenizer_regular_tokens=0, sft_traces=2400, sft_steps=120,
                      sft_batch=16, sft_seq=2048, sft_lr=5e-4, prompts=2, samples=16, group=8,
                      prompt_len=1024, response_len=8192, steps=4, plan_device_gb=80.0,
                      timeouts={"inputs": 90, "sft": 220, "rl": 250}),
    # the plumbing only (a test runs it); the SFT that gets a tiny model to call the tool is
    # longer: docs/launch.md "One GPU" (--sft-steps, --sft-lr, --sft-batch)
    "tiny": AgentShape(model="tiny", tokenizer_regular_tokens=4000, sft_traces=32, sft_steps=3,
                       sft_batch=4, sft_seq=1024, sft_lr=3e-3, prompts=2, samples=4, group=2,
                       prompt_len=1024, response_len=160, steps=2, plan_device_gb=80.0,
                       timeouts={"inputs": 120, "sft": 1500, "rl": 600}),
}

# The memory plan for the job's shape on this device (or ``plan_device_gb`` where it reports no
# memory), printed as the inputs script's first JSON line; exit 3 when the plan finds no fit.
# ``a["given"]``: the sizes ``--h100-rl-flags`` gives the run (``SIZING_FLAGS``), kept by the plan
# as the run's own plan keeps them (recipes/build.sized_by_memory_plan), so a value that cannot fit
# is refused here, before the model is written and the SFT runs, naming the flag and the largest
# value that fits (the other sizes as given or planned), beside the plan's own choice left open.
# Spliced into both inputs scripts below ("{PLAN}"), which define ``a`` and ``cfg`` first.
PRINT_PLAN = r"""
device = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
device_bytes = device or int(a["plan_device_gb"] * 1e9)
given = a.get("given") or {}
def plan_with(sizes):
    return size_colocated(cfg, rows=a["rows"], seq_len=a["seq_len"], lora_rank=a.get("lora_rank", 0),
                          device_bytes=device_bytes, micro_batch=sizes.get("trainer.micro_batch_size"),
                          kv_memory_fraction=sizes.get("serving.kv_memory_fraction"),
                          kv_pages=sizes.get("serving.kv_pages", 0), remat_policy=sizes.get("model.remat_policy"),
                          remat_policies=() if "model.remat_policy" in sizes else REMAT_BY_SPEED,
                          rollouts=a["rollouts"])
choice = plan_with(given)
problems = [as_flags(p) for p in choice.problems]
if problems and given:
    fixes = []
    if "serving.kv_memory_fraction" in given and not given.get("serving.kv_pages"):
        def fits(f):
            return f > 0 and not plan_with({**given, "serving.kv_memory_fraction": f}).problems
        lo, hi = 0.0, float(given["serving.kv_memory_fraction"])
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        best = int(lo * 1000) / 1000  # rounded down: it fits
        fixes.append(f"the largest serving.kv_memory_fraction that fits is {best:.3f}" if fits(best) else
                     "no serving.kv_memory_fraction fits with the other sizes given")
    if "trainer.micro_batch_size" in given:
        fit = next((m for m in range(int(given["trainer.micro_batch_size"] or a["rows"]) - 1, 0, -1)
                    if a["rows"] % m == 0 and not plan_with({**given, "trainer.micro_batch_size": m}).problems), None)
        fixes.append(f"the largest trainer.micro_batch_size that fits is {fit}" if fit else
                     "no trainer.micro_batch_size fits with the other sizes given")
    own = plan_with({})
    if not own.problems:
        fixes.append(f"the plan's own, left open: serving.kv_memory_fraction={own.kv_memory_fraction:.4f}, "
                     f"trainer.micro_batch_size={own.micro_batch}, model.remat_policy={own.remat_policy}")
    # in SECTION.KEY=VALUE terms, as --h100-rl-flags takes them
    problems = ["--h100-rl-flags " + ",".join(f"{k}={v}" for k, v in given.items()) + ": "
                + "; ".join(list(choice.problems) + fixes)]
print(json.dumps({"plan": {"remat_policy": choice.remat_policy, "micro_batch": choice.micro_batch,
                           "kv_pages": choice.kv_pages, "kv_memory_fraction": choice.kv_memory_fraction,
                           "device_gb": round(device_bytes / 1e9, 2), "given": given,
                           "device_reported": bool(device), **choice.plan.as_dict()},
                  "problems": problems}), flush=True)
if problems:
    sys.exit(3)
"""

MAKE_AGENT_INPUTS = r"""
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf
from rstarjax.models.chat_template import RSTAR2, encode_prompt
from rstarjax.recipes import demo_tasks
from rstarjax.recipes.config import as_flags
from rstarjax.models.kv_cache import kv_bytes_per_token
from rstarjax.serving.sizing import REMAT_BY_SPEED, decode_weight_bytes_read, size_colocated
a = json.loads(sys.argv[1])
tok = load_tokenizer(a["regular"] or None)
overrides = {} if not a["regular"] else dict(vocab_size=tok.num_tokens, bos_token_id=tok.endoftext_id,
                                             eos_token_id=tok.eos_id, max_position_embeddings=8192)
cfg = ModelConfig.preset(a["model"], param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, **{**overrides, **a["model_overrides"]})
{PLAN}
save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), a["hf"], tokenizer=tok, dtype=jnp.bfloat16)
rows = demo_tasks.make_dataset(a["problems"], "train", seed=0)
with open(a["data"], "w") as f:  # the demo's problems: the Python tool answers them
    f.writelines(json.dumps(r) + "\n" for r in rows)
traces = demo_tasks.make_sft_traces(demo_tasks.generate_tasks(a["traces"], "train", seed=1))
with open(a["sft"], "w") as f:  # every trace calls the tool once, its output really run
    f.writelines(json.dumps({"messages": t}) + "\n" for t in traces)
attention = cfg.train_flops_per_token(1) - cfg.train_flops_per_token(0)  # per token of context
weights = decode_weight_bytes_read(cfg, 0)  # a decode step's weight reads (the gathered rows aside)
print(json.dumps({"params_b": cfg.num_params / 1e9, "vocab": cfg.vocab_size, "sft_traces": len(traces),
                  "decode_weight_bytes": weights, "kv_bytes_per_token": kv_bytes_per_token(cfg, jnp.bfloat16),
                  "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                  "flops_matmul": cfg.train_flops_per_token(0) - attention, "flops_attention": attention,
                  "prompt_tokens": round(sum(len(encode_prompt(tok, r["problem"], RSTAR2)) for r in rows) / len(rows))}))
""".replace("{PLAN}", PRINT_PLAN)


def tiny_overrides(model: str) -> dict:
    """CPU: float32 and no remat, as the tiny tests run it."""
    return {"model.dtype": "float32", "model.remat_policy": "none"} if model == "tiny" else {}


def agent_sft_argv(a: AgentShape, hf_dir: str, sft_path: str, workdir: str) -> list[str]:
    """configs/sft.py on the generated tool traces: ``sft_steps`` steps (the schedule spans them).
    Its updates that are not finite are skipped but never stop it (``sft.max_nonfinite_steps``
    at the step count): a diverged SFT still hands the RL job its last finite parameters, whose
    timings are what the part is for, and the table counts the skipped steps."""
    o = {"model.hf_path": hf_dir, "sft.data_path": sft_path, "sft.epochs": 1, "sft.max_nonfinite_steps": a.sft_steps,
         "sft.max_steps": a.sft_steps, "sft.batch_size": a.sft_batch, "sft.seq_len": a.sft_seq,
         "sft.learning_rate": a.sft_lr, "sft.warmup_ratio": 0.1, "sft.micro_batch_size": 0,
         "sft.export_hf": False, "checkpoint.every_steps": a.sft_steps, "logging.progress_bar": False,
         **tiny_overrides(a.model)}
    return ([sys.executable, "-m", "rstarjax.main", f"--config={ROOT}/configs/sft.py",
             f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in o.items()])


def agent_rl_argv(a: AgentShape, plan: dict, hf_dir: str, data_path: str, init_from: str,
                  workdir: str, unconfined: bool = False, extra: dict | None = None) -> list[str]:
    """configs/stage1.py from the SFT checkpoint, only model, data and sizes overridden (its 8K
    responses kept), as a user runs it: on a device that reports its memory ``rstarjax.main``
    picks the remat policy, the micro-batch and the KV pool's share itself
    (recipes/build.sized_by_memory_plan; no fixed serving.kv_pages: the engine sizes the pool
    from what is free). On CPU (no memory statistics) the plan's remat policy and micro-batch are
    given, as there. A checkpoint half-way and one at the last
    step, the last kept (``checkpoint.keep=1``): the step after the first shows its copy behind
    the rollouts and what its update waited for it (20.6 GB each at 1.7B: the SFT's is removed
    once the job has started, ``removed_once_logged``, so that they fit the 64 GB disk). Rewards
    of random-ish weights are mostly equal, so rl.reject_equal_reward=False as in ``main``.
    ``extra``: settings given on top (``--h100-rl-flags``), e.g. a smaller pool share after a
    refusal by the start check."""
    o = {"model.hf_path": hf_dir, "data.train_path": data_path, "checkpoint.init_from": init_from,
         "total_steps": a.steps, "rl.prompts_per_step": a.prompts, "rl.oversample": a.samples,
         "rl.group_size": a.group, "rl.max_prompt_len": a.prompt_len,
         "rl.max_response_len": a.response_len, "rl.reject_equal_reward": False,
         "checkpoint.every_steps": max(1, a.steps // 2), "checkpoint.keep": 1, "logging.progress_bar": False}
    if not plan.get("device_reported"):
        o.update({"model.remat_policy": plan["remat_policy"], "trainer.micro_batch_size": plan["micro_batch"]})
    o.update(tiny_overrides(a.model))
    o.update(extra or {})
    return stage1_argv(workdir, o, unconfined)


AGENT_KEYS = {"tool_call_rate": "rollout_all/tool_call_rate", "compile_s": "time/compile",
              "tool_calls_per_rollout": "rollout_all/tool_calls_mean",
              "truncation_ratio": "rollout_all/truncation_ratio", "accuracy": "rollout_all/accuracy",
              "tool_wait_s": "timing/rollout_tool_wait_s", "device_in_use_gb": "perf/device_in_use_gb"}

def decode_roofline(step: dict, inputs: dict, device_kind: str) -> dict:
    """The rollout's decode against the HBM roofline (issue 46's main-job target): the seconds
    its decode steps would take reading only what they must (one weight read a step, each step's
    live KV: ``timing/rollout_decode_kv_tokens``) at the device's peak bandwidth; the rollout
    phase over that (target <= 1.5) and that over the decode calls' seconds (their roofline
    fraction)."""
    peak = hbm_peak_gbps(device_kind)
    need = ("decode_steps", "decode_kv_tokens", "rollout_s", "decode_s")
    if not (peak and all(step.get(k) for k in need) and inputs.get("decode_weight_bytes")):
        return {}
    moved = step["decode_steps"] * inputs["decode_weight_bytes"] + \
        step["decode_kv_tokens"] * inputs["kv_bytes_per_token"]
    roofline_s = moved / (peak * 1e9)
    return {"decode_roofline_s": round(roofline_s, 3),
            "rollout_vs_roofline": round(step["rollout_s"] / roofline_s, 3),
            "decode_roofline_fraction": round(roofline_s / step["decode_s"], 4)}


def update_mfu(step: dict, inputs: dict, device_kind: str) -> float | None:
    """The update's MFU: trained tokens x model FLOPs per token / update seconds / peak, the
    attention term at the step's mean trajectory length (prompt + mean response; rows are packed,
    attention stays within a trajectory): ModelConfig.train_flops_per_token."""
    peak = bf16_peak_flops(device_kind)
    if not (peak and step.get("update_s") and step.get("trained_tokens") and inputs.get("flops_matmul")):
        return None
    length = inputs.get("prompt_tokens", 0) + step.get("response_len_mean", 0)
    flops = inputs["flops_matmul"] + inputs["flops_attention"] * (length + 1)
    return step["trained_tokens"] * flops / step["update_s"] / peak


COMPILING = re.compile(r"Compiling (?:jit\()?([^ ()]+)\)? with global shapes and types (.*?)\. Argument")
SHAPED = re.compile(r"ShapedArray\(([^)]*)\)")


def compiled_programs(log_text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, argument shapes) of each program jax compiled, in order (``JAX_LOG_COMPILES``:
    "Compiling jit(NAME) with global shapes and types (...)" lines)."""
    return [(m.group(1), tuple(SHAPED.findall(m.group(2))))
            for m in map(COMPILING.search, log_text.splitlines()) if m]


def agent_model_overrides(args) -> dict:
    """``--agent-model KEY=VALUE,...``: ModelConfig fields of the ``h100`` part's random model
    changed from its preset's (e.g. the 1.7B's depth and initialisation scale on the ``tiny``
    shape: docs/launch.md "Teaching a random model the tool-call format")."""
    from rstarjax.models import ModelConfig

    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    overrides = {}
    for item in filter(None, (getattr(args, "agent_model", "") or "").split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise SystemExit(f"--agent-model {item!r}: give KEY=VALUE with KEY a ModelConfig field")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return overrides


def rl_flag_overrides(args) -> dict:
    """``--h100-rl-flags KEY=VALUE,...``: dotted config keys given to the ``h100`` part's stage-1
    run as ``--config.KEY=VALUE`` (e.g. ``serving.kv_memory_fraction=0.2``); the run's own parser
    checks them, and the part's memory plan the sizes among them first (``planned_flags``)."""
    overrides = {}
    for item in filter(None, (getattr(args, "h100_rl_flags", "") or "").split(",")):
        key, _, value = item.partition("=")
        if "." not in key or not value:
            raise SystemExit(f"--h100-rl-flags {item!r}: give SECTION.KEY=VALUE")
        overrides[key] = value
    return overrides


# the --h100-rl-flags keys the memory plan reads (recipes/build.PLANNED_KEYS and an explicit pool),
# with their types: the part's plan step keeps them as the run's plan does
SIZING_FLAGS = {"serving.kv_memory_fraction": float, "trainer.micro_batch_size": int,
                "serving.kv_pages": int, "model.remat_policy": str}


def planned_flags(args) -> dict:
    """The sizes among ``--h100-rl-flags`` (``SIZING_FLAGS``), typed, for the part's memory plan
    (``PRINT_PLAN``'s ``given``); SystemExit naming the flag when one does not parse."""
    given = {}
    for key, value in rl_flag_overrides(args).items():
        if key in SIZING_FLAGS:
            try:
                given[key] = SIZING_FLAGS[key](value)
            except ValueError:
                raise SystemExit(f"--h100-rl-flags {key}={value}: not a {SIZING_FLAGS[key].__name__}") from None
    fraction = given.get("serving.kv_memory_fraction")
    if fraction is not None and not 0 < fraction <= 1:
        raise SystemExit(f"--h100-rl-flags serving.kv_memory_fraction={fraction}: give a share in (0, 1]")
    return given


def part_agent(shape: Shape, args, log, env, scratch: str, unconfined: bool = False) -> dict:
    """``h100``: SFT on tool traces, then stage 1's RL steps from it, sized by the memory plan.
    Whatever it measured before a phase failed or ran out of time is kept: in the part's result
    (``PartFailed``) and in ``h100_result.json``."""
    a = AGENT_SHAPES[args.shape]
    a = dataclasses.replace(a, **{k: v for k, v in (("sft_steps", args.sft_steps), ("sft_lr", args.sft_lr),
                                                    ("sft_batch", args.sft_batch),
                                                    ("sft_traces", args.sft_traces)) if v})
    if args.h100_mem_fraction:  # an H200 held to an H100's memory: the part's processes only
        env = dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.h100_mem_fraction))
    d = os.path.join(scratch, "agent")
    paths = {k: os.path.join(d, v) for k, v in (("hf", "hf"), ("data", "problems.jsonl"),
                                                ("sft", "sft.jsonl"))}
    os.makedirs(d, exist_ok=True)
    result: dict = {"model": a.model}

    def failed(message: str) -> PartFailed:
        """The part's error with what it measured so far, also written to h100_result.json."""
        if args.out:
            with open(os.path.join(args.out, "h100_result.json"), "w") as f:
                json.dump(result, f, indent=1)
        return PartFailed(message, result)

    t0 = time.perf_counter()
    spec = dict(model=a.model, regular=a.tokenizer_regular_tokens, rows=a.prompts * a.group,
                rollouts=a.prompts * a.samples,
                seq_len=a.prompt_len + a.response_len, plan_device_gb=a.plan_device_gb,
                problems=8 * a.prompts * a.steps, traces=a.sft_traces, model_overrides=agent_model_overrides(args),
                given=planned_flags(args), **paths)
    limit = BUDGET.clip(a.timeouts["inputs"])
    code, out = run_part("h100/inputs", [sys.executable, "-c", MAKE_AGENT_INPUTS, json.dumps(spec)],
                         limit, log, env)
    lines = json_lines(out)
    plan = lines[0]["plan"] if lines and "plan" in lines[0] else {}
    result.update({"plan": plan, "inputs_s": round(time.perf_counter() - t0, 1),
                   "rollouts_per_step": a.prompts * a.samples, "response_len": a.response_len})
    if code == 3:  # the memory plan refuses the shape (or a size --h100-rl-flags gives), naming the flags
        raise failed("the memory plan refuses the shape: " + " ".join(lines[0]["problems"]))
    if code != 0:
        raise failed(f"writing the inputs {ended(code, limit)}: {tail(out)}")
    result.update({k: v for k, v in lines[-1].items() if k not in ("plan", "problems")})
    sft_dir, rl_dir = os.path.join(d, "sft"), os.path.join(d, "rl")
    t1 = time.perf_counter()
    limit = BUDGET.clip(a.timeouts["sft"])
    code, out = run_part("h100/sft", agent_sft_argv(a, paths["hf"], paths["sft"], sft_dir), limit, log, env)
    result["sft_s"] = round(time.perf_counter() - t1, 1)
    sft_metrics = read_metrics(os.path.join(sft_dir, "logs", "metrics.jsonl"))
    if sft_metrics:
        result["sft"] = {"steps": len(sft_metrics), "first_loss": sft_metrics[0].get("sft/loss"),
                         "last_loss": sft_metrics[-1].get("sft/loss"),
                         "skipped_nonfinite": sum(m.get("sft/skipped_nonfinite", 0) > 0 for m in sft_metrics)}
    if code != 0:
        raise failed(f"the SFT {ended(code, limit)}: {tail(out)} (after {len(sft_metrics)} steps)")
    t2 = time.perf_counter()
    rl_env = dict(env, JAX_LOG_COMPILES="1")  # which programs each step compiles (item: step 2 none)
    sft_checkpoints = os.path.join(sft_dir, "checkpoints")
    limit = BUDGET.clip(a.timeouts["rl"])
    with removed_once_logged(sft_checkpoints, os.path.join(rl_dir, "logs", "metrics.jsonl")):
        code, out = run_part("h100", agent_rl_argv(a, plan, paths["hf"], paths["data"], sft_checkpoints, rl_dir,
                                                   unconfined, rl_flag_overrides(args)),
                             limit, log, rl_env)
    result["job_s"] = round(time.perf_counter() - t2, 1)
    result["exit"] = code
    # what rstarjax.main sized itself (one device that reports its memory: recipes/build.py), beside
    # the plan this part predicted with the same arithmetic
    result["run_plan"] = next((x.split("rstarjax: ", 1)[1] for x in out.splitlines()
                               if x.startswith("rstarjax: memory plan")), "")
    metrics = read_metrics(os.path.join(rl_dir, "logs", "metrics.jsonl"))
    if args.out and metrics:
        with open(os.path.join(args.out, "h100_metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in metrics)
    result["steps"] = run_steps(metrics, result, plan, a.prompts, getattr(args, "device_kind", ""))
    by_step = programs_by_step(out, [m["wall_time"] for m in metrics if "wall_time" in m])
    result["compiled_programs"] = {k: [name for name, _ in v] for k, v in by_step.items()}
    # The step-2 compile fix (058d7df): the rollouts' prefill-phase programs compiled on step 2, with
    # their last argument shapes (a tool turn's extend may need a new token bucket: a new shape),
    # and those compiled again at shapes step 1 had compiled already (the bug: must be none). None
    # where the job did not finish step 2 (nothing compiled there says nothing then)
    if len(metrics) >= 2:
        step2 = [(n, a) for n, a in by_step.get("2", []) if n in PREFILL_PROGRAMS]
        result["step2_prefill_compiles"] = [f"{n} {' '.join(a[-4:])}" for n, a in step2]
        result["step2_prefill_recompiles"] = [f"{n} {' '.join(a[-4:])}" for n, a in step2
                                              if (n, a) in by_step.get("1", [])]
    else:
        result["step2_prefill_compiles"] = result["step2_prefill_recompiles"] = None
    ckpts = os.path.join(rl_dir, "checkpoints")
    result["checkpoints"] = sorted(x for x in os.listdir(ckpts) if x.isdigit()) if os.path.isdir(ckpts) else []
    if code != 0:
        raise failed(f"the stage-1 job {ended(code, limit)}: {tail(out)} (after {len(metrics)} steps)")
    if args.out:
        with open(os.path.join(args.out, "h100_result.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


class removed_once_logged:
    """While the stage-1 job runs: remove ``directory`` (the SFT's checkpoint, 20.6 GB at 1.7B,
    read only at the job's start) once the job's metrics log holds its first step, so that its
    two checkpoints fit the lent machine's 64 GB disk beside the HF weights. Polls twice a
    second; stops with the job."""

    def __init__(self, directory: str, metrics_log: str):
        self.directory, self.metrics_log = directory, metrics_log
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            if os.path.exists(self.metrics_log) and os.path.getsize(self.metrics_log) > 0:
                shutil.rmtree(self.directory, ignore_errors=True)
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(5)


def run_steps(metrics: list[dict], inputs: dict, plan: dict, prompts: int, device_kind: str,
              mfu: bool = True) -> list[dict]:
    """One summary a step of a stage-1 job sized by the memory plan: ``step_summary``, the
    ``AGENT_KEYS`` figures, the update's MFU (``mfu``: full fine-tuning's FLOPs), the decode
    against its roofline, the measured peak beside the plan's."""
    steps = []
    for m in metrics:
        s = step_summary(m, inputs.get("prompt_tokens", 0) * prompts)
        s.update({k: round(m[v], 4) for k, v in AGENT_KEYS.items() if isinstance(m.get(v), (int, float))})
        update = update_mfu(s, inputs, device_kind) if mfu else None
        if update is not None:
            s["update_mfu"] = round(update, 4)
        s.update(decode_roofline(s, inputs, device_kind))
        if "peak_device_gb" in s and plan.get("peak_gb"):
            s["peak_vs_plan"] = f"{s['peak_device_gb']:.1f} / {plan['peak_gb']:.1f} GB"
        steps.append(s)
    return steps


# ---- lora: stage 1 of the 8B shape with LoRA on one GPU (issue 45, item 5) --------------------------
@dataclasses.dataclass(frozen=True)
class LoraShape(RLShape):
    """The ``lora`` part's sizes: configs/stage1.py on the preset's random weights (no HF
    directory to write first: 16 GB at 8B) with LoRA adapters, sized by the memory plan as a
    user's one-GPU run is. Random weights never call the tool and decode every rollout to its
    cap, so the responses are short: the part measures whether the 8B LoRA step fits beside the
    serving copy and the pool, and the plan's peak against the measured one, not tool use."""
    preset: str
    tokenizer_regular_tokens: int  # 0: Qwen3's full tokenizer
    lora_rank: int
    plan_device_gb: float  # the plan's device where jax reports none (CPU)
    timeout_s: int


LORA_SHAPES = {
    # predicted on an H100 (not yet run): start and random init ~40 s, step 1 ~100 s with its
    # compiles (32 rollouts x 2,048 tokens at ~8 ms a decode step: ~20 s), step 2 ~35 s
    "gpu": LoraShape(preset="qwen3-8b", tokenizer_regular_tokens=0, lora_rank=16, prompts=2, samples=16,
                     group=8, prompt_len=1024, response_len=2048, steps=2, plan_device_gb=80.0, timeout_s=300),
    # the tiny preset's 512-token table holds a 400-token BPE: the prompts are ~1,250 tokens of it
    "tiny": LoraShape(preset="tiny", tokenizer_regular_tokens=400, lora_rank=4, prompts=2, samples=4,
                      group=2, prompt_len=1536, response_len=32, steps=2, plan_device_gb=80.0, timeout_s=600),
}

MAKE_LORA_INPUTS = r"""
import json, sys
import jax, jax.numpy as jnp
from rstarjax.models import ModelConfig, load_tokenizer
from rstarjax.models.chat_template import RSTAR2, encode_prompt
from rstarjax.models.kv_cache import kv_bytes_per_token
from rstarjax.recipes import demo_tasks
from rstarjax.recipes.config import as_flags
from rstarjax.serving.sizing import REMAT_BY_SPEED, decode_weight_bytes_read, size_colocated
a = json.loads(sys.argv[1])
tok = load_tokenizer(a["regular"] or None)
cfg = ModelConfig.preset(a["preset"], dtype=jnp.bfloat16)
{PLAN}
rows = demo_tasks.make_dataset(a["problems"], "train", seed=0)
with open(a["data"], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
print(json.dumps({"params_b": cfg.num_params / 1e9, "vocab": cfg.vocab_size,
                  "decode_weight_bytes": decode_weight_bytes_read(cfg, 0),
                  "kv_bytes_per_token": kv_bytes_per_token(cfg, jnp.bfloat16),
                  "prompt_tokens": round(sum(len(encode_prompt(tok, r["problem"], RSTAR2)) for r in rows) / len(rows))}))
""".replace("{PLAN}", PRINT_PLAN)


def lora_rl_argv(l: LoraShape, plan: dict, data_path: str, workdir: str, unconfined: bool = False) -> list[str]:
    """configs/stage1.py on the preset's random weights with LoRA, only model, data and sizes
    overridden: on a device that reports its memory the job picks its remat policy, micro-batch
    and pool itself (as ``agent_rl_argv``). One checkpoint, at the end (the
    adapters and their optimizer state: ~0.2 GB at rank 16)."""
    o = {"model.preset": l.preset, "model.random_init": True, "model.lora_rank": l.lora_rank,
         "data.train_path": data_path, "total_steps": l.steps, "rl.prompts_per_step": l.prompts,
         "rl.oversample": l.samples, "rl.group_size": l.group, "rl.max_prompt_len": l.prompt_len,
         "rl.max_response_len": l.response_len, "rl.reject_equal_reward": False,
         "checkpoint.every_steps": l.steps, "logging.progress_bar": False}
    if l.tokenizer_regular_tokens:
        o["model.tokenizer_num_regular_tokens"] = l.tokenizer_regular_tokens
    if not plan.get("device_reported"):
        o.update({"model.remat_policy": plan["remat_policy"], "trainer.micro_batch_size": plan["micro_batch"]})
    o.update(tiny_overrides(l.preset))
    return stage1_argv(workdir, o, unconfined)


def part_lora(shape: Shape, args, log, env, scratch: str, unconfined: bool = False) -> dict:
    """``lora``: stage 1 of the 8B shape with LoRA on one GPU, sized by the memory plan, held to
    an H100's memory with ``--h100-mem-fraction`` like the ``h100`` part."""
    l = LORA_SHAPES[args.shape]
    if args.h100_mem_fraction:
        env = dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.h100_mem_fraction))
    d = os.path.join(scratch, "lora")
    os.makedirs(d, exist_ok=True)
    data_path, workdir = os.path.join(d, "problems.jsonl"), os.path.join(d, "rl")
    t0 = time.perf_counter()
    spec = dict(preset=l.preset, regular=l.tokenizer_regular_tokens, rows=l.prompts * l.group,
                rollouts=l.prompts * l.samples,
                seq_len=l.prompt_len + l.response_len, lora_rank=l.lora_rank,
                plan_device_gb=l.plan_device_gb, problems=8 * l.prompts * l.steps, data=data_path)
    limit = BUDGET.clip(min(120, l.timeout_s))
    code, out = run_part("lora/inputs", [sys.executable, "-c", MAKE_LORA_INPUTS, json.dumps(spec)],
                         limit, log, env)
    lines = json_lines(out)
    plan = lines[0]["plan"] if lines and "plan" in lines[0] else {}
    result = {"model": l.preset, "lora_rank": l.lora_rank, "plan": plan, "inputs_s": round(time.perf_counter() - t0, 1),
              "rollouts_per_step": l.prompts * l.samples, "response_len": l.response_len}
    if code == 3:
        raise PartFailed("the memory plan refuses the shape: " + " ".join(lines[0]["problems"]), result)
    if code != 0:
        raise PartFailed(f"writing the inputs {ended(code, limit)}: {tail(out)}", result)
    result.update({k: v for k, v in lines[-1].items() if k not in ("plan", "problems")})
    t1 = time.perf_counter()
    limit = BUDGET.clip(l.timeout_s - (time.perf_counter() - t0))
    code, out = run_part("lora", lora_rl_argv(l, plan, data_path, workdir, unconfined), limit, log, env)
    result["job_s"], result["exit"] = round(time.perf_counter() - t1, 1), code
    result["run_plan"] = next((x.split("rstarjax: ", 1)[1] for x in out.splitlines()
                               if x.startswith("rstarjax: memory plan")), "")
    metrics = read_metrics(os.path.join(workdir, "logs", "metrics.jsonl"))
    # LoRA trains no base weight: full fine-tuning's FLOPs would overstate the update's MFU
    result["steps"] = run_steps(metrics, result, plan, l.prompts, getattr(args, "device_kind", ""), mfu=False)
    ckpts = os.path.join(workdir, "checkpoints")
    result["checkpoints"] = sorted(x for x in os.listdir(ckpts) if x.isdigit()) if os.path.isdir(ckpts) else []
    if code != 0:
        raise PartFailed(f"the LoRA stage-1 job {ended(code, limit)}: {tail(out)} (after {len(metrics)} steps)", result)
    return result


class PartFailed(RuntimeError):
    """A part that failed with a result worth keeping (the steps a job finished)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


# the engine's programs of a rollout's "prefill" phase (timing/rollout_prefill_s): the prompt and
# tool-turn feed (prefill and extend), the first token's sample, the slot insert (serving/programs.py)
PREFILL_PROGRAMS = ("feed_program", "sample_program", "insert_program")
LOG_TIME = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?)")


def programs_by_step(out: str, wall_times: list[float]) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """The programs jax compiled in each step ("1", "2", ...; "after" past the last one), from
    ``JAX_LOG_COMPILES``'s absl lines (local time of day) and each step's metrics ``wall_time``
    (when its line was written)."""
    ends = []
    for t in wall_times:
        lt = time.localtime(t)
        ends.append(lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + (t % 1))
    by_step: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for line in out.splitlines():
        m = LOG_TIME.match(line)
        names = compiled_programs(line) if m else []
        if not names:
            continue
        at = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        step = next((str(i + 1) for i, end in enumerate(ends) if at <= end), "after")
        by_step.setdefault(step, []).extend(names)
    return by_step


# ---- ckpt: the checkpoint wait, with the copy behind the next rollouts or in the loop (issue 45) ---
CKPT_AB = r"""
import json, os, shutil, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from rstarjax.io import checkpoint as ckpt_lib
from rstarjax.models import ModelConfig, Qwen3
a = json.loads(sys.argv[1])
cfg = ModelConfig.preset(a["model"])
shapes = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))), nnx.Param))
keys = iter(jax.random.split(jax.random.key(0), 3 * len(shapes)))
# the train state's arrays: float32 weights and AdamW's two moments, random bits (as trained weights
# compress: hardly), one array per parameter as the trainer holds them
state = {part: [jax.random.normal(next(keys), x.shape, jnp.float32) for x in shapes] for part in ("params", "mu", "nu")}
state = jax.block_until_ready(state)
ckpt_lib.finite_and_fingerprints(state)  # the save's check pass compiles here, not in the first arm's wait
nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
t = time.perf_counter()
host = jax.device_get(state)  # the plain pageable copy: the link's bandwidth as jax gets it
get_s = time.perf_counter() - t
del host

# the next step's rollouts, as the copy behind them sees them: HBM-bound passes over a buffer
# (decode reads weights and KV), a fixed amount of work timed alone and under each copy
buf = jnp.ones((a["work_elems"],), jnp.bfloat16)
@jax.jit
def passes(x):
    return jax.lax.fori_loop(0, 64, lambda _, y: y * jnp.bfloat16(0.999) + jnp.bfloat16(0.001), x)
def work(calls):
    t = time.perf_counter()
    y = buf
    for _ in range(calls):
        y = passes(y)
    jax.block_until_ready(y)
    return time.perf_counter() - t
work(1)
calls = max(1, int(a["work_s"] / max(work(2) / 2, 1e-6)))
work_alone_s = work(calls)
setup = {"state_gb": round(nbytes / 1e9, 2), "arrays": len(jax.tree.leaves(state)), "device_get_s": round(get_s, 3),
         "device_get_gbps": round(nbytes / 1e9 / get_s, 2), "work_alone_s": round(work_alone_s, 3)}
print(json.dumps({"setup": True, **setup}), flush=True)  # first: kept when the part is killed in an arm
out = {**setup, "runs": []}
walls = {}  # background or not -> the arms' wall seconds so far (save, copy, work, write, delete)
for i, arm in enumerate(a["arms"]):
    background, pinned = arm.startswith("background"), arm.endswith("pinned")
    # this arm's predicted seconds: the slowest measured arm of its kind (behind the rollouts or in
    # the loop); else the slowest of the other kind, the rollouts' work added or taken off; the first
    # from the plain copy's seconds, the write at write_gbps and the work. Run only where it fits
    # what the part's time limit leaves (deadline: the parent's clock), so that a killed arm loses nothing
    other = [w + (work_alone_s if background else -work_alone_s) for w in walls.get(not background, [])]
    predicted = max(walls.get(background) or other or [
        get_s + nbytes / 1e9 / a["write_gbps"] + (work_alone_s if background else 0.0)])
    left = a["deadline"] - time.time()
    if predicted > left:
        out["arms_not_run"] = a["arms"][i:]
        out["arms_not_run_why"] = f"{arm} predicted {predicted:.0f} s, {max(0.0, left):.0f} s of the part's limit left"
        print(json.dumps({"arms_not_run": out["arms_not_run"], "why": out["arms_not_run_why"]}), flush=True)
        break
    arm_started = time.perf_counter()
    directory = os.path.join(a["dir"], f"{i}_{arm}")
    cfg_ck = ckpt_lib.CheckpointConfig(every_steps=1, keep=1, pinned_host_transfer=pinned, background_copy=background)
    ck = ckpt_lib.Checkpointer(directory, cfg_ck)
    t = time.perf_counter()
    ck.save(1, state, {"step": 1})  # what the RL loop waits for at the save
    wait_s = time.perf_counter() - t
    run = {"arm": arm, "wait_s": round(wait_s, 3)}
    if background:  # the next rollouts run while the copy goes on; then the update waits for the rest
        work_s = work(calls)
        update_wait_s = ck.wait_copied()
        run.update(work_s=round(work_s, 3), update_wait_s=round(update_wait_s, 3),
                   step_increase_s=round(wait_s + update_wait_s + max(0.0, work_s - work_alone_s), 3))
    else:
        run["step_increase_s"] = run["wait_s"]
    ck.wait()
    run.update(copy_s=round(ck.copy_seconds, 3), write_s=round(ck.write_seconds() or 0.0, 3))
    ck.close()
    shutil.rmtree(directory, ignore_errors=True)  # the lent machine's disk holds few 20 GB states
    run.update(arm_s=round(time.perf_counter() - arm_started, 3), predicted_s=round(predicted, 3))
    walls.setdefault(background, []).append(run["arm_s"])
    out["runs"].append(run)
    print(json.dumps(run), flush=True)
for arm in a["arms"]:
    increases = [r["step_increase_s"] for r in out["runs"] if r["arm"] == arm]
    if increases:
        out[f"{arm}_step_increase_s"] = round(statistics.median(increases), 3)
        out[f"{arm}_copy_gbps"] = round(nbytes / 1e9 / statistics.median(
            r["copy_s"] for r in out["runs"] if r["arm"] == arm), 2)
print(json.dumps(out), flush=True)
"""

CKPT_ARMS = ("background_pinned", "pinned", "background_pageable", "pageable")


def part_ckpt(shape: Shape, args, log, env, scratch: str) -> dict:
    """What one save of the 1.7B train state (float32 weights and two AdamW moments, 20.6 GB, the
    arrays the trainer holds) adds to a step, in four arms, the shipped one first: the copy off
    the device behind the next step's rollouts (``checkpoint.background_copy``, emulated by ~10 s
    of HBM-bound work timed alone too; the update then waits for what is left) or in the loop,
    each through Orbax's pinned host memory or pageable memory
    (``checkpoint.pinned_host_transfer``); each write waited for and deleted; and a plain
    ``jax.device_get`` of the same arrays (the link's pageable bandwidth). ``step_increase_s``:
    the loop's wait at the save, plus the update's wait and the rollouts' slowdown behind a copy.
    The setup's figures are printed first and each arm's as it ends; an arm starts only where its
    predicted seconds fit what the part's limit leaves (``arms_not_run`` says which did not), and
    a part killed or failed all the same keeps what it printed (``PartFailed``)."""
    tiny = shape.model == "tiny"
    limit = BUDGET.clip(shape.timeouts["ckpt"])
    spec = {"model": "tiny" if tiny else "qwen3-1.7b", "dir": os.path.join(scratch, "ckpt"),
            "arms": list(CKPT_ARMS), "write_gbps": CKPT_WRITE_GBPS,
            # the parent's clock: what the limit leaves, less the summary's and the exit's seconds
            "deadline": time.time() + limit - max(3.0, 0.05 * limit),
            "work_s": 0.3 if tiny else 10.0, "work_elems": 1 << 20 if tiny else 1 << 30}
    code, out = run_part("ckpt", [sys.executable, "-c", CKPT_AB, json.dumps(spec)], limit, log, env)
    lines = json_lines(out)
    final = next((r for r in reversed(lines) if "runs" in r), None)
    if code == 0 and final is not None:
        return final
    setup = next((r for r in lines if r.get("setup")), {})
    result = {**{k: v for k, v in setup.items() if k != "setup"}, "runs": [r for r in lines if "arm" in r]}
    raise PartFailed(f"{ended(code, limit)}: {tail(out)} (after {len(result['runs'])} arms)", result)


CKPT_WRITE_GBPS = 1.0  # the first arm's predicted write (20.6 GB: ~20 s) before one was measured


# ---- the parts' speed ------------------------------------------------------------------------------
def benchmark_result(name: str, argv: list[str], timeout_s: float, log, env) -> dict:
    """A benchmark script's one JSON line; where it failed or ran out of time, ``PartFailed``
    with its last JSON line (what it printed before) and its output tail."""
    limit = BUDGET.clip(timeout_s)
    code, out = run_part(name, argv, limit, log, env)
    if code != 0:
        raise PartFailed(f"{ended(code, limit)}: {tail(out)}", last_json_line(out))
    return last_json_line(out)


def part_serving(shape: Shape, preset: str, name: str, log, env, trace_dir: str,
                 blocking: str = "") -> dict:
    argv = [sys.executable, os.path.join(HERE, "serving.py"), "--device", "gpu",
            "--presets", preset, "--batches", shape.serving_batches,
            "--trace-dir", trace_dir] + (["--quick"] if shape.serving_quick else [])
    if blocking:
        argv += ["--pallas-blocking", blocking]
    return benchmark_result(name, argv, shape.timeouts.get(name, shape.timeouts["blocking"]), log, env)


def part_kernels(shape: Shape, args, log, env) -> dict:
    """The paged-attention kernels alone at decode shapes (benchmarks/decode_kernel_sweep.py):
    the engine's Triton blocking, the ``--blockings`` ones, and cuDNN's paged attention, each
    checked against a float32 reference. Its rows, not one line: several arms per shape."""
    argv = [sys.executable, os.path.join(HERE, "decode_kernel_sweep.py"),
            "--arms", "triton,cudnn,cudnn_packed", "--budget-s", str(0.75 * BUDGET.clip(shape.timeouts["kernels"]))]
    if shape.model == "tiny":
        argv += ["--tiny", "--interpret", "--iters", "1"]
    else:
        per, splits, warps = zip(*(spec.split(",")[:3] for spec in args.blockings.split(";") if spec))
        argv += ["--per-block", ",".join(per), "--k-splits", ",".join(splits),
                 "--warps", ",".join(warps), "--contexts", "560,4096",
                 # 64-token pages first: the 16-token ones were measured twice (2026-11-27) and
                 # the part's time ran out before the others both times
                 "--page-sizes", "64,16"]
    limit = BUDGET.clip(shape.timeouts["kernels"])
    code, out = run_part("kernels", argv, limit, log, env)
    rows = {"rows": [r for r in json_lines(out) if not r.get("best")]}
    if code != 0:  # the rows it printed before are kept
        raise PartFailed(f"{ended(code, limit)}: {tail(out)}", rows)
    return rows


def part_train(shape: Shape, batch: int, name: str, log, env, trace_dir: str,
               remat: str = "full") -> dict:
    argv = [sys.executable, os.path.join(HERE, "bench_trainer.py"), "--preset", shape.train_preset,
            "--batch", str(batch), "--seq", str(shape.train_seq), "--steps", "2",
            "--repeats", str(shape.train_repeats), "--no-baseline", "--trace-dir", trace_dir]
    if shape.train_preset != "tiny":
        argv += ["--remat", remat]
    return benchmark_result(name, argv, shape.timeouts.get(name, shape.timeouts["remat"]), log, env)


# ---- kernels2 / decode: our decode kernel and sampler against jax's (issue 46) -------------------
# decode: 8 arms x 3 batches, each a ~17 s compile of the 1.7B decode program (the serving part's
# runs, 2026-11-27), ~7 min; what is left of the budget cuts the 32-row batch first
DECODE_TIMEOUTS = {"gpu": {"kernels2": 150, "gemms": 100, "decode": 400, "decode_4k": 180},
                   "tiny": {"kernels2": 300, "gemms": 200, "decode": 400, "decode_4k": 300}}
# decode_4k: the issue's 4K-context rows, where the pool holds them (64 rows on an H100, 128 on
# an H200; 256 x 4K is 120 GB of KV): jax's kernel against the predicted fastest, with and
# without cuBLAS GEMMs, and the same work on our Mosaic GPU kernel (where attention is most of
# the step)
DECODE_4K_ARMS = ("pallas_gpu:exact,pallas_gpu_packed_rope:fused,pallas_mgpu_packed_rope:fused,"
                  "pallas_gpu_packed_layer:fused,pallas_gpu_packed_rope:fused:cublas")
# Our kernel's blockings (PAGES_PER_BLOCK,MAX_K_SPLITS,TARGET_PROGRAMS,NUM_WARPS,NUM_STAGES[,TENSOR_CORES]) in
# predicted order, best first (docs/serving.md "Our decode kernel"), so a part that runs out of
# time has measured the likeliest winners; jax's Triton kernel with the engine's blocking runs first.
PACKED_BLOCKINGS = "4,8,1024,4,3;4,8,1024,4,3,1;2,8,1024,4,4;8,8,1024,8,3;4,8,1048576,4,3"
# The Mosaic GPU kernel's (BLOCK_TOKENS,STAGES; models/decode_kernel_mgpu.py), taken in turn with
# the packed ones: 3 blocks of 64 tokens in flight (112 KB of shared memory, two programs an SM),
# 2 (80 KB, two an SM), 2 of 128 tokens (144 KB, one an SM), 4 of 64 (144 KB)
MOSAIC_BLOCKINGS = "64,3;64,2;128,2;64,4"
# The engine's decode, attention path x sampler [x GEMMs], alternating; the issue's target batches
# first. Each arm one change on the one before (jax's kernel; ours; the one-pass sampler; ours
# writing the step's K/V; norming and rotating q/k too; the projections as our fused GEMMs,
# models/decode_gemm.py), so their differences are each change's; the last, cuBLAS GEMMs, is a
# change on the rope arm (the fused-GEMM and cuBLAS arms on the faster kernel: ON_MOSAIC below),
# and so is our Mosaic GPU kernel doing the rope arm's work
# (pallas_mgpu_packed_rope; the two kernels alone are kernels2's). DECODE_TRACED are traced at
# 256 and 64 rows, their HLO kept, for the next fusions: the rope arm (XLA's GEMMs and small
# kernels) and the fused-GEMM arm (ours in the engine).
DECODE_ARMS = ("pallas_gpu:exact,pallas_gpu_packed:exact,pallas_gpu_packed:fused,"
               "pallas_gpu_packed_append:fused,pallas_gpu_packed_rope:fused,pallas_mgpu_packed_rope:fused,"
               "pallas_gpu_packed_layer:fused,pallas_gpu_packed_rope:fused:cublas")
DECODE_TRACED = "pallas_gpu_packed_rope:fused,pallas_gpu_packed_layer:fused"
# The decode parts' arms that are a change on the rope arm (our fused GEMMs, cuBLAS GEMMs) run on
# the faster of our two kernels alone (kernels2's rows, ``faster_kernel``), so that a loan's last
# arms compose the best of each change: as listed above on the Triton one, or, where kernels2
# timed the Mosaic GPU one faster, on it (the rope arms of both kernels stay as they are)
ON_MOSAIC = {"pallas_gpu_packed_layer:fused": "pallas_mgpu_packed_layer:fused",
             "pallas_gpu_packed_rope:fused:cublas": "pallas_mgpu_packed_rope:fused:cublas"}
MOSAIC_MAX_DIFF = 0.05  # a kernels2 row further than this from the float32 reference is not a time
# The decode and gemms parts compile each batch's arms ahead, side by side (timing.compile_in_threads;
# the device host has 16 cores): decode was ~90 % compiles one after another, gemms 8 arms x 2
# batches x 5 kinds of 16-layer programs. Their rows say whether it paid (compiled_ahead_s; the
# decode rows' compile_ahead_wall_s against their sum)
DECODE_COMPILE_THREADS = 4


# kernels2's second sweep: 64 rows of the engine's ~640 tokens, where the default blocking's two
# splits cost a combine kernel a layer; the same kernel in one split (target 512 programs) beside it
SHORT_ROW_BLOCKINGS = "4,8,1024,4,3;4,8,512,4,3"
SHORT_ROW_MOSAIC = "64,3;64,2"
# kernels2's first step: each Mosaic GPU kernel once at a small shape, in a process of its own
# (decode_kernel_sweep.py --canary). Neither has run on a device yet: one that fails or hangs
# there costs this timeout, and the sweeps and the decode parts then leave the Mosaic kernels out
# instead of losing their other rows to it
MOSAIC_CANARY_S = {"gpu": 60, "tiny": 240}
MOSAIC_CANARY_SHAPE = ["--batches", "8", "--contexts", "300", "--max-tokens", "512", "--page-sizes", "16"]


def part_kernels2(shape: Shape, args, log, env) -> dict:
    """The decode kernels alone at 256 rows x 4,096 tokens (Qwen3-1.7B: 16 q / 8 kv heads, one
    layer's 16-token pages scattered over the pool, then 64-token ones): jax's Triton kernel with
    the engine's blocking, then ours with each ``PACKED_BLOCKINGS`` spec and our Mosaic GPU
    kernel with each ``MOSAIC_BLOCKINGS`` spec, in turn, each against a float32 reference, with
    its share of the HBM peak (benchmarks/decode_kernel_sweep.py); then 64 rows
    x 640 tokens, ``SHORT_ROW_BLOCKINGS`` (two splits and a combine, or one) and ``SHORT_ROW_MOSAIC``.
    First the Mosaic GPU canary (``MOSAIC_CANARY_S``): where a Mosaic kernel fails there, the
    sweeps run without it and ``mosaic_canary.ok`` tells the decode parts to leave it out too."""
    timeout = BUDGET.clip(DECODE_TIMEOUTS[args.shape]["kernels2"])
    started = time.perf_counter()
    canary = mosaic_canary(shape, args, log, env)
    arms = "packed,mosaic" if canary["ok"] else "packed"
    sweep = [sys.executable, os.path.join(HERE, "decode_kernel_sweep.py"), "--arms", arms]
    if shape.model == "tiny":
        runs = [["--tiny", "--interpret", "--iters", "1", "--packed-blockings", PACKED_BLOCKINGS]]
    else:
        # 16-token pages (the engine's) first; 64-token ones, the page-size lever (4 KB -> 16 KB
        # contiguous reads a page), after
        runs = [["--batches", "256", "--contexts", "4096", "--page-sizes", "16,64", "--iters", "20",
                 "--packed-blockings", PACKED_BLOCKINGS, "--mosaic-blockings", MOSAIC_BLOCKINGS],
                ["--batches", "64", "--contexts", "640", "--page-sizes", "16", "--iters", "20",
                 "--packed-blockings", SHORT_ROW_BLOCKINGS, "--mosaic-blockings", SHORT_ROW_MOSAIC]]
    rows = []
    for i, extra in enumerate(runs):
        left = timeout - (time.perf_counter() - started)
        if i and left < MIN_PART_S:
            break
        share = 0.8 if i == 0 and len(runs) > 1 else 0.9  # the first leaves the second its time
        code, out = run_part("kernels2", sweep + extra + ["--budget-s", str(0.7 * share * left)],
                             share * left, log, env)
        rows += json_lines(out)
        if code != 0:  # the rows it printed before are kept
            raise PartFailed(f"{ended(code, share * left)}: {tail(out)}", {"rows": [r for r in rows if not r.get("best")],
                                                           "mosaic_canary": canary})
    return {"rows": [r for r in rows if not r.get("best")], "mosaic_canary": canary}


def mosaic_canary(shape: Shape, args, log, env) -> dict:
    """Each Mosaic GPU kernel once against the reference, in a process of its own under
    ``MOSAIC_CANARY_S``: {"ok": both ran and matched, "rows", and "error" where not}."""
    argv = [sys.executable, os.path.join(HERE, "decode_kernel_sweep.py"), "--canary",
            "--mosaic-blockings", MOSAIC_BLOCKINGS.split(";")[0]]
    argv += ["--interpret", "--batches", "3", "--contexts", "40", "--max-tokens", "128",
             "--kv-heads", "2", "--q-heads", "4"] if shape.model == "tiny" else MOSAIC_CANARY_SHAPE
    code, out = run_part("kernels2", argv, BUDGET.clip(MOSAIC_CANARY_S[args.shape]), log, env)
    rows = [r for r in json_lines(out) if r.get("canary")]
    ok = code == 0 and {r["arm"] for r in rows if r.get("ok")} == {"mosaic", "mosaic_rope"}
    result = {"ok": ok, "rows": rows}
    if not ok:
        result["error"] = ("ran past its time" if code is None else f"exit {code}" if code else
                           "a kernel failed or differed") + f": {tail(out)}"
    return result


def canary_of(results: dict) -> dict | None:
    """kernels2's Mosaic GPU canary in this run's results (None: kernels2 did not run)."""
    kernels2 = results.get("kernels2")
    return (kernels2.result or {}).get("mosaic_canary") if kernels2 is not None else None


def mosaic_arms_out(results: dict, arms: str) -> tuple[str, str]:
    """``arms`` without the Mosaic GPU kernel's (``pallas_mgpu*``) where kernels2's canary ran in
    this run and failed; (the arms, why they went or "")."""
    canary = canary_of(results)
    if canary is None or canary.get("ok"):
        return arms, ""
    kept = ",".join(a for a in arms.split(",") if not a.startswith("pallas_mgpu"))
    return kept, f"the Mosaic GPU arms left out: kernels2's canary failed ({canary.get('error', '')[:120]})"


def faster_kernel(results: dict) -> tuple[bool, str]:
    """Whether kernels2 timed our Mosaic GPU kernel faster than our Triton one, alone: the
    geometric mean, over the shapes of 16-token pages (the engine's) both ran, of each kernel's
    best time (rows within ``MOSAIC_MAX_DIFF`` of the reference), Mosaic over Triton, below 1.
    -> (faster, what the rows say)."""
    kernels = results.get("kernels2")
    best: dict[tuple, float] = {}
    for r in (kernels.result or {}).get("rows", []) if kernels is not None else []:
        if (r.get("arm") in ("packed", "mosaic") and "us" in r and r.get("page_size") == 16
                and r.get("max_diff_vs_reference", math.inf) <= MOSAIC_MAX_DIFF):
            key = (r["arm"], r["batch"], r["context"])
            best[key] = min(best.get(key, math.inf), r["us"])
    ratios = {(b, c): t / best["packed", b, c] for (arm, b, c), t in sorted(best.items())
              if arm == "mosaic" and ("packed", b, c) in best}
    if not ratios:
        return False, "kernels2 timed no Mosaic GPU kernel beside the Triton one"
    mean = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    shapes = ", ".join(f"b{b} ctx{c} {x:.2f}x" for (b, c), x in ratios.items())
    return mean < 1, f"kernels2, Mosaic GPU over Triton alone: {shapes}, geometric mean {mean:.2f}x"


def on_faster_kernel(arms: str, mosaic: bool) -> str:
    """``arms`` (comma-separated) with the ``ON_MOSAIC`` ones on the Mosaic GPU kernel where it
    was the faster (``faster_kernel``), as they are where not."""
    return ",".join(ON_MOSAIC.get(a, a) for a in arms.split(",")) if mosaic else arms


# gemms: our decode GEMMs' blockings (models/decode_gemm.py GemmBlocking: BLOCK_ROWS,BLOCK_COLS,
# BLOCK_K,TARGET_PROGRAMS,MIN_COLS,NUM_WARPS,NUM_STAGES), the engine's first. Then along the
# axis the arithmetic says matters (docs/serving.md "gemms"): each program re-reads all its rows
# of x from L2, so at 64 rows x 32 columns it reads 2x more activation than weight, ~2.5x the
# HBM bytes through L2 a layer; wider column blocks read less but fill fewer SMs:
# 64-wide (qkv 64 programs at 64 rows), never narrowed (128-wide: 32); bracketing the other way,
# 16-wide with a 6-stage pipeline; 64 x 256 tiles on 8 warps; 128-row blocks for 256 rows
GEMM_BLOCKINGS = ("64,128,128,256,32,4,4;64,128,128,128,64,4,4;64,128,128,1,128,4,4;"
                  "64,128,64,512,16,4,6;64,256,64,128,64,8,3;128,128,64,256,32,8,3")


def part_gemms(shape: Shape, args, log, env) -> dict:
    """Our decode GEMMs alone (benchmarks/decode_gemm_sweep.py) at 64 and 256 rows, Qwen3-1.7B's
    layer shapes over 16 layers of distinct weights: the layer's four kernels chained, then each kind, against
    XLA's ops of the same work (its Triton GEMMs and cuBLAS), ``GEMM_BLOCKINGS`` in order. Its
    ``best_gemm_blocking`` is the blocking the ``decode`` part's ``pallas_gpu_packed_layer`` arm
    then runs with."""
    timeout = BUDGET.clip(DECODE_TIMEOUTS[args.shape]["gemms"])
    argv = [sys.executable, os.path.join(HERE, "decode_gemm_sweep.py"), "--budget-s", str(0.75 * timeout)]
    # 16 layers of distinct weights (1.6 GB, 32x an H200's L2) keep a launch's host cost a few %
    # of a call while compiling half of 28's
    argv += ["--tiny", "--interpret", "--compile-threads", "2"] if shape.model == "tiny" else [
        "--gemm-blockings", GEMM_BLOCKINGS, "--layers", "16", "--compile-threads", str(DECODE_COMPILE_THREADS)]
    code, out = run_part("gemms", argv, timeout, log, env)
    lines = json_lines(out)
    result = {"rows": [r for r in lines if "best_gemm_blocking" not in r]}
    # the sweep prints its best after each batch of the layer rows: the last is the most measured
    best = next((r for r in reversed(lines) if "best_gemm_blocking" in r), None)
    if best:
        result["best"] = best
    if code != 0:  # the rows it printed before are kept
        raise PartFailed(f"{ended(code, timeout)}: {tail(out)}", result)
    return result


def part_decode(shape: Shape, args, log, env, trace_dir: str, name: str = "decode",
                gemm_blocking: str = "", results: dict | None = None) -> dict:
    """``decode``: the engine's decode step at 256, 64 and 32 rows (512-token prompts, the shape
    benchmarks/serving.py measures) with each ``DECODE_ARMS`` entry, the arms alternating call by
    call, median of 3 calls of 16 steps each, tokens/s and HBM-roofline fraction; one traced
    call of each ``DECODE_TRACED`` arm at 256 and 64 rows (into ``trace_dir``). ``decode_4k``: the same
    at 4,096-token prompts, 64 and 128 rows, ``DECODE_4K_ARMS``, no trace. Where kernels2 ran
    before and its Mosaic GPU canary failed, the Mosaic arms are left out (``mosaic_arms_out``);
    where it timed the Mosaic GPU kernel faster, the ``ON_MOSAIC`` arms run on it (``faster_kernel``;
    not at the tiny shape, whose arms are fixed)."""
    timeout = BUDGET.clip(DECODE_TIMEOUTS[args.shape][name])
    long = name == "decode_4k"
    arms, left_out = mosaic_arms_out(results or {}, DECODE_4K_ARMS if long else DECODE_ARMS)
    traced, composed = DECODE_TRACED, None
    if shape.model != "tiny":
        mosaic, why = faster_kernel(results or {})
        arms, traced = on_faster_kernel(arms, mosaic), on_faster_kernel(traced, mosaic)
        composed = {"kernel": "mosaic" if mosaic else "triton", "why": why}
    argv = [sys.executable, os.path.join(HERE, "decode_kernel_sweep.py"), "--engine",
            "--engine-arms", arms, "--budget-s", str(0.85 * timeout)]
    if not long:
        argv += ["--trace-dir", os.path.join(trace_dir, "decode"), "--trace-arms", traced]
    if gemm_blocking:  # the gemms part's best, for the arm that runs our GEMMs
        argv += ["--gemm-blocking", gemm_blocking]
    if shape.model == "tiny":  # the kernels in their interpreter; one arm per path is enough
        argv += ["--tiny", "--interpret", "--batches", "4", "--trace-batches", "4",
                 "--engine-arms", "ragged:exact:cublas,pallas_gpu_packed_rope:fused"
                 + ("" if long else ",pallas_gpu_packed_layer:fused")]
        argv += ["--prompt-len", "160"] if long else ["--compile-threads", "2"]  # 160: past the decode rows' contexts
    else:
        argv += ["--batches", "64,128", "--prompt-len", "4096"] if long else ["--batches", "256,64,32"]
        argv += ["--rounds", "3", "--compile-threads", str(DECODE_COMPILE_THREADS)]
    code, out = run_part(name, argv, timeout, log, env)
    rows = {"rows": json_lines(out)}
    if left_out:
        rows["left_out"] = left_out
    if composed:
        rows["composed_on"] = composed
    if code != 0:  # the batches it finished are kept
        raise PartFailed(f"{ended(code, timeout)}: {tail(out)}", rows)
    return rows


def decode_rows(results: dict) -> list[tuple[str, str]]:
    """Summary rows of the kernels2, decode and decode_4k parts."""
    rows = []
    kernels = results.get("kernels2")
    canary = canary_of(results)
    if canary is not None:
        rows.append(("kernel2 mosaic canary", "ok: " + ", ".join(
            f"{r['arm']} max diff {r.get('max_diff_vs_reference', float('nan')):.3g}" for r in canary["rows"])
            if canary["ok"] else f"failed, the Mosaic GPU kernels left out: {canary.get('error', '')[:120]}"))
    for r in (kernels.result.get("rows", []) if kernels is not None else []):
        if r["arm"] == "mosaic":  # pages a block, blocks in flight, shared memory a program
            arm = f"mosaic {r.get('per_block')},{r.get('stages')} {r.get('shared_kb')}KB page{r.get('page_size')}"
        else:
            arm = (f"{r['arm']} {r.get('per_block')},{r.get('k_splits')},{r.get('warps')},{r.get('stages')}"
                   + (" tc" if r.get("tensor_cores") else "") + f" page{r.get('page_size')}")
        rows.append((f"kernel2 b{r['batch']} ctx{r['context']} {arm}",
                     f"{r['us']} us, {r['gbps']} GB/s ({100 * r.get('hbm_fraction', 0):.0f} % of HBM), "
                     f"max diff {r['max_diff_vs_reference']:.3g}" if "us" in r
                     else f"error: {r.get('error', '')[:120]}"))
    gemms = results.get("gemms")
    for r in (gemms.result.get("rows", []) if gemms is not None else []):
        arm = r.get("arm", "") + (f" {r['blocking']}" if r.get("blocking") else "")
        label = f"gemms b{r.get('batch')} {r.get('kind')} {arm}".rstrip()
        if "us_per_layer" in r:
            rows.append((label, f"{r['us_per_layer']} us a layer {r['us_range']}, {r['gbps']} GB/s"
                         + (f" ({100 * r['hbm_fraction']:.0f} % of HBM)" if r.get("hbm_fraction") else "")
                         + (f", {r['vs_best_xla']}x the faster XLA" if r.get("vs_best_xla") else "")
                         + (f", max diff {r['max_diff_vs_xla']:.3g}" if "max_diff_vs_xla" in r else "")))
        else:
            rows.append((label, f"error: {r.get('error', r.get('skipped', ''))[:120]}"))
    if gemms is not None and gemms.result.get("best"):
        best = gemms.result["best"]
        rows.append(("gemms best blocking (decode's _layer arm)",
                     f"{best['best_gemm_blocking']}: layer {best.get('layer_vs_best_xla')}x the faster "
                     f"XLA at b{best.get('batches')}"))
    decode = [r for part in ("decode", "decode_4k") if results.get(part) is not None
              for r in results[part].result.get("rows", [])]
    for part in ("decode", "decode_4k"):
        if results.get(part) is not None and results[part].result.get("left_out"):
            rows.append((f"{part} arms", results[part].result["left_out"][:160]))
        if results.get(part) is not None and results[part].result.get("composed_on"):
            on = results[part].result["composed_on"]
            rows.append((f"{part} _layer and cublas arms", f"on the {on['kernel']} kernel: {on['why'][:160]}"))
    for r in decode:
        if "error" in r:  # a pool that could not hold the rows, or an arm that did not compile
            arm = " ".join(x for x in (r.get("attention"), r.get("sampler"), r.get("gemms")) if x)
            rows.append((f"decode b{r['batch']} ctx{r.get('prompt_len')} {arm}".rstrip(),
                         f"error: {r['error'][:120]}"))
            continue
        gemms = "" if r.get("gemms", "xla") == "xla" else f" {r['gemms']}"
        rows.append((f"decode b{r['batch']} ctx{r.get('prompt_len')} {r['attention']} {r['sampler']}{gemms}",
                     f"{r['step_ms']} ms/step {r['step_ms_range']}, {r['decode_tok_s']:,.0f} tok/s"
                     + (f", {100 * r['roofline_fraction']:.1f} % of HBM roofline"
                        if r.get("roofline_fraction") else "") + f", ctx {r['context']}"))
    for best in best_decode_choices(decode):
        rows.append((f"decode best per batch ctx{best['prompt_len']} {best['sampler']} {best['gemms']}",
                     f"--config.serving.decode_attention={best['decode_attention']} "
                     f"({', '.join(f'b{b} {ms} ms' for b, ms in best['step_ms'].items())})"))
    return rows


def best_decode_choices(rows: list[dict]) -> list[dict]:
    """From the decode parts' rows, per (prompt length, sampler, GEMMs) with more than one
    attention path measured: the ``serving.decode_attention`` that runs each measured batch
    with its fastest path (``serving.decode_choice.decode_choice_from_rows``), and its step
    times. Only batches every path of the group measured count, so no path wins by default."""
    from rstarjax.serving.decode_choice import decode_choice_from_rows

    groups: dict[tuple, dict[int, dict[str, float]]] = {}
    for r in rows:
        if "error" in r or "step_ms" not in r:
            continue
        key = (r.get("prompt_len"), r["sampler"], r.get("gemms", "xla"))
        groups.setdefault(key, {}).setdefault(int(r["batch"]), {})[r["attention"]] = float(r["step_ms"])
    out = []
    for (prompt_len, sampler, gemms), by_batch in groups.items():
        paths = set().union(*by_batch.values())
        full = {b: times for b, times in by_batch.items() if set(times) == paths}
        if len(paths) < 2 or not full:
            continue
        fastest = {b: min(times, key=times.get) for b, times in full.items()}
        out.append({"prompt_len": prompt_len, "sampler": sampler, "gemms": gemms,
                    "decode_attention": decode_choice_from_rows(fastest).spec(),
                    "step_ms": {b: full[b][fastest[b]] for b in sorted(full)}})
    return out


# ---- summary -------------------------------------------------------------------------------------
AGENT_ROW_KEYS = ("rollout_s", "decode_s", "prefill_s", "tool_wait_s", "old_logprobs_s", "update_s",
                  "update_mfu", "handoff_s", "checkpoint_s", "checkpoint_copy_s", "checkpoint_copy_wait_s",
                  "compile_s", "decode_tok_s", "trained_tok_s",
                  "tool_calls_per_rollout", "tool_call_rate", "rollout_vs_roofline",
                  "decode_roofline_fraction", "peak_vs_plan")


def agent_rows(part: PartResult | None) -> list[tuple[str, str]]:
    """The ``h100`` part's rows: the plan, the SFT, one row per RL step (prefill_s is prefill,
    extend and slot inserts), the programs step 2 compiled."""
    if part is None:
        return []
    r, rows = part.result, []
    p = r.get("plan") or {}
    if p:
        given = p.get("given") or {}
        fraction = (f"kv_pages {given['serving.kv_pages']}, given" if given.get("serving.kv_pages") else
                    f"kv_memory_fraction {p.get('kv_memory_fraction') or 0:.3f}"
                    + (", given" if "serving.kv_memory_fraction" in given else ", the plan's"))
        rows.append(("h100 plan", f"remat {p.get('remat_policy')}"
                                  + (" (given)" if "model.remat_policy" in given else "")
                                  + f", micro-batch {p.get('micro_batch')}"
                                  + (" (given)" if "trainer.micro_batch_size" in given else "")
                                  + f", KV pool {p.get('kv_pool_gb')} GB ({fraction}), predicted peak "
                                  f"{p.get('peak_gb')} GB of {p.get('device_gb')} GB"))
    if r.get("run_plan"):
        rows.append(("h100 run sized", r["run_plan"]))
    if r.get("sft"):
        rows.append(("h100 SFT", f"{r['sft']['steps']} steps in {r.get('sft_s')} s, loss "
                                 f"{r['sft']['first_loss']:.3f} -> {r['sft']['last_loss']:.3f}, "
                                 f"{r['sft'].get('skipped_nonfinite', 0)} updates skipped as not finite"))
    for i, s in enumerate(r.get("steps", []), 1):
        rows.append((f"h100 step {i}", " ".join(
            f"{k}={s[k]:.3g}" if isinstance(s.get(k), float) else f"{k}={s.get(k)}"
            for k in AGENT_ROW_KEYS if k in s)))
    if "step2_prefill_compiles" in r:
        if r["step2_prefill_compiles"] is None or len(r.get("steps", [])) < 2:  # nothing to say of step 2
            missing = f"step 2 not reached ({len(r.get('steps', []))} step(s) finished)"
            rows += [("h100 step-2 prefill compiles", missing), ("h100 step-2 prefill recompiles", missing)]
        else:
            rows.append(("h100 step-2 prefill compiles", ", ".join(r["step2_prefill_compiles"]) or "none"))
            rows.append(("h100 step-2 prefill recompiles", ", ".join(r["step2_prefill_recompiles"]) or "none"))
    if part.ok:
        rows.append(("h100 job", f"{r.get('job_s')} s, checkpoints {r.get('checkpoints')}"))
    return rows


LORA_ROW_KEYS = ("rollout_s", "decode_s", "prefill_s", "old_logprobs_s", "update_s", "handoff_s",
                 "checkpoint_s", "compile_s", "decode_tok_s", "trained_tok_s", "decode_roofline_fraction",
                 "peak_vs_plan")


def lora_rows(part: PartResult | None) -> list[tuple[str, str]]:
    """The ``lora`` part's rows: the plan, what the job sized itself, one row per RL step."""
    if part is None:
        return []
    r, rows = part.result, []
    p = r.get("plan") or {}
    if p:
        rows.append((f"lora plan ({r.get('model')}, rank {r.get('lora_rank')})",
                     f"remat {p.get('remat_policy')}, micro-batch {p.get('micro_batch')}, KV pool "
                     f"{p.get('kv_pool_gb')} GB, predicted peak {p.get('peak_gb')} GB of {p.get('device_gb')} GB"))
    if r.get("run_plan"):
        rows.append(("lora run sized", r["run_plan"]))
    for i, s in enumerate(r.get("steps", []), 1):
        rows.append((f"lora step {i}", " ".join(
            f"{k}={s[k]:.3g}" if isinstance(s.get(k), float) else f"{k}={s.get(k)}"
            for k in LORA_ROW_KEYS if k in s)))
    if part.ok:
        rows.append(("lora job", f"{r.get('job_s')} s, checkpoints {r.get('checkpoints')}"))
    return rows


def summary_rows(results: dict[str, PartResult]) -> list[tuple[str, str]]:
    """(figure, value) rows of the table printed last, a section at a time: a section that
    cannot be made (a result of an unforeseen form) is one row saying so, the others stay."""
    rows = []
    for section in (env_rows, part_status_rows, main_rows, lambda res: agent_rows(res.get("h100")),
                    lambda res: lora_rows(res.get("lora")), ckpt_rows, serving_rows, kernels_rows,
                    decode_rows, train_rows):
        try:
            rows += section(results)
        except Exception as exc:  # noqa: BLE001  (the table is what a loan's reader sees first)
            name = getattr(section, "__name__", "section")
            rows.append((f"table ({name})", f"not made: {type(exc).__name__}: {exc}"[:200]))
    return rows


def env_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    env = results.get("env")
    if env and env.ok:
        e = env.result
        rows.append(("device", f"{e.get('gpu') or e.get('device_kind')} driver {e.get('driver', '-')} "
                               f"jax {e.get('jax')} ({e.get('date')}, {e.get('commit') or '-'})"))
        pool = e.get("code_pool")
        if pool:
            rows.append(("code pool", f"did not run: {pool.get('error', '')[:140]}" if not pool.get("ran") else
                         "confined: " + ", ".join(f"{k} {pool.get(k)}" for k in ("fresh_root", "own_tmp", "uid_drop",
                                                                                 "call_budget"))
                         if pool.get("gap") is None else
                         f"UNCONFINED ({pool['gap'][:100]}): the RL jobs ran with env.allow_unconfined=True"))
    return rows


def part_status_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    for name, part in results.items():
        if part.skipped:
            rows.append((name, part.error))
        elif not part.ok:
            rows.append((name, f"FAILED after {part.seconds:.0f} s: {part.error[:160]}"))
    return rows


def main_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    main = results.get("main")
    if main is not None:
        for i, s in enumerate(main.result.get("steps", []), 1):
            rows.append((f"main step {i}", " ".join(
                f"{k}={s[k]:.1f}" if isinstance(s.get(k), float) else f"{k}={s.get(k)}"
                for k in ("rollout_s", "prefill_s", "decode_s", "tool_wait_s", "roc_batch_s",
                          "old_logprobs_s", "update_s", "handoff_s", "checkpoint_s",
                          "decode_tok_s", "trained_tok_s", "peak_device_gb", "preemptions",
                          "reprefilled_tokens") if k in s)))
        if main.ok:
            rows.append(("main job", f"{main.result.get('job_s')} s, checkpoints "
                                     f"{main.result.get('checkpoints')}"))
    return rows


def ckpt_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    ckpt = results.get("ckpt")
    if ckpt is not None and (ckpt.result or {}).get("state_gb") is not None:  # a failed part's rows too
        c = ckpt.result
        rows.append(("ckpt", f"{c.get('state_gb')} GB in {c.get('arrays')} arrays; device_get "
                             f"{c.get('device_get_s')} s ({c.get('device_get_gbps')} GB/s); rollouts alone "
                             f"{c.get('work_alone_s')} s"))
        for r in c.get("runs", []):  # the step's wall-clock increase per arm (target <= 2 s)
            behind = (f", rollouts {r['work_s']} s, update waited {r['update_wait_s']} s" if "work_s" in r else "")
            rows.append((f"ckpt {r['arm']}", f"step +{r['step_increase_s']} s (save {r['wait_s']} s{behind}); "
                                             f"copy {r['copy_s']} s, write {r['write_s']} s"))
        if c.get("arms_not_run"):
            rows.append(("ckpt arms not run", f"{', '.join(c['arms_not_run'])}: {c.get('arms_not_run_why', '')}"))
    return rows


def serving_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    for serving in results.values():
        if not (serving.name.startswith(("serving", "blocking")) and serving.ok):
            continue
        arm = "" if serving.name.startswith("serving") else f" [{serving.name}]"
        for k, v in serving.result.items():
            if k.endswith("_decode_tok_s"):
                key = k[: -len("_decode_tok_s")]
                frac = serving.result.get(f"{key}_roofline_fraction")
                rows.append((f"decode {key}{arm}", f"{v:,.0f} tok/s, {serving.result.get(f'{key}_step_ms')} "
                                              f"ms/step" + (f", {100 * frac:.1f} % of HBM roofline"
                                                            if frac else "")))
    return rows


def kernels_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    kernels = results.get("kernels")
    for r in (kernels.result.get("rows", []) if kernels is not None else []):
        arm = r["arm"] + (f" {r['per_block']},{r['k_splits']},{r['warps']}" if r["arm"] == "triton" else "")
        rows.append((f"kernel b{r['batch']} ctx{r['context']} page{r['page_size']} {arm}",
                     f"{r['us']} us, {r['gbps']} GB/s, max diff {r['max_diff_vs_reference']:.3g}"
                     if "us" in r else f"error: {r.get('error', '')[:120]}"))
    return rows


def train_rows(results: dict) -> list[tuple[str, str]]:
    rows = []
    for name, part in results.items():
        if name.startswith(("train_", "remat_")) and part.ok:
            r = part.result
            rows.append((f"train {r.get('batch')}x{r.get('seq')} remat {r.get('remat')}",
                         f"{r.get('trainer_tokens_per_s'):,.0f} tok/s, step {r.get('trainer_step_s')} s"
                         + (f", MFU {100 * r['mfu']:.1f} %" if r.get("mfu") else "")))
    return rows


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max((len(k) for k, _ in rows), default=0)
    print("\n" + "-" * 100)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * 100, flush=True)


TAR_LIMIT = 15 * 2**20  # a lent device returns files of at most 16 MiB


def pack_traces(trace_dir: str, dest: str, limit: int = TAR_LIMIT) -> list[str]:
    """Every trace and xplane under ``trace_dir`` into ``dest`` (a lent device returns at most 8
    files), continued in ``dest`` with ``_2``, ``_3``... before the extension when one tar would
    pass ``limit`` bytes; names relative to ``trace_dir``."""
    names = sorted(os.path.relpath(os.path.join(d, n), trace_dir)
                   for d, _, files in os.walk(trace_dir) for n in files
                   if n.endswith((".json.gz", ".xplane.pb")))
    volumes, size = [[]], 0
    for n in names:
        bytes_ = os.path.getsize(os.path.join(trace_dir, n))
        if volumes[-1] and size + bytes_ > limit:
            volumes.append([])
            size = 0
        volumes[-1].append(n)
        size += bytes_
    stem, ext = os.path.splitext(dest)
    for i, volume in enumerate(volumes):
        with tarfile.open(dest if i == 0 else f"{stem}_{i + 1}{ext}", "w") as tar:
            for n in volume:
                tar.add(os.path.join(trace_dir, n), arcname=n)
    return names


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", ""),
                    help="where the JSON, the log and the traces go (default $OUT; else none kept)")
    ap.add_argument("--parts", default="env,main,serving,train",
                    help="comma-separated subset of env,main,serving,train and the optional "
                         "h100 (stage 1 on one GPU after a short SFT on tool traces, sized by the memory "
                         "plan; about 6.5 min on an H100), ckpt (what a save of the 1.7B state adds to a step: "
                         "the copy behind the next rollouts or in the loop, pinned or pageable, ~2.5 min; an arm runs where its predicted seconds fit), lora (stage 1 of "
                         "the 8B shape with LoRA rank 16 on the preset's random weights, sized by the memory "
                         "plan; ~3 min predicted), "
                         "blocking (the first serving preset with each --blockings spec), "
                         "kernels (the paged-attention kernels alone: Triton with the engine's "
                         "and the --blockings blocking, cuDNN), kernels2, gemms and decode (issue 46: "
                         "our decode kernel alone, our decode GEMMs alone against XLA's, and the engine's "
                         "decode with each attention path and sampler, its fused-GEMM arm with the gemms "
                         "part's best blocking when gemms ran first; decode also runs decode_4k, its "
                         "4K-context rows, which can be named alone) and remat (the train parts with "
                         "--remat-policy)")
    ap.add_argument("--blockings", default="8,16,8,2;4,8,4,2",
                    help="';'-separated --pallas-blocking specs of benchmarks/serving.py; repeat them "
                         "to alternate (the engine's own is 4,8,4,2, jax's defaults 8,16,8,2)")
    ap.add_argument("--serving-presets", default="",
                    help="comma-separated subset of the shape's serving presets (default: all)")
    ap.add_argument("--remat-policy", default="dots_attention,attention",
                    help="the remat parts' ModelConfig.remat_policy, comma-separated (each one's train parts)")
    ap.add_argument("--commit", default="", help="the commit measured (recorded in the output)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="the whole command's wall-clock budget (0: none): the parts run in the order "
                         "--parts lists them, each limit cut to what is left, and a part with under "
                         f"{MIN_PART_S:.0f} s left is skipped (a lent device: 10 minutes a command)")
    ap.add_argument("--h100-mem-fraction", type=float, default=0.0,
                    help="h100 and lora: XLA_PYTHON_CLIENT_MEM_FRACTION of that part's processes only (0: the "
                         "command's); 0.54 holds an H200 to an H100's 80 GB while the other parts "
                         "keep the whole card")
    ap.add_argument("--sft-steps", type=int, default=0, help="h100: SFT steps (0: the shape's)")
    ap.add_argument("--sft-lr", type=float, default=0.0, help="h100: SFT learning rate (0: the shape's)")
    ap.add_argument("--sft-batch", type=int, default=0, help="h100: SFT traces per step (0: the shape's)")
    ap.add_argument("--sft-traces", type=int, default=0, help="h100: SFT traces generated (0: the shape's)")
    ap.add_argument("--agent-model", default="", help="h100: KEY=VALUE,... ModelConfig fields of its random model "
                                                      "(e.g. num_hidden_layers=28,initializer_range=0.08)")
    ap.add_argument("--h100-rl-flags", default="", help="h100: SECTION.KEY=VALUE,... settings given to its stage-1 "
                                                        "run (e.g. serving.kv_memory_fraction=0.2); the sizes among "
                                                        "them are planned first, before its inputs and SFT: one that "
                                                        "cannot fit fails the part naming the largest that fits")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    parts = args.parts.split(",")
    # the h100 part's flags are checked before anything runs (a bad one would cost the loan its
    # inputs and SFT first): SystemExit naming it
    if args.agent_model:
        agent_model_overrides(args)
    planned_flags(args)
    scratch = tempfile.mkdtemp(prefix="gpu_check_")
    try:
        return run_parts(args, shape, parts, scratch)
    finally:  # a failure anywhere (a part, the table) still frees the disk: the models and checkpoints
        if args.out:  # (~24 GB at 1.7B) go, what is kept is under --out, so a second command has its disk
            shutil.rmtree(scratch, ignore_errors=True)


def run_parts(args, shape: Shape, parts: list[str], scratch: str) -> int:
    """``main``'s body: the listed parts in order, then the JSON, the traces and the table."""
    out_dir = args.out or scratch
    os.makedirs(out_dir, exist_ok=True)
    trace_dir = os.path.join(scratch, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # jax's default 0.75 hides 20 % of the card
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if args.shape == "tiny":
        env.setdefault("JAX_PLATFORMS", "cpu")
        # one device, as a one-GPU machine (no simulated devices), and XLA's backend optimizations
        # off: the tiny shape checks the plumbing, not speed, and compiling is most of its time (a
        # tiny train step: 53 s -> 16 s on a loaded 2-core CPU, 2026-11-28)
        env["XLA_FLAGS"] = TINY_XLA_FLAGS
    # the kernels' parts as before: their interpreter runs the kernels' loops, which may run slower unoptimized
    kernel_env = {k: v for k, v in env.items() if not (k == "XLA_FLAGS" and v == TINY_XLA_FLAGS)}
    plan = [("env", lambda log: part_env(shape, args, log, env))]
    plan.append(("main", lambda log: part_main(shape, args, log, env, scratch, allows_unconfined(results))))
    plan.append(("h100", lambda log: part_agent(shape, args, log, env, scratch, allows_unconfined(results))))
    plan.append(("ckpt", lambda log: part_ckpt(shape, args, log, env, scratch)))
    plan.append(("lora", lambda log: part_lora(shape, args, log, env, scratch, allows_unconfined(results))))
    for preset in (args.serving_presets.split(",") if args.serving_presets else shape.serving_presets):
        name = f"serving_{preset}"
        plan.append((name, lambda log, p=preset, n=name: part_serving(shape, p, n, log, env, trace_dir)))
    for b in shape.train_batches:
        seq = f"{shape.train_seq // 1024}k" if shape.train_seq % 1024 == 0 else str(shape.train_seq)
        name = f"train_{b}x{seq}"
        plan.append((name, lambda log, b=b, n=name: part_train(shape, b, n, log, env, trace_dir)))
    specs = [spec for spec in args.blockings.split(";") if spec]
    for i, spec in enumerate(specs):  # a spec given again (alternating runs) gets its own part
        name = f"blocking_{spec.replace(',', '-')}" + (f"_{specs[:i].count(spec) + 1}" if spec in specs[:i] else "")
        plan.append((name, lambda log, sp=spec, n=name: part_serving(
            shape, shape.serving_presets[0], n, log, env, os.path.join(trace_dir, n), blocking=sp)))
    plan.append(("kernels", lambda log: part_kernels(shape, args, log, kernel_env)))
    plan.append(("kernels2", lambda log: part_kernels2(shape, args, log, kernel_env)))
    plan.append(("gemms", lambda log: part_gemms(shape, args, log, kernel_env)))

    def measured_gemm_blocking() -> str:
        """The gemms part's best blocking when it ran before, else the engine's own."""
        gemms = results.get("gemms")
        return (gemms.result.get("best") or {}).get("best_gemm_blocking", "") if gemms else ""
    plan.append(("decode", lambda log: part_decode(shape, args, log, kernel_env, trace_dir,
                                                   gemm_blocking=measured_gemm_blocking(),
                                                   results=results)))
    plan.append(("decode_4k", lambda log: part_decode(shape, args, log, kernel_env, trace_dir,
                                                      name="decode_4k",
                                                      gemm_blocking=measured_gemm_blocking(),
                                                      results=results)))
    for policy in args.remat_policy.split(","):
        for b in shape.train_batches:
            name = f"remat_{policy}_{b}x"
            plan.append((name, lambda log, b=b, n=name, p=policy: part_train(
                shape, b, n, log, env, os.path.join(trace_dir, n), remat=p)))
    # the order of --parts is the order they run in (with --budget-s, their priority); env first
    order = ["env"] + [p for p in parts if p != "env"]
    # a part is picked by its name or its family's (the name up to "_": "decode" runs decode_4k too)
    def listed(name: str) -> str | None:
        return name if name in order else name.split("_")[0] if name.split("_")[0] in order else None

    plan = sorted((e for e in plan if listed(e[0])), key=lambda e: order.index(listed(e[0])))
    results: dict[str, PartResult] = {}
    if args.budget_s:
        BUDGET.deadline = time.perf_counter() + args.budget_s
    with open(os.path.join(out_dir, "gpu_check.log"), "a") as log:
        for name, fn in plan:
            if BUDGET.left() < MIN_PART_S:
                results[name] = PartResult(name, False, 0.0, {}, f"skipped: {max(0, BUDGET.left()):.0f} s of "
                                           f"--budget-s {args.budget_s:.0f} left", skipped=True)
                print(json.dumps({"part": name, **dataclasses.asdict(results[name])}), flush=True)
                continue
            t0 = time.perf_counter()
            try:
                res = PartResult(name, True, 0.0, fn(log))
            except Exception as exc:  # noqa: BLE001  (a part's failure is reported; the others run)
                res = PartResult(name, False, 0.0, getattr(exc, "result", {}), f"{type(exc).__name__}: {exc}")
            res.seconds = round(time.perf_counter() - t0, 1)
            results[name] = res
            print(json.dumps({"part": name, **dataclasses.asdict(res)}), flush=True)
            if name == "env" and not res.ok:
                break  # no device: nothing else can run
            if name == "env":
                args.device_kind = res.result.get("device_kind", "")
    try:
        names = pack_traces(trace_dir, os.path.join(out_dir, "traces.tar"))
    except OSError as exc:  # the results matter more than the traces
        names = [f"not packed: {exc}"]
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump({"shape": args.shape, "traces": names,
                   "parts": {k: dataclasses.asdict(v) for k, v in results.items()}}, f, indent=1)
    print_table(summary_rows(results))
    return 0 if all(r.ok or r.skipped for r in results.values()) else 1  # a part the budget skipped is in the table


if __name__ == "__main__":
    sys.exit(main())
