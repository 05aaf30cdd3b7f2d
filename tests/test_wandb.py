"""Weights & Biases logging (``--config.logging.wandb=True``), an optional extra:

* the base install never imports wandb, and asking for it without the package fails at start with
  the install command;
* offline (``WANDB_MODE=offline``, no network), an RL stage logs to W&B exactly the scalars it
  writes to TensorBoard and metrics.jsonl, step by step, with the project, name, tags and the
  run's typed config. Both logs are read back from their files (the W&B run's ``.wandb``
  record log, TensorBoard's event file), not from the writer's own state.
"""
import glob
import importlib.util
import json
import re
import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

HAS_WANDB = importlib.util.find_spec("wandb") is not None


def _problems(tmp_path) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n')
    return str(path)


def test_the_base_install_never_imports_wandb(tmp_path):
    code = ("import sys; sys.path.insert(0, 'configs'); import base\n"
            "import rstarjax.main, rstarjax.recipes.rl, rstarjax.recipes.sft, rstarjax.io.metrics_log\n"
            "from rstarjax.recipes.config import parse\n"
            f"c = base.get_config(); c.model.random_init = True; c.data.train_path = {_problems(tmp_path)!r}\n"
            "parse(c, num_devices=1)\n"
            "print('wandb' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_wandb_without_the_package_fails_at_start_with_the_install_command(monkeypatch, tmp_path):
    import base

    from rstarjax.recipes.config import parse
    from rstarjax.validation import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    c = base.get_config()
    c.model.random_init = True
    c.data.train_path = _problems(tmp_path)
    parse(c)  # off by default: no wandb needed
    c.logging.wandb = True
    with pytest.raises(ConfigError, match=r'--config\.logging\.wandb=True needs the wandb package: '
                                          r'pip install -e "\.\[wandb\]"'):
        parse(c)


# ------------------------------------------------------------------ reading the logs back from disk
def wandb_records(path):
    """The protobuf records of a W&B run file (``run-ID.wandb``: a LevelDB-style log of 32 KiB
    blocks after a 7-byte header; each chunk has a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # FIRST, MIDDLE
            pending = (pending if kind == 3 else b"") + chunk


def read_wandb_run(run_dir):
    """(run record, {step: {key: value}}) of an offline W&B run directory, once the process that
    wrote it has called ``wandb.teardown()``: W&B's service process writes the run file, and may
    still hold its last records when ``finish()`` has returned (a CI run read a resumed run's
    file with none of its steps)."""
    [path] = glob.glob(os.path.join(run_dir, "*.wandb"))
    run, history = None, {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[int(row.pop("_step"))] = {k: v for k, v in row.items() if not k.startswith("_")}
    return run, history


def read_tensorboard(tb_dir):
    """{step: {tag: value}} of TensorBoard's event files (TFRecord: u64 length, u32 crc, data, u32 crc)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(int(event.step), {})[v.tag] = v.simple_value
    return out


# Two RL steps logging to offline W&B, in a process of its own: W&B's service and its waits
# (finish, teardown: no time limits of their own) never run in the test process, and the
# subprocess's timeout bounds them.
WANDB_RUN = """
import sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import jax
import wandb
from rstarjax.models import sharding as sharding_lib
from rstarjax.recipes import build
from rstarjax.recipes.config import parse
from rstarjax.recipes.rl import run_rl
from test_checkpoint import fake_rollout_fn
from test_stages import _scripted_config

build.mesh = lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
c = _scripted_config(sys.argv[1], total_steps=2)
c.logging.tensorboard = True
c.logging.wandb = True
c.logging.wandb_project = "rstarjax-test"
c.logging.wandb_tags = "qwen3, tiny"
run_rl(parse(c), sys.argv[1], rollout_fn=fake_rollout_fn)
wandb.teardown()  # the service has closed the run file
"""


@pytest.mark.skipif(not HAS_WANDB, reason='the optional wandb extra is not installed (pip install -e ".[wandb]")')
def test_offline_wandb_logs_what_tensorboard_logs_plus_the_config(tmp_path):
    from process_support import worker_env

    from rstarjax.io.metrics_log import read_metrics

    env = worker_env(1, WANDB_MODE="offline", **{var: str(tmp_path / "wandb_home" / sub) for var, sub in (
        ("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"))})
    env.pop("WANDB_API_KEY", None)
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    workdir = str(tmp_path / "stage1-run")
    r = subprocess.run([sys.executable, "-c", WANDB_RUN, workdir, os.path.join(ROOT, "tests"), os.path.join(ROOT, "configs")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]

    logs = os.path.join(workdir, "logs")
    [run_dir] = glob.glob(os.path.join(logs, "wandb", "offline-run-*"))
    run, wandb_history = read_wandb_run(run_dir)
    tensorboard = read_tensorboard(os.path.join(logs, "tb"))
    jsonl = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "wall_time") and isinstance(v, (int, float))}
             for r in read_metrics(os.path.join(logs, "metrics.jsonl"))}

    assert sorted(wandb_history) == sorted(tensorboard) == sorted(jsonl) == [1, 2]
    for step in (1, 2):
        assert set(wandb_history[step]) == set(tensorboard[step]) == set(jsonl[step])
        assert len(wandb_history[step]) > 40  # the whole step, not a sample of it
        for key, value in jsonl[step].items():
            assert wandb_history[step][key] == pytest.approx(value, rel=1e-6), key
            assert tensorboard[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert {"rollout/reward_mean", "train/entropy", "train/clip_frac_high", "time/step"} <= set(wandb_history[1])

    assert run.project == "rstarjax-test" and run.display_name == "stage1-run"
    assert list(run.tags) == ["rl", "qwen3", "tiny"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["rl"]["group_size"] == 2 and config["total_steps"] == 2 and config["mode"] == "rl"
    assert config["logging"]["wandb"] is True and config["workdir"] == os.path.abspath(workdir)


# ------------------------------------------------------------------ docs/metrics.md covers every key
NAMESPACES = ("rollout", "rollout_all", "roc", "filter", "dynamic_sampling", "train", "time", "perf", "timing", "sft")
KEY_LITERAL = re.compile(r"""["']((?:%s)/[a-z0-9_]+)["']""" % "|".join(NAMESPACES))


def logged_keys() -> set[str]:
    """Every metric key the code can log: string literals of the namespaces in the package, and
    the keys the metric functions compute (every loss option on)."""
    import jax.numpy as jnp

    from rstarjax.rl import loss as loss_lib
    from rstarjax.rl import metrics as M
    from rstarjax.serving.schedule_stats import ScheduleStats, SliceStats
    from test_trainer import _traj

    keys = set()
    for path in glob.glob(os.path.join(ROOT, "rstarjax", "**", "*.py"), recursive=True):
        keys |= set(KEY_LITERAL.findall(open(path).read()))
    trajs = [_traj(1.0, 2, 1, 1, group=0), _traj(0.0, 0, 0, 0, group=0)]
    for prefix in ("rollout/", "rollout_all/"):  # as rl.step logs them
        keys |= set(M.rollout_metrics(trajs, prefix))
    keys |= set(M.group_metrics(trajs, "rollout_all/"))
    keys |= set(M.roc_metrics(trajs, trajs[:1])) | set(M.throughput_metrics(10, {"rollout": 1.0, "prepare": 1.0,
                                                                                  "train": 1.0}))
    keys |= {f"timing/rollout_{k}" for k in ScheduleStats(1.0, [SliceStats()]).as_dict()}
    x = jnp.zeros((1, 4))
    cfg = loss_lib.LossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, dual_clip_c=3.0)
    _, loss_metrics = loss_lib.policy_loss(x, x, x + 1, x + 1, 4.0, cfg, ref_logprobs=x, rollout_logprobs=x, entropy=x)
    keys |= {f"train/{k}" for k in [*loss_metrics, "loss", "grad_norm", "tokens"]}  # + the update's own three
    return keys


def test_docs_metrics_lists_every_logged_key():
    doc = open(os.path.join(ROOT, "docs", "metrics.md")).read()
    documented = set(re.findall(r"`([a-z0-9_/]+)`", doc))
    keys = logged_keys()
    assert {"rollout/reward_mean", "train/clip_frac_high", "timing/rollout_makespan_s", "time/step",
            "train/kl_ref", "sft/loss", "rollout/tool_call_rate"} <= keys  # the collection works
    missing = sorted(k for k in keys if k not in documented
                     and not (k.split("/", 1)[0] in ("rollout", "rollout_all") and k.split("/", 1)[1] in documented))
    assert not missing, f"docs/metrics.md does not describe: {missing}"


@pytest.mark.skipif(not HAS_WANDB, reason='the optional wandb extra is not installed (pip install -e ".[wandb]")')
def test_the_end_of_a_run_waits_for_wandb_within_a_limit(monkeypatch, tmp_path):
    """W&B's ``finish`` waits for its uploads without a limit by default: a run whose network
    stalls would never end. The run is started with a finish timeout."""
    import wandb

    from rstarjax.io import metrics_log

    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw))
    metrics_log._start_wandb({"project": "p"}, str(tmp_path))
    assert 0 < seen["settings"].finish_timeout <= 600 and seen["project"] == "p"
