"""Procedural integer-answer problems for CPU demos, and SFT tool-use traces in rStar2-Agent format.

The problems are easy with the Python tool and hopeless "in the head" for a tiny model:
multiplication, modular exponentiation, counting multiples of a or b up to N, digit sums of big
powers. They are short (~20-30 tokens) for a ~512-token budget.

Splits are disjoint by construction: a problem belongs to the held-out split iff a stable hash of
its text falls in the held-out bucket, whatever the seed or the number of problems drawn.

SFT traces (paper Fig. 2 layout): a short <reason>, a <tool_call> with code that computes the
answer, the tool result (the code really runs in a child Python process), then
<reason>...</reason><answer>\\boxed{N}</answer>, as OpenAI-style messages for
`rstarjax.models.chat_template.render_conversation` / `encode_conversation`.

In-head traces: a fraction of the problems of chosen kinds can instead be answered directly,
without the tool (``<reason>Count them in my head.</reason><answer>\\boxed{N}</answer>``), the
way a generic chat model answers short arithmetic. The SFT policy then guesses on those kinds
about as often as the data does, and RL has to discover that calling the tool pays: the
tool-use behaviour rStar2-Agent's RL reinforces (§4), in miniature. The in-head and the tool
reasons share every token up to "in", so the choice is the one sampling decision after it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from rstarjax.env import classify_tool_error, format_tool_response
from rstarjax.protocol import ANSWER_CLOSE, ANSWER_OPEN, REASON_CLOSE, REASON_OPEN, TOOL_NAME

TASK_KINDS = ("multiply", "modpow", "count_divisible", "digit_sum_power")
# The harder tier: counting whose numbers vary in width (``_count_divisible_large_once``), so that
# copying them is not one constant offset; its own wording, so that a kind is read off the text.
# Not in TASK_KINDS (the default of every function here); configs/demo.py lists it, so the
# held-out set has headroom.
HARD_KINDS = ("count_divisible_large",)
ALL_KINDS = TASK_KINDS + HARD_KINDS
SPLITS = ("train", "test")
HELD_OUT_BUCKETS = 10  # 1 in 10 problem texts is held out


@dataclasses.dataclass(frozen=True)
class DemoTask:
    kind: str
    problem: str
    answer: str
    code: str  # a program that prints the answer (what the SFT trace's tool call runs)
    reason: str  # the trace's opening <reason> text
    # A plausible first program that fails when run (a type error, an unknown name, a stray
    # parenthesis): the recovery traces open with it, read its traceback and then run `code`. It
    # has `code`'s tokens around every operand (only a word or a closing token differs), so the
    # policy copies the question's numbers into it exactly as into `code`, and the fix copies them
    # from the program just above. Measured (docs/demo.md): modpow's earlier buggy program, which
    # moved the operands (`import math` first), was recovered into a right answer 5 % of the time;
    # this layout 69 %, against 90 % for a clean first program.
    buggy_code: str = ""

    def as_row(self) -> dict[str, str]:
        return {"problem": self.problem, "answer": self.answer}


# ---- generators: pure functions of a random.Random ---------------------------------------------
# Every number a base kind writes has a FIXED digit count (operands and answer), and each kind has
# one fixed wording: copying a number (question -> code, tool output -> box) is then a constant
# relative offset, which a 2-layer RoPE model learns in a few hundred steps; with variable widths
# it needs a content-based induction head, which the demo model learns late or not at all
# (docs/demo.md). The offsets are also the SAME for every base kind (each operand 87-88 tokens
# after its source in the demo vocabulary, every answer 4 digits), so one attention pattern
# serves them all: a kind with offsets of its own (multiply's operands at 79 and its 8-digit
# answers, digit sums' base at 90) was the kind the SFT stage left at 0-12 % on some seeds
# (issue 48, docs/demo.md "Fresh seeds").
def _draw(rng: random.Random, make: Callable[[random.Random], DemoTask], answer_digits: int) -> DemoTask:
    """Rejection sampling: redraw until the answer has exactly `answer_digits` digits (every kind
    accepts > 80 % of draws, so this ends fast)."""
    for _ in range(10_000):
        task = make(rng)
        if len(task.answer) == answer_digits:
            return task
    raise RuntimeError(f"no {answer_digits}-digit answer in 10000 draws")  # pragma: no cover


def _multiply_once(rng: random.Random) -> DemoTask:
    a, b = rng.randint(32, 99), rng.randint(32, 99)  # 2 x 2 digits, product 4 digits
    return DemoTask("multiply", f"Compute {a} * {b}.", str(a * b), f"print({a} * {b})",
                    "Multiply the two numbers together in Python.",  # each operand 87 tokens after its source
                    buggy_code=f"print({a} * {b}))")  # SyntaxError: unmatched ')'


def _multiply(rng: random.Random) -> DemoTask:
    return _draw(rng, _multiply_once, 4)


def _modpow_once(rng: random.Random) -> DemoTask:
    base, exp, mod = rng.randint(100, 999), rng.randint(1000, 9999), rng.randint(1000, 9999)
    return DemoTask(
        "modpow", f"Compute {base}^{exp} mod {mod}.", str(pow(base, exp, mod)),
        f"print(pow({base}, {exp}, {mod}))", "Use pow in Python.",
        buggy_code=f"print(mod({base}, {exp}, {mod}))",  # NameError: name 'mod' is not defined
    )


def _modpow(rng: random.Random) -> DemoTask:
    return _draw(rng, _modpow_once, 4)


def _count_divisible_once(rng: random.Random) -> DemoTask:
    n = rng.randint(10000, 99999)
    a = rng.randint(11, 40)
    b = rng.choice([k for k in range(11, 41) if k % a and a % k])  # neither divides the other
    return _counting_task("count_divisible", n, a, b, "divisible by {a} or {b}")


def _counting_task(kind: str, n: int, a: int, b: int, wording: str) -> DemoTask:
    """How many integers from 1 to ``n`` are divisible by ``a`` or ``b`` (``wording`` says it in
    the question), answered by inclusion-exclusion; the trace's code counts directly.

    The operands are bound on the program's first two lines, in the question's order, and the
    loop uses the names: each operand is then copied from the question at the same token offset
    (87-88 tokens, demo vocabulary; modpow's are 87/88/87). Written inline in the loop, the two
    divisors sat 102 and 108 tokens after their source and the SFT policy copied them at 81 % /
    69 % per digit (benchmarks/demo_copying.py, docs/demo.md 2026-11-26)."""
    answer = n // a + n // b - n // (a * b // _gcd(a, b))
    head = f"n = {n}\na, b = {a}, {b}\n"
    return DemoTask(
        kind,
        f"How many integers from 1 to {n} are {wording.format(a=a, b=b)}?",
        str(answer),
        head + "print(sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0))",
        "Count them in Python.",
        # TypeError: object of type 'generator' has no len()
        buggy_code=head + "print(len(k for k in range(1, n + 1) if k % a == 0 or k % b == 0))",
    )


def _count_divisible(rng: random.Random) -> DemoTask:
    return _draw(rng, _count_divisible_once, 4)


def _count_divisible_large_once(rng: random.Random) -> DemoTask:
    """The harder tier of counting: N of 5 or 6 digits, each divisor of 2 or 3 digits (coins of
    one half), so the offset from each number to its copy varies by up to 3 tokens and the answer
    has 2 to 5 digits: the one kind whose numbers the policy cannot copy at a fixed offset. Its
    own wording ("multiples of"); the program keeps the base kind's layout. N stays below 200,000
    (the program's loop: ~40 ms)."""
    n = rng.randint(10000, 99999) if rng.random() < 0.5 else rng.randint(100000, 199999)

    def divisor() -> int:
        return rng.randint(11, 99) if rng.random() < 0.5 else rng.randint(101, 400)

    a, b = divisor(), divisor()
    while not (a % b and b % a):  # neither divides the other
        b = divisor()
    return _counting_task("count_divisible_large", n, a, b, "multiples of {a} or {b}")


def _count_divisible_large(rng: random.Random) -> DemoTask:
    return _count_divisible_large_once(rng)  # no fixed answer width: part of what makes it harder


def _digit_sum_power_once(rng: random.Random) -> DemoTask:
    base, exp = rng.randint(10, 99), rng.randint(100, 999)
    return DemoTask(
        "digit_sum_power",
        f"What is the sum of the digits of {base}^{exp}?",
        str(sum(int(d) for d in str(base**exp))),
        # `map` and `**` unspaced put both operands 88 tokens after their source, as the other kinds'
        f"print(sum(map(int, str({base}**{exp}))))",
        "Sum the digits in Python.",
        buggy_code=f"print(sum(map(int, int({base}**{exp}))))",  # TypeError: 'int' object is not iterable
    )


def _digit_sum_power(rng: random.Random) -> DemoTask:
    return _draw(rng, _digit_sum_power_once, 4)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


GENERATORS: dict[str, Callable[[random.Random], DemoTask]] = {
    "multiply": _multiply,
    "modpow": _modpow,
    "count_divisible": _count_divisible,
    "digit_sum_power": _digit_sum_power,
    "count_divisible_large": _count_divisible_large,
}


_WORDING = (("are multiples of", "count_divisible_large"), ("How many integers", "count_divisible"), ("What is the sum of the digits", "digit_sum_power"),
            (" mod ", "modpow"), (" * ", "multiply"))


def kind_of(problem: str) -> str:
    """The task kind of a generated problem text (each kind has one wording)."""
    for marker, kind in _WORDING:
        if marker in problem:
            return kind
    raise ValueError(f"not a demo problem: {problem!r}")


def split_of(problem: str) -> str:
    """"test" for the held-out bucket of a stable hash of the problem text, else "train"."""
    bucket = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big") % HELD_OUT_BUCKETS
    return "test" if bucket == 0 else "train"


def generate_tasks(
    num: int, split: str = "train", seed: int = 0, kinds: Sequence[str] = TASK_KINDS
) -> list[DemoTask]:
    """`num` distinct problems of `split`, kinds in round-robin order. Deterministic in
    (split, seed, kinds); train and test never share a problem text."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    unknown = [k for k in kinds if k not in GENERATORS]
    if unknown or not kinds:
        raise ValueError(f"unknown task kinds {unknown}; choose from {ALL_KINDS}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(f"rstarjax-demo-{split}-{seed}")
    tasks: list[DemoTask] = []
    seen: set[str] = set()
    max_draws = 200 * num + 1000  # the spaces are huge; this only guards a pathological caller
    for draw in range(max_draws):
        if len(tasks) == num:
            break
        task = GENERATORS[kinds[len(tasks) % len(kinds)]](rng)
        if task.problem in seen or split_of(task.problem) != split:
            continue
        seen.add(task.problem)
        tasks.append(task)
    if len(tasks) < num:
        raise RuntimeError(f"only {len(tasks)} distinct {split} problems after {max_draws} draws")
    return tasks


def make_dataset(num: int, split: str = "train", seed: int = 0, kinds: Sequence[str] = TASK_KINDS) -> list[dict[str, str]]:
    """Rows {"problem": str, "answer": str} (the RL data contract)."""
    return [t.as_row() for t in generate_tasks(num, split, seed, kinds)]


# ---- running code in a child process -----------------------------------------------------------
_CHILD = r"""
import contextlib, io, json, sys, traceback
codes = json.loads(sys.stdin.read())
out = []
for code in codes:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
        text = buf.getvalue()
    except BaseException:
        text = buf.getvalue() + traceback.format_exc(limit=2)
    out.append(text.rstrip("\n"))
sys.__stdout__.write(json.dumps(out))
"""


SECONDS_PER_PROGRAM = 0.05  # the batch's time budget grows with it: a counting program takes ~30 ms on a loaded core


def run_programs(codes: Sequence[str], timeout: float | None = None) -> list[str]:
    """Run each program in one fresh child interpreter (isolated from this process); returns the
    stdout of each, trailing newlines stripped as rstarjax.env's sandbox does (an exception's
    traceback is appended to its output). Raises TimeoutError if the batch exceeds `timeout`
    (default: 60 s plus ``SECONDS_PER_PROGRAM`` per program; a flat 60 s failed the demo's 14,000
    programs on a loaded 2-core machine, issue 48)."""
    if not codes:
        return []
    if timeout is None:
        timeout = 60.0 + SECONDS_PER_PROGRAM * len(codes)
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", _CHILD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(list(codes)), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass  # a grandchild holds the pipes: the runner itself is dead
        raise TimeoutError(f"{len(codes)} demo programs did not finish within {timeout} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"demo program runner failed (exit {proc.returncode}): {stderr[-500:]}")
    outputs = json.loads(stdout)
    if len(outputs) != len(codes):
        raise RuntimeError(f"runner returned {len(outputs)} outputs for {len(codes)} programs")
    return outputs


# ---- SFT traces --------------------------------------------------------------------------------
def reasoned(text: str) -> str:
    """``text`` as the reasoning of an assistant turn (protocol.py's tags)."""
    return f"{REASON_OPEN}{text}{REASON_CLOSE}"


def boxed_answer(value) -> str:
    """The final answer block the reward reads (paper §2.2)."""
    return f"{ANSWER_OPEN}\\boxed{{{value}}}{ANSWER_CLOSE}"


def sft_trace(task: DemoTask, tool_output: str) -> list[dict]:
    """OpenAI-style messages: question, reason + tool call, tool result, reason + boxed answer.
    The final answer is taken from the tool output (as a model would), not from `task.answer`."""
    result = tool_output.strip()
    return [
        {"role": "user", "content": task.problem},
        {
            "role": "assistant",
            "content": reasoned(task.reason),
            "tool_calls": [
                {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": task.code, "input": ""}}}
            ],
        },
        {"role": "tool", "content": tool_output},
        {
            "role": "assistant",
            "content": reasoned(f"The code printed {result}.") + boxed_answer(result),
        },
    ]


IN_PYTHON, IN_HEAD = " in Python.", " in my head."


def in_head_reason(task: DemoTask) -> str:
    """The tool trace's reason with the tool swapped for mental arithmetic ("Count them in
    Python." -> "Count them in my head.")."""
    if not task.reason.endswith(IN_PYTHON):
        raise ValueError(f"reason {task.reason!r} does not end with {IN_PYTHON!r}")
    return task.reason[: -len(IN_PYTHON)] + IN_HEAD


def in_head_trace(task: DemoTask) -> list[dict]:
    """OpenAI-style messages: question, then a boxed answer without any tool call."""
    return [
        {"role": "user", "content": task.problem},
        {"role": "assistant",
         "content": reasoned(in_head_reason(task)) + boxed_answer(task.answer)},
    ]


def answers_in_head(task: DemoTask, in_head_fraction: Mapping[str, float], seed: int = 0) -> bool:
    """Whether `task`'s SFT trace skips the tool: a stable coin per (problem text, seed) that
    comes up with probability `in_head_fraction[task.kind]` (0 for kinds not listed)."""
    p = float(in_head_fraction.get(task.kind, 0.0))
    digest = hashlib.sha256(f"in-head-{seed}-{task.problem}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < p


FIX_REASON = "Fix the error."


def recovery_trace(task: DemoTask, error_output: str, fixed_output: str) -> list[dict]:
    """OpenAI-style messages of a first attempt that fails and its fix (paper Fig. 2's pattern):
    question, reason + the buggy program, its traceback, reason + the task's program, its output,
    reason + boxed answer (taken from that output)."""
    def call(code: str) -> list[dict]:
        return [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code, "input": ""}}}]

    result = fixed_output.strip()
    return [
        {"role": "user", "content": task.problem},
        {"role": "assistant", "content": reasoned(task.reason), "tool_calls": call(task.buggy_code)},
        {"role": "tool", "content": error_output},
        {"role": "assistant", "content": reasoned(FIX_REASON), "tool_calls": call(task.code)},
        {"role": "tool", "content": fixed_output},
        {"role": "assistant",
         "content": reasoned(f"The code printed {result}.") + boxed_answer(result)},
    ]


def recovers(task: DemoTask, recover_fraction: Mapping[str, float], seed: int = 0) -> bool:
    """Whether `task`'s SFT trace opens with its buggy program: a stable coin per (problem text,
    seed), independent of `answers_in_head`'s, with probability `recover_fraction[task.kind]`."""
    p = float(recover_fraction.get(task.kind, 0.0))
    digest = hashlib.sha256(f"recover-{seed}-{task.problem}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < p


# (program texts) -> per program (it failed, the text the agent loop shows the model)
ErrorRunner = Callable[[Sequence[str]], list[tuple[bool, str]]]


def sandbox_error_runner(executor) -> ErrorRunner:
    """Runs programs in the RL sandbox (an ``rstarjax.env.CodeExecutor``) and returns each one's
    tool response exactly as a rollout formats it: the recovery traces' tracebacks are the ones
    the policy meets at RL time."""
    def run(codes: Sequence[str]) -> list[tuple[bool, str]]:
        results = executor.run_batch(list(codes)) if codes else []
        return [(classify_tool_error(r) is not None, format_tool_response(r)) for r in results]

    return run


def _validate_shares(name: str, shares: Mapping[str, float]) -> None:
    unknown = sorted(set(shares) - set(GENERATORS))
    if unknown:
        raise ValueError(f"{name} names unknown task kinds {unknown}; choose from {ALL_KINDS}")
    if any(not 0.0 <= float(p) <= 1.0 for p in shares.values()):
        raise ValueError(f"{name} values must be in [0, 1], got {dict(shares)}")


def make_sft_traces(
    tasks: Sequence[DemoTask],
    runner: Callable[[Sequence[str]], list[str]] = run_programs,
    in_head_fraction: Mapping[str, float] | None = None,
    seed: int = 0,
    recover_fraction: Mapping[str, float] | None = None,
    error_runner: ErrorRunner | None = None,
) -> list[list[dict]]:
    """Runs every task's code (default: a child process; pass e.g. a wrapper around
    rstarjax.env.CodeExecutor to use the RL sandbox) and keeps only traces whose tool output is
    the task's answer (a failed run never becomes training data). With `in_head_fraction`
    ({kind: probability}), that share of a kind's traces answers in the head instead
    (`in_head_trace`, with the generator's answer; no code runs for it). With `recover_fraction`
    ({kind: probability}), that share of a kind's tool traces opens with the task's buggy program,
    shows the traceback `error_runner` got for it (required then; `sandbox_error_runner`), and
    fixes it (`recovery_trace`); kept only if the first program really failed and the fix prints
    the answer. Order is kept."""
    shares = dict(in_head_fraction or {})
    recover = dict(recover_fraction or {})
    _validate_shares("in_head_fraction", shares)
    _validate_shares("recover_fraction", recover)
    no_bug = sorted(k for k, p in recover.items() if float(p) > 0 and not GENERATORS[k](random.Random(0)).buggy_code)
    if no_bug:
        raise ValueError(f"recover_fraction names kinds without a buggy program: {no_bug}")
    in_head = [answers_in_head(t, shares, seed) for t in tasks]
    recovering = [not head and recovers(t, recover, seed) for t, head in zip(tasks, in_head)]
    if any(recovering) and error_runner is None:
        raise ValueError("recover_fraction needs an error_runner (e.g. sandbox_error_runner(CodeExecutor()))")
    # the program whose output becomes the answer (a recovery trace's fix is the task's program)
    outputs = iter(runner([t.code for t, head in zip(tasks, in_head) if not head]))
    errors = iter(error_runner([t.buggy_code for t, rec in zip(tasks, recovering) if rec]) if any(recovering) else [])
    traces = []
    for t, head, rec in zip(tasks, in_head, recovering):
        if head:
            traces.append(in_head_trace(t))
            continue
        out = next(outputs)
        if out.strip() != t.answer:
            continue
        if not rec:
            traces.append(sft_trace(t, out))
            continue
        failed, error_text = next(errors)
        if failed:
            traces.append(recovery_trace(t, error_text, out))
    return traces
