"""The embedded demo, CI-sized (configs/demo.py:ci): every stage runs for real (SFT, agent-loop
eval with the sandbox and verifier, GRPO-RoC, export, plots) and the summary is consistent."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
from conftest import host_devices_env

ROOT = pathlib.Path(__file__).parents[1]
CONFIG = ROOT / "configs" / "demo.py"


def _config(arg):
    spec = importlib.util.spec_from_file_location("demo_config", CONFIG)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def _flat(c, prefix=""):
    out = {}
    for k, v in c.items():
        if hasattr(v, "items"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# what the CI-sized variants may change: sizes, and the batch filter (a 4-step SFT policy solves
# nothing, so every group would be all-wrong and rejected)
CI_KEYS = {"demo.num_sft_problems", "demo.num_rl_problems", "demo.num_eval_problems", "sft.batch_size",
           "total_steps", "rl.prompts_per_step", "demo.num_slots", "rl.reject_equal_reward"}


def test_config_variants():
    full, ci = _config(None), _config("ci")
    assert full.demo.num_eval_problems >= 200  # the README's claim is measured on >= 200 problems
    assert full.rl.oversample == 2 * full.rl.group_size  # RoC samples 2G, keeps G
    assert ci.total_steps < full.total_steps
    with pytest.raises(ValueError):
        _config("bogus")
    assert not dict(full.demo.recover_fraction)  # the default demo has no recovery traces
    # :compare is the default demo with its own task mix (two kinds, recovery traces, no in-head
    # guesses), the paper's temperature, more RL steps and the lengths a recovery needs
    compare, compare_ci = _config("compare"), _config("compare_ci")
    flat_full, flat_compare = _flat(full), _flat(compare)
    diff = {k for k in flat_full.keys() | flat_compare.keys() if flat_full.get(k, None) != flat_compare.get(k, None)}
    assert diff == {"mode", "demo.task_kinds", "demo.in_head_fraction.count_divisible",
                    "demo.in_head_fraction.count_divisible_large", "demo.num_eval_problems",
                    "demo.recover_fraction.count_divisible", "demo.recover_fraction.modpow", "demo.export_hf",
                    "rl.temperature", "demo.num_sft_problems", "rl.max_response_len", "sft.seq_len"}
    assert compare.mode == "demo_compare" and compare.rl.roc
    assert not dict(compare.demo.in_head_fraction)
    # the CI-sized variants differ from their full ones only in sizes
    for small, big in ((ci, full), (compare_ci, compare)):
        assert {k for k, v in _flat(small).items() if _flat(big)[k] != v} <= CI_KEYS


def test_one_seed_reseeds_everything_the_sft_batch_order_included():
    """``--config.seed=N`` re-seeds the SFT stage too (it stayed at sft.seed 0 before); an
    explicit ``--config.sft.seed`` still sets the SFT stage alone. The same in configs/sft.py."""
    from rstarjax.recipes.config import parse

    for arg in (None, "ci", "compare"):
        c = _config(arg)
        c.seed = 3
        run = parse(c)
        assert (run.seed, run.sft.seed) == (3, 3), arg
    c = _config(None)
    c.sft.seed, c.seed = 5, 3
    run = parse(c)
    assert (run.seed, run.sft.seed) == (3, 5)
    spec = importlib.util.spec_from_file_location("sft_config", ROOT / "configs" / "sft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    c.seed = 7
    assert c.sft.seed == 7


def test_sft_rows_hold_the_longest_trace():
    """sft.seq_len is tight (attention is quadratic in it): every generated trace must fit, or SFT
    would silently drop a whole kind's longest traces."""
    from rstarjax.models.chat_template import chat_format
    from rstarjax.recipes import build, demo_tasks
    from rstarjax.recipes import sft as sft_lib
    from rstarjax.recipes.config import parse

    for arg in (None, "compare"):
        c = _config(arg)
        tok = build.tokenizer(parse(c).model)
        fmt = chat_format(c.sft.chat_format)
        # the longest trace of every kind: fixed digit counts make every trace of a layout equally long
        tasks = [t for k in demo_tasks.ALL_KINDS for t in demo_tasks.generate_tasks(2, "train", seed=0, kinds=(k,))]
        traces = demo_tasks.make_sft_traces(tasks)
        if dict(c.demo.recover_fraction):
            kinds = {k for k, p in dict(c.demo.recover_fraction).items() if p > 0}
            from rstarjax.env import CodeExecutor
            with CodeExecutor(num_workers=1).start() as ex:
                traces += demo_tasks.make_sft_traces([t for t in tasks if t.kind in kinds],
                                                     recover_fraction={k: 1.0 for k in kinds},
                                                     error_runner=demo_tasks.sandbox_error_runner(ex))
        examples, stats = sft_lib.encode_examples(tok, traces, c.sft.seq_len, fmt)
        assert stats["too_long"] == 0, (arg, stats)
        prompt_budget = c.rl.max_prompt_len + c.rl.max_response_len
        assert max(len(e.ids) for e in examples) <= prompt_budget


@pytest.mark.slow
def test_demo_ci_end_to_end(demo_ci_run):
    """The README's main command at CI size (configs/demo.py:ci), run once by conftest.demo_ci_run
    (through the quickstart notebook when the test extra is installed): what it wrote."""
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.demo import run_demo

    tmp_path, _ = demo_ci_run
    c = _config("ci")
    on_disk = json.loads((tmp_path / "demo_summary.json").read_text())
    assert on_disk["num_eval_problems"] == c.demo.num_eval_problems
    assert on_disk["rl_steps"] == c.total_steps
    # the accuracies are what the held-out samples say
    rows = [json.loads(l) for l in (tmp_path / "heldout_samples.jsonl").read_text().splitlines()]
    assert len(rows) == c.demo.num_eval_problems
    assert on_disk["sft_accuracy"] == pytest.approx(sum(r["sft"]["reward"] > 0 for r in rows) / len(rows))
    assert on_disk["rl_accuracy"] == pytest.approx(sum(r["rl"]["reward"] > 0 for r in rows) / len(rows))
    # per-kind figures: each kind's accuracy is what its held-out samples say
    from rstarjax.recipes.demo_tasks import kind_of
    for phase in ("sft", "rl"):
        for kind, acc in on_disk[phase]["accuracy_by_kind"].items():
            mine = [r[phase]["reward"] > 0 for r in rows if kind_of(r["problem"]) == kind]
            assert acc == pytest.approx(sum(mine) / len(mine), abs=1e-4)
        # the overall tool-call rate is its kinds' rates weighted by their held-out counts
        counts = {k: sum(kind_of(r["problem"]) == k for r in rows) for k in on_disk[phase]["tool_call_rate_by_kind"]}
        assert sum(counts.values()) == len(rows)
        assert on_disk[phase]["tool_call_rate"] == pytest.approx(
            sum(on_disk[phase]["tool_call_rate_by_kind"][k] * n for k, n in counts.items()) / len(rows), abs=2e-4)
    # held-out problems never appear in the SFT or RL training data
    train = {json.loads(l)["problem"] for l in (tmp_path / "rl_train.jsonl").read_text().splitlines()}
    sft = {json.loads(l)["messages"][0]["content"] for l in (tmp_path / "sft_traces.jsonl").read_text().splitlines()}
    assert not ({r["problem"] for r in rows} & (train | sft))
    assert (tmp_path / "hf" / "config.json").exists()
    assert (tmp_path / "plots" / "reward.png").exists() and (tmp_path / "plots" / "sft_loss.png").exists()
    # rollouts sample at rl.temperature (0.7 in configs/demo.py): the trainer's log-probs are of
    # that distribution too, so the sampler/trainer gap stays float noise at every step (one
    # side alone tempered would put it near a nat)
    metrics = [json.loads(l) for l in (tmp_path / "rl" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == c.total_steps
    assert all(m["train/logprob_gap_max"] < 1e-3 for m in metrics), [m["train/logprob_gap_max"] for m in metrics]
    c.mesh.fsdp, c.mesh.data = 1, -1  # this process has conftest's 8 simulated devices
    with pytest.raises(FileExistsError):
        run_demo(parse(c), str(tmp_path))
    import hashlib
    prov = on_disk["provenance"]
    assert prov["config_sha256"] == hashlib.sha256((tmp_path / "config.json").read_bytes()).hexdigest()
    assert prov["seeds"] == {"seed": c.seed, "sft_seed": c.sft.seed}
    assert set(prov["versions"]) >= {"jax", "flax", "optax"}


@pytest.mark.slow
def test_compare_ci_end_to_end(tmp_path):
    """configs/demo.py:compare at CI size: one SFT, both arms, comparison.json with every key the
    README's figures come from, and its provenance."""
    import hashlib

    from rstarjax.main import RECIPES
    from rstarjax.recipes.config import parse

    # the README's command in its own process: the host's devices and XLA's default optimisation
    # level (in this process, at conftest's level 0, the run took 288 s instead of 162 s)
    r = subprocess.run([sys.executable, "-m", "rstarjax.main", f"--config={ROOT / 'configs' / 'demo.py'}:compare_ci",
                        f"--workdir={tmp_path}"], env=host_devices_env(), capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-5000:]
    c = _config("compare_ci")
    c.mesh.fsdp = 1
    c.mesh.data = -1
    on_disk = json.loads((tmp_path / "comparison.json").read_text())
    # the three claims (Fig. 4 / Fig. 9), decided from the arms' own figures
    roc, grpo = on_disk["roc"], on_disk["grpo"]
    g = grpo["tool_error_ratio_positive_last"]
    assert on_disk["targets"] == {
        "tool_error_ratio_positive_at_most_half_of_grpo":
            (roc["tool_error_ratio_positive_last"] <= g / 2) if g > 0 else None,
        "heldout_accuracy_not_lower_by_more_than_2_points": roc["heldout_accuracy"] >= grpo["heldout_accuracy"] - 0.02,
        "response_length_shorter": roc["response_length_last"] < grpo["response_length_last"]}
    for arm in ("roc", "grpo"):
        a = on_disk[arm]
        for key in ("tool_error_ratio_positive_last", "heldout_accuracy", "response_length_last", "turns_last",
                    "wall_seconds", "positives_with_tool_error_sampled_first"):
            assert key in a, (arm, key)
        assert 0.0 <= a["heldout_accuracy"] <= 1.0 and a["wall_seconds"] > 0
        assert a["steps"] == c.total_steps
        assert len(a["curves"]["step"]) == len(a["curves"]["tool_error_ratio_positive"]) == c.total_steps
        metrics = [json.loads(l) for l in (tmp_path / f"rl_{arm}" / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert a["curves"]["reward_mean"] == [m["rollout_all/reward_mean"] for m in metrics]
        assert a["response_length_last"] == pytest.approx(
            sum(m["rollout_all/response_length_mean"] for m in metrics[-3:]) / len(metrics[-3:]))
    # plain GRPO samples G rollouts per prompt, GRPO-RoC 2G, from the same prompts
    roc_m, grpo_m = ([json.loads(l) for l in (tmp_path / f"rl_{a}" / "logs" / "metrics.jsonl").read_text().splitlines()]
                     for a in ("roc", "grpo"))
    assert roc_m[0]["roc/kept_fraction"] == pytest.approx(0.5) and grpo_m[0]["roc/kept_fraction"] == 1.0
    prov = on_disk["provenance"]
    config_text = (tmp_path / "config.json").read_text()
    assert prov["config_sha256"] == hashlib.sha256(config_text.encode()).hexdigest()
    assert json.loads(config_text)["demo"]["recover_fraction"] == dict(c.demo.recover_fraction)
    assert prov["seeds"]["seed"] == c.seed
    import flax, jax, optax  # noqa: E401
    assert prov["versions"]["jax"] == jax.__version__ and prov["versions"]["flax"] == flax.__version__
    assert prov["versions"]["optax"] == optax.__version__
    assert any(p.endswith("compare_tool_error_ratio_positive.png") for p in on_disk["plots"])
    # the SFT data holds recovery traces whose first tool call failed in the sandbox
    sft = [json.loads(l)["messages"] for l in (tmp_path / "sft_traces.jsonl").read_text().splitlines()]
    assert any(len(m) == 6 and "Error" in m[2]["content"] for m in sft)
    with pytest.raises(FileExistsError):
        RECIPES[c.mode](parse(c), str(tmp_path))


@pytest.mark.slow
def test_sft_checkpoint_starts_from_an_earlier_runs_sft(demo_ci_run, tmp_path):
    """demo.sft_checkpoint: the policy holds the earlier run's SFT params (not a fresh init) and no
    SFT runs; an RL checkpoint or a missing directory is refused by name."""
    import jax
    import numpy as np
    from flax import nnx

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import demo
    from rstarjax.recipes.config import ConfigError, parse

    earlier, _ = demo_ci_run
    c = _config("ci")
    c.mesh.fsdp, c.mesh.data = 1, -1
    c.demo.sft_checkpoint = str(earlier / "sft" / "checkpoints")
    run = parse(c)
    setup = demo.prepare(run, str(tmp_path / "again"), "demo_summary.json")
    policy, summary = demo.train_sft_policy(run, setup, str(tmp_path / "again"))
    assert summary["seconds"] == 0.0 and not (tmp_path / "again" / "sft").exists()  # no SFT ran
    _, params, _ = nnx.split(policy, nnx.Param, ...)
    saved, _, _ = ckpt_lib.restore_params(c.demo.sft_checkpoint, ckpt_lib.abstract_like(params))
    fresh = nnx.split(demo.demo_policy(run, setup.tokenizer, setup.mesh), nnx.Param, ...)[1]
    leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(leaves(params), leaves(saved), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(params), leaves(fresh), strict=True))
    # the RL arm's checkpoints of that run are no SFT checkpoint
    c.demo.sft_checkpoint = str(earlier / "rl" / "checkpoints")
    with pytest.raises(ValueError, match="not an SFT checkpoint"):
        demo.train_sft_policy(parse(c), setup, str(tmp_path / "third"))
    c.demo.sft_checkpoint = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="demo.sft_checkpoint"):
        parse(c)


def test_the_harder_tier_is_counting_whose_numbers_vary_in_width():
    """demo_tasks.HARD_KINDS (in configs/demo.py): answers against a brute-force count, N of 5 or 6
    digits and divisors of 2 or 3 digits, every combination drawn (so no copy has a fixed offset;
    tests/test_demo_tasks.py), its own wording (kind_of tells it from the base kind), and the
    in-head coin applies to it."""
    import re

    from rstarjax.recipes import demo_tasks as dt

    assert dt.HARD_KINDS == ("count_divisible_large",) and set(_config(None).demo.task_kinds) == set(dt.ALL_KINDS)
    tasks = dt.generate_tasks(60, "train", seed=5, kinds=dt.HARD_KINDS) + dt.generate_tasks(20, "test", seed=5,
                                                                                             kinds=dt.HARD_KINDS)
    widths = set()
    for t in tasks:
        _, n, a, b = (int(x) for x in re.findall(r"\d+", t.problem))
        assert 10000 <= n < 200000 and 11 <= a <= 400 and 11 <= b <= 400 and a % b and b % a
        widths.add((len(str(n)), len(str(a)), len(str(b))))
    assert widths == {(wn, wa, wb) for wn in (5, 6) for wa in (2, 3) for wb in (2, 3)}
    for t in tasks[:10]:
        _, n, a, b = (int(x) for x in re.findall(r"\d+", t.problem))
        assert int(t.answer) == sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0)
    assert all(dt.kind_of(t.problem) == "count_divisible_large" for t in tasks)
    assert dt.kind_of(dt.generate_tasks(1, seed=5, kinds=("count_divisible",))[0].problem) == "count_divisible"
    traces = dt.make_sft_traces(tasks[:60], in_head_fraction={"count_divisible_large": 0.6}, seed=5)
    assert 20 <= sum(len(m) == 2 for m in traces) <= 50


def test_seed_tables_are_mean_and_range_over_runs():
    """The README's demo figures are means and ranges over fresh seeds: recipes.demo.seed_table
    and demo_compare.seed_table against figures worked by hand; mixed configs are refused."""
    from rstarjax.recipes import demo, demo_compare

    def summary(seed, sft, rl, kinds):
        return {"seed": seed, "sft_accuracy": sft, "rl_accuracy": rl, "num_eval_problems": 8,
                "sft": {"accuracy_by_kind": kinds[0], "tool_call_rate": 0.5},
                "rl": {"accuracy_by_kind": kinds[1], "tool_call_rate": 1.0}}

    runs = [summary(11, 0.5, 0.75, ({"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 0.5})),
            summary(12, 0.25, 0.875, ({"a": 0.5, "b": 0.0}, {"a": 1.0, "b": 0.75}))]
    t = demo.seed_table(runs)
    assert t["seeds"] == [11, 12]
    assert t["sft_accuracy"] == {"mean": 0.375, "min": 0.25, "max": 0.5}
    assert t["gain_points"] == pytest.approx({"mean": 43.75, "min": 25.0, "max": 62.5})  # 75-50, 87.5-25 points
    assert t["by_kind"]["b"]["rl"] == {"mean": 0.625, "min": 0.5, "max": 0.75}
    assert t["by_kind"]["a"]["sft"]["min"] == 0.5 and t["tool_call_rate"]["rl"]["mean"] == 1.0
    with pytest.raises(ValueError, match="other kinds"):
        demo.seed_table(runs + [summary(13, 0.5, 0.5, ({"a": 1.0}, {"a": 1.0}))])

    def comparison(seed, roc_ratio, grpo_ratio, met):
        arm = lambda r: {k: r for k in demo_compare.COMPARED}  # noqa: E731
        return {"provenance": {"seeds": {"seed": seed}}, "sft": {"heldout_accuracy": 1.0}, "roc": arm(roc_ratio),
                "grpo": arm(grpo_ratio), "targets": {"x": met, "y": None}}

    c = demo_compare.seed_table([comparison(11, 0.1, 0.3, True), comparison(12, 0.2, 0.3, False)])
    assert c["arms"]["roc"]["tool_error_ratio_positive_last"] == pytest.approx({"mean": 0.15, "min": 0.1, "max": 0.2})
    assert c["arms"]["grpo"]["heldout_accuracy"]["mean"] == pytest.approx(0.3)
    assert c["targets_met"] == {"x": 1, "y": 0} and c["runs"] == 2 and c["seeds"] == [11, 12]
