"""A rollout mode added in one new file (tests/toy_rollout_mode.py) runs an RL stage through
``run_rl`` unchanged: the stage loop asks only the ``RolloutSource`` protocol (issue 49)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def test_a_toy_rollout_mode_in_one_file_drives_the_stage(tmp_path, monkeypatch):
    import jax

    from rstarjax.io.checkpoint import read_checkpoint_meta
    from rstarjax.models import sharding as sharding_lib
    from rstarjax.recipes import build, sources
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import run_rl

    import toy_rollout_mode
    from test_checkpoint import fake_rollout_fn, in_process_config, write_data

    monkeypatch.setattr(build, "mesh", lambda *_: sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    workdir = str(tmp_path)
    write_data(workdir, n=40)
    config = in_process_config(workdir, 3)
    prompts = [{"problem": f"toy {i}", "answer": "0"} for i in range(config.rl.prompts_per_step)]
    seen = []

    def rollout_fn(records, n, seed, version):
        seen.append([r["problem"] for r in records])
        return fake_rollout_fn(records, n, seed, version)

    built, unregister = toy_rollout_mode.register(prompts)
    try:
        trainer = run_rl(parse(config), workdir, rollout_fn=rollout_fn)
    finally:
        unregister()
    assert not sources.MODES
    (source,) = built
    assert trainer.step == 3
    # the loop drew every round from the toy source: its fixed prompts, never the data's
    assert seen and all(s == [p["problem"] for p in prompts] for s in seen)
    updates = [c for c in source.calls if c.startswith("after_update")]
    assert updates == ["after_update 1", "after_update 2", "after_update 3"]
    assert source.calls[-1] == "close" and source.calls.count("close") == 1
    assert read_checkpoint_meta(os.path.join(workdir, "checkpoints"))[0] == 3
    with open(os.path.join(workdir, "logs", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [row["toy/rounds"] for row in logged] == [1.0, 1.0, 1.0]  # the mode's own figures reach the log
