"""docs/launch.md "Evaluating the released rStar2-Agent checkpoint" (issue #50): configs/eval.py with
--config.profile=rstar2_official, run at a tiny size (a random tiny model saved as an HF checkpoint,
AIME24/AIME25 files in their published layouts), overriding only model, data and sizes, as the
command line would (those keys are explicit, so the profile keeps its hands off them)."""
import json
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("pylatexenc")  # the official reward's PRIME grader

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.slow
def test_the_released_checkpoint_command_runs_at_a_tiny_size(tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    from rstarjax.env.official_reward import official_score
    from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf
    from rstarjax.recipes import evaluate as ev
    from rstarjax.recipes.config import parse

    sys.path.insert(0, str(ROOT / "configs"))
    import eval as eval_config

    tok = load_tokenizer(1000)
    cfg = ModelConfig.preset("tiny", vocab_size=tok.num_tokens, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    save_hf(Qwen3(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "hf"), tokenizer=tok)
    aime24 = tmp_path / "aime24.jsonl"  # HuggingFaceH4/aime_2024's fields
    aime24.write_text("\n".join(json.dumps({"id": i, "problem": f"Compute {i} + {i}.", "solution": "-",
                                            "answer": str(2 * i)}) for i in range(2)) + "\n")
    aime25 = tmp_path / "aime25.jsonl"  # opencompass/AIME2025's fields
    aime25.write_text(json.dumps({"question": "Compute 3 * 3.", "answer": "9"}) + "\n")

    c = eval_config.get_config()
    c.profile = "rstar2_official"  # --config.profile=rstar2_official
    c.model.hf_path = str(tmp_path / "hf")  # --config.model.hf_path=...
    c.eval.paths = f"{aime24},{aime25}"  # --config.eval.paths=aime24.jsonl,aime25.jsonl
    # the tiny size (model, data and sizes only)
    sizes = {"model.dtype": "float32", "model.tokenizer_num_regular_tokens": 1000, "eval.k": 2,
             "eval.max_response_len": 24, "eval.num_slots": 4, "rl.num_tool_workers": 1, "mesh.fsdp": -1}
    for key, value in sizes.items():
        section, name = key.split(".")
        c[section][name] = value
    run = parse(c, explicit=frozenset(sizes) | {"model.hf_path", "eval.paths"})
    assert (run.eval.chat_format, run.eval.temperature, run.eval.max_turns, run.eval_agent().reward_mode) == (
        "rstar2_official", 0.0, 5, "official")
    out = ev.run_eval(run, str(tmp_path / "run"))
    assert list(out) == ["aime24", "aime25"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["samples"]) == 2 for r in rows)
    samples = [s for r in rows for s in r["samples"]]
    assert all(s["response_length"] <= 24 for s in samples)
    assert np.mean([s["reward"] for r in rows if r["dataset"] == "aime24" for s in r["samples"]]) == \
        pytest.approx(out["aime24"]["pass@1"])
    # the official reward on the whole response (a random model answers nothing)
    for r in rows:
        for s in r["samples"]:
            assert s["reward"] == float(official_score(s["response"], r["gold"]))
