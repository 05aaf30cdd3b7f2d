"""An RL stage says what it does (issue 47): one line as it starts (fresh, or resumed from step N
of which checkpoint, and which newer ones were skipped), and with the progress bar off one line
per step with its key figures."""
import json
import os
import re
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_batch_filter import REWARDS, run_config, scripted  # noqa: E402

from rstarjax.models import sharding as sharding_lib  # noqa: E402
from rstarjax.recipes import build  # noqa: E402
from rstarjax.recipes.config import parse  # noqa: E402
from rstarjax.recipes.rl import run_rl  # noqa: E402


def _lines(out):
    return [line for line in out.splitlines() if line.startswith("rstarjax: ")]


@pytest.mark.slow  # two run_rl calls, each compiling its step
def test_a_stage_says_fresh_or_resumed_and_one_line_per_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "train.jsonl"), "w") as f:  # every batch {2, 3}: mixed groups, trained
        f.write("".join(json.dumps({"problem": f"problem {p}", "answer": str(p)}) + "\n" for p in (2, 3) * 8))
    fn = scripted(REWARDS.get)
    c = run_config(workdir, 2)
    c.checkpoint.every_steps = 1
    run_rl(parse(c), workdir, rollout_fn=fn)
    lines = _lines(capsys.readouterr().out)
    assert lines[0] == "rstarjax: rl stage fresh at step 0 from tiny with random weights (seed 0); training to " \
                       "total_steps=2"
    assert len(lines) == 3
    for n, line in enumerate(lines[1:], start=1):
        assert re.fullmatch(rf"rstarjax: step {n}/2 reward=0\.500 accuracy=0\.500 length=\d+ groups=2 "
                            r"loss=\S+ grad_norm=\S+ seconds=\d+\.\d", line), line

    # the newest checkpoint damaged (its meta cut short): the stage resumes from the one before and says so
    ckpts = os.path.join(workdir, "checkpoints")
    with open(os.path.join(ckpts, "2", "meta", "metadata"), "r+") as f:
        f.truncate(5)
    run_rl(parse(run_config(workdir, 3)), workdir, rollout_fn=fn)
    lines = _lines(capsys.readouterr().out)
    assert lines[0] == (f"rstarjax: rl stage resumed from step 1 ({os.path.join(ckpts, '1')}); skipped the newer "
                        "checkpoint of step 2, which did not restore (the warning above says why); training to "
                        "total_steps=3")
    assert [line.split()[2] for line in lines[1:]] == ["2/3", "3/3"]


def test_a_stage_from_a_given_policy_names_it_not_the_presets_random_weights(tmp_path):
    """The demo hands RL its SFT policy: the start line names that checkpoint, not the preset's
    random initialisation that the config (``model.random_init``) describes."""
    from rstarjax.recipes.rl import given_policy_origin, start_line

    (tmp_path / "train.jsonl").write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
    run = parse(run_config(str(tmp_path), 2))
    sft = {"source": "checkpoint", "path": "/runs/demo/sft/checkpoints", "step": 4}
    assert start_line(run, {}, None, 0, given_policy_origin(sft)) == (
        "rstarjax: rl stage fresh at step 0 from the given policy (step 4 of /runs/demo/sft/checkpoints); "
        "training to total_steps=2")
    assert "from the given policy;" in start_line(run, {}, None, 0, given_policy_origin(None))
    assert "from tiny with random weights (seed 0);" in start_line(run, {}, None, 0)
