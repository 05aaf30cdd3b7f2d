"""Demo tasks: answers against independent computations, disjoint splits, SFT traces that the
chat template, the env's tool-call parser and math-verify (the RL reward) all accept."""
import json
import re
import time

import pytest

from rstarjax.models import chat_template as ct
from rstarjax.models.tokenizer import load_tokenizer
from rstarjax.recipes import demo_tasks as dt


def _independent_answer(problem: str) -> int:
    """Recompute from the problem text alone, by a different method than the generator's."""
    nums = [int(x) for x in re.findall(r"\d+", problem)]
    if problem.startswith("Compute") and "mod" in problem:
        base, exp, mod = nums
        result, b = 1, base % mod
        for bit in bin(exp)[2:][::-1]:  # right-to-left square-and-multiply
            if bit == "1":
                result = result * b % mod
            b = b * b % mod
        return result
    if problem.startswith("Compute"):
        a, b = nums
        return sum(int(d) * 10**i * a for i, d in enumerate(reversed(str(b))))  # long multiplication
    if problem.startswith("How many"):
        _, n, a, b = nums
        return sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0)
    base, exp = nums
    value, total = base**exp, 0
    while value:
        value, digit = divmod(value, 10)
        total += digit
    return total


def test_answers_are_correct_and_code_really_prints_them():
    tasks = dt.generate_tasks(40, "train", seed=3)
    assert {t.kind for t in tasks} == set(dt.TASK_KINDS)
    outputs = dt.run_programs([t.code for t in tasks])
    for task, out in zip(tasks, outputs):
        assert int(task.answer) == _independent_answer(task.problem), task
        assert out == task.answer


def test_splits_are_disjoint_and_deterministic():
    train = dt.make_dataset(600, "train", seed=0)
    test = dt.make_dataset(150, "test", seed=0)
    test_other_seed = dt.make_dataset(150, "test", seed=1)
    assert set(r["problem"] for r in train).isdisjoint(r["problem"] for r in test + test_other_seed)
    assert len({r["problem"] for r in train}) == 600
    assert dt.make_dataset(600, "train", seed=0) == train
    assert dt.make_dataset(50, "train", seed=1) != train[:50]
    assert all(set(r) == {"problem", "answer"} and r["answer"].isdigit() for r in train)
    only = dt.make_dataset(20, "test", kinds=("modpow",))
    assert all("mod" in r["problem"] for r in only)


def test_fixed_wording_and_digit_counts_per_kind():
    """Copying must be a constant relative offset: per kind, the problem text, the code and the
    answer have the same shape (every digit run replaced by its width) for every draw."""
    def shape(text):
        return re.sub(r"\d+", lambda m: f"<{len(m.group())}>", text)

    tasks = dt.generate_tasks(400, "train", seed=7) + dt.generate_tasks(100, "test", seed=7)
    for kind in dt.TASK_KINDS:
        of_kind = [t for t in tasks if t.kind == kind]
        assert len(of_kind) >= 100
        assert len({(shape(t.problem), shape(t.code), shape(t.answer), t.reason) for t in of_kind}) == 1, kind
        assert all(not t.answer.startswith("0") for t in of_kind)
        # the answers are not one constant (rejection sampling kept the draws varied)
        assert len({t.answer for t in of_kind}) > 0.9 * len(of_kind)


def _copy_offsets(task, demo_tok) -> list[int]:
    """Token distance from each of the question's operands to its copy in the program, in the
    demo's vocabulary (the counting question's "from 1" is not an operand)."""
    ids = demo_tok.encode(ct.render_conversation(dt.sft_trace(task, task.answer), fmt=ct.COMPACT))
    pieces = [demo_tok.decode([t]) for t in ids]
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    text = "".join(pieces)
    question, code = text.index(task.problem), text.index(json.dumps(task.code)[1:-1])
    find = lambda at, number: starts.index(at + re.search(rf"(?<!\d){number}(?!\d)", text[at:]).start())  # noqa: E731
    return [find(code, n) - find(question, n) for n in re.findall(r"\d+", task.problem) if n != "1"]


def test_every_base_kind_copies_at_one_shared_offset():
    """The demo model copies a number by a constant token offset, one attention pattern for every
    kind: each base kind's operands sit 87-88 tokens after their source, and every base kind's
    answer has 4 digits (the copy from the tool's output to the box then has one offset too).
    (The counting divisors at 102 and 108 tokens, written inline in the loop, were copied at 81 %
    / 69 % per digit; bound on the program's first lines, at 87: 100 %. Kinds with offsets of
    their own were the ones SFT left at 0-12 % on some seeds: multiply's operands at 79 and its
    8-digit products, the digit sums' base at 90; issue 48.) The harder tier varies by design."""
    demo_tok = load_tokenizer(1000)
    for kind in dt.TASK_KINDS:
        for task in dt.generate_tasks(3, "train", seed=3, kinds=(kind,)):
            offsets = _copy_offsets(task, demo_tok)
            assert len(offsets) >= 2 and all(87 <= o <= 88 for o in offsets), (kind, offsets)
            assert len(task.answer) == 4, (kind, task.answer)
    hard = [_copy_offsets(t, demo_tok) for t in dt.generate_tasks(24, "train", seed=3, kinds=dt.HARD_KINDS)]
    assert len({o[0] for o in hard}) >= 3  # N's offset moves with the divisors' widths


def test_problems_are_short_for_the_demo_budget():
    small = load_tokenizer(3000)
    rows = dt.make_dataset(200, "train")
    assert max(len(small.encode(r["problem"])) for r in rows) <= 40


def test_sft_traces_render_parse_and_verify():
    from rstarjax.env import is_correct, parse_tool_call

    small = load_tokenizer(3000)
    tasks = dt.generate_tasks(24, "train", seed=5)
    traces = dt.make_sft_traces(tasks)
    assert len(traces) == len(tasks)
    for task, msgs in zip(tasks, traces):
        enc = ct.encode_conversation(small, msgs, fmt=ct.COMPACT)
        assert len(enc.ids) <= 512 and enc.assistant_mask.sum() > 20
        assert enc.ids.tolist() == small.encode(ct.render_conversation(msgs, fmt=ct.COMPACT))
        first_turn = ct.render_conversation(msgs[:2])
        call = parse_tool_call(first_turn[first_turn.rindex("<|im_start|>assistant"):])
        assert call.code == task.code and call.stdin == ""
        assert msgs[2]["content"] == task.answer
        assert is_correct(msgs[3]["content"], task.answer)
        assert not is_correct(msgs[3]["content"], str(int(task.answer) + 1))


def test_failed_runs_never_become_training_data():
    tasks = dt.generate_tasks(4, "train")
    assert all(t.answer != "1" for t in tasks)
    wrong = lambda codes: ["1"] * len(codes)  # noqa: E731
    assert dt.make_sft_traces(tasks, runner=wrong) == []
    half = lambda codes: [t.answer if i % 2 else "oops" for i, t in enumerate(tasks)]  # noqa: E731
    assert [m[0]["content"] for m in dt.make_sft_traces(tasks, runner=half)] == [t.problem for t in tasks[1::2]]


def test_runner_isolation_errors_and_timeout():
    out = dt.run_programs(["print('<|im_end|>')", "1/0", "import sys; sys.exit(3)", "x = 1"])
    assert out[0] == "<|im_end|>"
    assert "ZeroDivisionError" in out[1]
    assert "SystemExit" in out[2]
    assert out[3] == ""
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        dt.run_programs(["while True: pass"], timeout=1.0)
    assert time.monotonic() - start < 10


def test_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        dt.generate_tasks(3, "val")
    with pytest.raises(ValueError, match="kinds"):
        dt.generate_tasks(3, kinds=("sorting",))
    with pytest.raises(ValueError):
        dt.generate_tasks(-1)
    assert dt.run_programs([]) == []


def test_in_head_traces_share_and_single_token_choice():
    from rstarjax.env import is_correct

    small = load_tokenizer(3000)
    tasks = dt.generate_tasks(400, "train", seed=1)
    traces = dt.make_sft_traces(tasks, in_head_fraction={"count_divisible": 0.6}, seed=1)
    assert len(traces) == len(tasks)
    in_head = [(t, m) for t, m in zip(tasks, traces) if len(m) == 2]
    # only the listed kind answers in the head, at about the asked share (100 counting tasks)
    assert {t.kind for t, _ in in_head} == {"count_divisible"}
    assert 45 <= len(in_head) <= 75
    for task, msgs in in_head:
        assert "tool_calls" not in msgs[1] and is_correct(msgs[1]["content"], task.answer)
    # the two reasons share every token up to " in" (demo vocabulary), so the SFT policy's choice
    # between guessing and the tool is the one sampling decision that follows, which RL can move
    demo_tok = load_tokenizer(1000)
    tool = demo_tok.encode("<reason>Count them in Python.</reason>")
    head = demo_tok.encode(f"<reason>{dt.in_head_reason(in_head[0][0])}</reason>")
    first = next(i for i, (a, b) in enumerate(zip(tool, head)) if a != b)
    assert demo_tok.decode(tool[:first]).endswith("Count them in")
    assert demo_tok.decode(head[first:]).startswith(" my head.")
    # stable in (problem, seed): the same coin on a second call, a different one with another seed
    again = dt.make_sft_traces(tasks, in_head_fraction={"count_divisible": 0.6}, seed=1)
    assert [len(m) for m in again] == [len(m) for m in traces]
    other = dt.make_sft_traces(tasks, in_head_fraction={"count_divisible": 0.6}, seed=2)
    assert [len(m) for m in other] != [len(m) for m in traces]


def test_in_head_fraction_rejects_bad_input():
    tasks = dt.generate_tasks(4, "train")
    with pytest.raises(ValueError, match="unknown task kinds"):
        dt.make_sft_traces(tasks, in_head_fraction={"counting": 0.5})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dt.make_sft_traces(tasks, in_head_fraction={"modpow": 1.5})


def test_kind_of_recovers_every_generated_kind():
    for split in dt.SPLITS:
        for task in dt.generate_tasks(40, split, seed=3):
            assert dt.kind_of(task.problem) == task.kind
    with pytest.raises(ValueError):
        dt.kind_of("What is 2 + 2?")


@pytest.fixture(scope="module")
def sandbox():
    from rstarjax.env import CodeExecutor

    with CodeExecutor(num_workers=2).start() as ex:
        yield ex


def test_recovery_traces_show_real_sandbox_errors_then_the_fix(sandbox):
    from rstarjax.env import classify_tool_error, format_tool_response, is_correct, parse_tool_call

    small, demo_tok = load_tokenizer(3000), load_tokenizer(1000)
    tasks = [t for k in dt.TASK_KINDS for t in dt.generate_tasks(3, "train", seed=7, kinds=(k,))]
    traces = dt.make_sft_traces(tasks, recover_fraction={k: 1.0 for k in dt.TASK_KINDS},
                                error_runner=dt.sandbox_error_runner(sandbox))
    assert len(traces) == len(tasks)
    for task, msgs in zip(tasks, traces):
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        # the first program really fails in the RL sandbox, and the trace shows exactly the text a
        # rollout would show the model for it
        result = sandbox.run(task.buggy_code)
        assert classify_tool_error(result) == "execution"
        assert msgs[2]["content"] == format_tool_response(result)
        assert re.search(r"(NameError|SyntaxError|TypeError): ", msgs[2]["content"])
        rendered = ct.render_conversation(msgs, fmt=ct.COMPACT)
        turns = rendered.split("<|im_start|>assistant")[1:]
        assert parse_tool_call(turns[0]).code == task.buggy_code
        # the fix is the task's own program: a recovery copies the question's numbers no more
        # often than a clean trace does (the buggy program copies each operand once too)
        assert parse_tool_call(turns[1]).code == task.code
        assert sorted(re.findall(r"\d{2,}", task.buggy_code)) == sorted(re.findall(r"\d{2,}", task.code))
        # ... and at the same token positions as in the clean program, in the demo's vocabulary
        demo_ids = [demo_tok.encode(c) for c in (task.code, task.buggy_code)]
        is_digit = [[demo_tok.decode([t]).isdigit() for t in ids] + [False] for ids in demo_ids]
        digits = [[i for i in range(len(d) - 1) if d[i] and (d[i - 1] or d[i + 1])] for d in is_digit]  # operands
        assert digits[0] == digits[1], task.kind
        # the fix prints the answer (an independent computation), which the last turn boxes
        assert int(msgs[4]["content"]) == _independent_answer(task.problem)
        assert is_correct(msgs[5]["content"], task.answer)
        enc = ct.encode_conversation(small, msgs, fmt=ct.COMPACT)
        assert enc.ids.tolist() == small.encode(rendered)


def test_recovery_share_kinds_and_guards(sandbox):
    tasks = dt.generate_tasks(400, "train", seed=1)
    run_errors = dt.sandbox_error_runner(sandbox)
    traces = dt.make_sft_traces(tasks, in_head_fraction={"count_divisible": 0.6}, seed=1,
                                recover_fraction={"count_divisible": 0.3}, error_runner=run_errors)
    assert len(traces) == len(tasks)
    recovered = [t for t, m in zip(tasks, traces) if len(m) == 6]
    tool = [t for t, m in zip(tasks, traces) if len(m) >= 4 and t.kind == "count_divisible"]
    assert {t.kind for t in recovered} == {"count_divisible"}
    assert 0.15 <= len(recovered) / len(tool) <= 0.45  # ~40 counting tool traces, 30 % asked
    # in-head answers are untouched by the recovery coin
    plain = dt.make_sft_traces(tasks, in_head_fraction={"count_divisible": 0.6}, seed=1)
    assert [len(m) == 2 for m in plain] == [len(m) == 2 for m in traces]
    # a "buggy" program that does not fail never becomes a recovery trace
    no_error = lambda codes: [(False, "42")] * len(codes)  # noqa: E731
    quiet = dt.make_sft_traces(tasks[:40], recover_fraction={"count_divisible": 1.0}, error_runner=no_error)
    assert all(len(m) == 4 for m in quiet) and len(quiet) == 30
    with pytest.raises(ValueError, match="error_runner"):
        dt.make_sft_traces(tasks[:8], recover_fraction={"count_divisible": 1.0})
    with pytest.raises(ValueError, match="unknown task kinds"):
        dt.make_sft_traces(tasks[:8], recover_fraction={"counting": 0.5}, error_runner=run_errors)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dt.make_sft_traces(tasks[:8], recover_fraction={"modpow": -0.1}, error_runner=run_errors)
