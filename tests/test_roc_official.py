"""RoC with the official code's penalties (issue #27): our ``roc.official_text_penalty`` and
``roc_select(variant="topk", penalty="official_text")`` against the official functions themselves
(tests/fixtures/rstar2_official/down_sample_roc.py: microsoft/rStar rstar2_agent/down_sample/roc.py)
run on the same hand-built trajectories."""
import random
import types

import numpy as np
import pytest

from rstarjax.rl import roc
from rstarjax.rl.selection import select_groups
from rstarjax.rl.config import RLConfig
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from fixtures.rstar2_official import down_sample_roc as official  # noqa: E402

# The official run script's down-sampling settings (examples/run_qwen3-14b_rstar2_agent_weave.sh).
OFFICIAL_CONFIG = {"roc_error_ratio": True, "roc_answer_format": True, "min_zero_reward_trace_num": 2,
                   "min_non_zero_reward_trace_num": 2, "down_sample_to_n": 16}

# Pieces of responses as the official loop writes them: model turns end with <|im_end|>, the tool
# turn follows directly and ends with "<|im_start|>assistant\n<reason>".
_TOOL_OUTPUTS = ["Tool call success\nstdout: 42\nexecution time: 0.01s",
                 "Tool call failure\nreason: RuntimeError\nstderr: NameError: name 'x' is not defined",
                 "Failed to decode tool call: Expecting value: line 1 column 1 (char 0)",
                 "Tool call success\nstdout: no ERROR here?\n", "Error when executing tool: 'foo'", ""]
_ANSWERS = ["", "<answer>\\boxed{7}</answer>", "<answer>\\boxed{7}</answer> again <answer>7</answer>",
            "<answer>\\boxed{7}", "</answer> stray", "<answer>a</answer><answer>b</answer><answer>c</answer>"]


def _response(rng: random.Random) -> str:
    turns = rng.randint(1, 5)
    text = ""
    for t in range(turns):
        text += "think " + rng.choice(["", "<reason>", "</reason>"]) + rng.choice(_ANSWERS)
        last = t == turns - 1
        if last:
            text += rng.choice(["<|im_end|>", "<|im_end|>", ""])  # "" = truncated by the budget
        else:
            text += '<tool_call>\n{"name": "python_code_with_standard_io"}\n</tool_call><|im_end|>'
            text += "<|im_start|>user"
            for _ in range(rng.choice([1, 1, 2])):
                text += "\n<tool_response>\n" + rng.choice(_TOOL_OUTPUTS) + "\n</tool_response>"
            text += "<|im_end|>\n<|im_start|>assistant\n<reason>"
    return text


def _traj(text: str, reward: float, group: int) -> Trajectory:
    return Trajectory(prompt_ids=np.array([1]), segments=[Segment(SegmentKind.MODEL, [2], [-0.1])],
                      finish=FinishReason.ANSWERED, reward=reward, group_id=group, response_text=text)


def _official_kept(texts, rewards, uids):
    """The official resample_of_correct on one batch: the indices it keeps."""
    batch = types.SimpleNamespace(non_tensor_batch={"uid": np.array(uids, dtype=object)},
                                  batch={"token_level_scores": torch.tensor(rewards, dtype=torch.float32)[:, None]})
    official.decode_prompt_response_str = lambda data, tokenizer: ([""] * len(texts), list(texts))
    official.filter_by_mask = lambda data, mask, world_size: np.flatnonzero(mask.numpy()).tolist()
    kept, _ = official.resample_of_correct(batch, None, OFFICIAL_CONFIG, do_sample=True, world_size=1)
    return kept


def test_official_penalties_match_the_official_functions():
    rng = random.Random(0)
    texts = [_response(rng) for _ in range(400)] + ["", "<answer>x</answer>", "<|im_start|>assistant<answer>1</answer><|im_end|>"]
    err, _ = official.calc_error_ratio_penalty_weights(texts)
    fmt, _ = official.calc_format_penalty_weights(texts)
    ours_err = [roc.official_error_ratio_penalty(t) for t in texts]
    ours_fmt = [roc.official_format_penalty(t) for t in texts]
    assert ours_err == err.tolist() and ours_fmt == fmt.tolist()
    assert [roc.official_text_penalty(t) for t in texts] == (err + fmt).tolist()
    assert len(set(ours_fmt)) > 3 and len(set(ours_err)) > 3  # the cases are varied


def test_topk_with_official_penalties_keeps_the_official_set():
    rng = random.Random(1)
    cfg = RLConfig(group_size=16, oversample=32, roc_variant="topk", roc_penalty="official_text",
                   reject_equal_reward=False)
    paper_cfg = RLConfig(group_size=16, oversample=32, roc_variant="topk", reject_equal_reward=False)
    num_groups, differs_with_paper_penalties = 60, 0
    trajs, texts, rewards, uids = [], [], [], []
    for g in range(num_groups):
        p_correct = rng.choice([0.05, 0.3, 0.5, 0.8, 0.97, 1.0])
        for _ in range(32):
            text, reward = _response(rng), float(rng.random() < p_correct)
            trajs.append(_traj(text, reward, g))
            texts.append(text), rewards.append(reward), uids.append(f"uid{g}")
    official_kept = set(_official_kept(texts, rewards, uids))
    ours = select_groups(trajs, num_groups, cfg, seed=0).kept
    assert {id(t) for t in ours} == {id(trajs[i]) for i in official_kept}
    assert len(ours) == 16 * num_groups
    # the structured (paper) penalties, which count no text, keep other sets on the same groups
    paper = select_groups(trajs, num_groups, paper_cfg, seed=0).kept
    differs_with_paper_penalties = {id(t) for t in paper} != {id(trajs[i]) for i in official_kept}
    assert differs_with_paper_penalties


def test_official_penalty_needs_trajectories_and_a_known_name():
    with pytest.raises(ValueError, match="response_text"):
        roc.roc_select([roc.RocStats(1.0, 0, 0, 1, 1)] * 4, 2, 0, variant="topk", penalty="official_text",
                       min_negatives=0, min_positives=0)
    with pytest.raises(ValueError, match="unknown RoC penalty"):
        roc.roc_select([_traj("", 1.0, 0)] * 4, 2, 0, penalty="nope")
    with pytest.raises(ValueError, match="roc_penalty"):
        RLConfig(roc_penalty="text")
