"""Valid configs that likely do not mean what they say: ``recipes.config.run_warnings``, logged
once at the start of a run (``parse``) and by ``check_config``, never refused."""
import dataclasses
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from tiny_run import tiny_rl_config  # noqa: E402

from rstarjax import check_config  # noqa: E402
from rstarjax.recipes.config import parse, truncated_sampling_warning  # noqa: E402

LOGGER = "rstarjax.recipes.config"


@pytest.fixture
def problems(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    return path


def tiny(problems, **changes):
    return tiny_rl_config(problems, 1, **{"trainer.micro_batch_size": 0, **changes})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


def test_rl_top_p_or_top_k_is_accepted_with_a_warning_naming_flags_and_consequence(problems, caplog):
    """The sampler draws from the truncated distribution while both sides' log-probs are the
    untruncated ones (verl's choice): the importance ratio ignores the truncation. Said at the
    start, with the flags and the bound, not refused."""
    with caplog.at_level("WARNING", logger=LOGGER):
        run = parse(tiny(problems, **{"rl.top_p": 0.9}))
    [warning] = _warnings(caplog)
    assert warning == truncated_sampling_warning(run)
    assert warning.startswith("--config.rl.top_p=0.9: ") and "importance ratio ignores the truncation" in warning
    assert "-log(top_p) = 0.105 nats" in warning and "--config.rl.top_p=1.0" in warning

    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):
        run = parse(tiny(problems, **{"rl.top_p": 0.95, "rl.top_k": 20}))
    [warning] = _warnings(caplog)
    assert warning.startswith("--config.rl.top_p=0.95 and --config.rl.top_k=20: ") and "unbounded" in warning

    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):  # the defaults: the distribution sampled is trained
        run = parse(tiny(problems))
    assert run.rl.top_p == 1.0 and run.rl.top_k <= 0 and not _warnings(caplog)
    # a stage that trains nothing (the stage-3 filter samples with the rl section) is not warned
    filtering = dataclasses.replace(run, mode="filter", rl=dataclasses.replace(run.rl, top_p=0.9))
    assert truncated_sampling_warning(filtering) is None


def test_check_config_says_the_warning_once(problems, caplog, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["--config=configs/base.py", "--config.model.preset=tiny", "--config.model.random_init=True",
            f"--config.data.train_path={problems}", "--config.mesh.fsdp=1", "--config.rl.top_k=20"]
    with caplog.at_level("WARNING", logger=LOGGER):
        run = check_config.check(argv, 1)
    assert run.rl.top_k == 20
    [warning] = _warnings(caplog)
    assert warning.startswith("--config.rl.top_k=20: ")
