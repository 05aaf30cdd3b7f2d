"""The agent loop's episode at its edges, driven directly (no engine, no sandbox): what the
scheduler would call, in the orders it can call it.

- a tool answer that arrives after the scheduler gave up on it leaves the finished trajectory as
  it was;
- a <tool_call> the model opened and never closed is a tool call with a parse error;
- a time limit the code pool refuses is a configuration error, not an infrastructure failure;
- prompt + response never exceed the slot.
"""
import concurrent.futures
import dataclasses
import json

import pytest

from rstarjax.env import ExecResult
from rstarjax.env.executor import ExecutorConfig
from rstarjax.env.results import VerifyResult
from rstarjax.models.chat_template import COMPACT, RSTAR2_OFFICIAL, encode_prompt
from rstarjax.models.tokenizer import load_tokenizer
from rstarjax.rl.agent_loop import AgentConfig, AgentEpisode, RolloutRequest, StopIds, fed_tokens
from rstarjax.rl.trajectory import FinishReason, SegmentKind
from rstarjax.serving.programs import DoneReason
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.scheduler import CallTool, Extend, Finish
from rstarjax.validation import ConfigError

TOOL = "execute_python_code_with_standard_io"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(486)


class HeldExecutor:
    """Tool calls answered only when the test says so (``answer``); verifications at once."""

    def __init__(self, refuse: Exception | None = None):
        self.calls: list[concurrent.futures.Future] = []
        self.refuse = refuse
        self.verified: list[str] = []

    def submit(self, code, stdin="", timeout=None):
        if self.refuse is not None:
            raise self.refuse
        fut = concurrent.futures.Future()
        self.calls.append(fut)
        return fut

    def answer(self, result: ExecResult) -> None:
        self.calls[-1].set_result(result)  # the episode's callback runs here, as on an executor thread

    def submit_verify(self, text, gold, timeout=None, mode="answer"):
        self.verified.append(text)
        fut = concurrent.futures.Future()
        fut.set_result(VerifyResult(True))
        return fut


def episode(tok, executor, config=AgentConfig(max_turns=4, max_response_len=400), fmt=COMPACT):
    request = RolloutRequest(encode_prompt(tok, "What is 6*7?", fmt), "42", sampling=SamplingParams())
    return AgentEpisode(request, tok, executor, config, StopIds.from_tokenizer(tok, fmt), fmt)


def call_text(code="print(6*7)"):
    args = json.dumps({"code": code, "input": ""})
    return f'<reason>run</reason><tool_call>\n{{"name": "{TOOL}", "arguments": {args}}}\n</tool_call>'


def end_turn(ep, tok, text, reason=DoneReason.STOP):
    ids = tok.encode(text)
    return ep.on_turn_end(ids, [-0.5] * len(ids), reason)


def bookkeeping(ep):
    t = ep.traj
    return (t.finish, t.error, t.tool_calls, dict(vars(t.tool_errors)), ep.tool_wait_s, ep.infra_retries,
            len(t.segments))


# ---- a late tool answer ----------------------------------------------------------------------


def test_a_tool_answer_after_the_scheduler_gave_up_changes_nothing(tok):
    """The scheduler's tool wait ran out: it cancels the call's future and aborts the episode
    (ERROR). The sandbox's answer (a timeout, an error the model made) comes later: the finished
    trajectory must not count it."""
    ex = HeldExecutor()
    ep = episode(tok, ex)
    action = end_turn(ep, tok, call_text())
    assert isinstance(action, CallTool)
    action.ids.cancel()  # RolloutScheduler._timed_out
    ep.on_abort("tool call did not return within 0.5 s")
    before = bookkeeping(ep)
    assert before[0] == FinishReason.ERROR
    ex.answer(ExecResult("timeout", "TimeoutError: execution exceeded the 5 s time limit"))
    assert bookkeeping(ep) == before


def test_a_late_infrastructure_answer_is_not_retried_for_a_finished_episode(tok):
    ex = HeldExecutor()
    ep = episode(tok, ex)
    action = end_turn(ep, tok, call_text())
    action.ids.cancel()
    ep.on_abort("tool call did not return within 0.5 s")
    before = bookkeeping(ep)
    ex.answer(ExecResult("error", "SandboxError: worker died", infra_error=True))
    assert bookkeeping(ep) == before and len(ex.calls) == 1


def test_a_tool_answer_in_time_is_counted_once(tok):
    ex = HeldExecutor()
    ep = episode(tok, ex)
    action = end_turn(ep, tok, call_text())
    ex.answer(ExecResult("timeout", "TimeoutError: execution exceeded the 5 s time limit"))
    assert action.ids.done() and ep.traj.tool_errors.timeout == 1 and ep.tool_wait_s >= 0
    assert isinstance(ep.on_tool_ready(action.ids.result(), 10_000), Extend)


# ---- an unterminated tool call ---------------------------------------------------------------


def test_a_tool_call_never_closed_is_a_call_with_a_parse_error(tok):
    """The model opened <tool_call> and ended its turn: the call is not run and the episode ends
    as the model chose, but the call counts (a parse error), so RoC sees a failed call."""
    ex = HeldExecutor()
    ep = episode(tok, ex)
    text = call_text().replace("</tool_call>", "") + "<|im_end|>"
    action = end_turn(ep, tok, text)
    t = ep.traj
    assert isinstance(action, Finish) and not ex.calls
    assert (t.finish, t.tool_calls, t.tool_errors.parse, t.tool_errors.total) == (FinishReason.NO_TOOL_CALL, 1, 1, 1)
    # with an answer it still ends ANSWERED (and is verified)
    ep = episode(tok, ex)
    end_turn(ep, tok, "<answer>\\boxed{42}</answer><tool_call>\n{\"name\": <|im_end|>")
    t = ep.traj
    assert (t.finish, t.tool_calls, t.tool_errors.parse) == (FinishReason.ANSWERED, 1, 1) and ex.verified


def test_a_turn_without_a_tool_call_counts_none(tok):
    ep = episode(tok, HeldExecutor())
    end_turn(ep, tok, "<reason>I guess</reason> 41<|im_end|>")
    assert (ep.traj.finish, ep.traj.tool_calls, ep.traj.tool_errors.total) == (FinishReason.NO_TOOL_CALL, 0, 0)


# ---- a time limit the code pool refuses ----------------------------------------------------------


def test_the_code_judge_protocol_needs_room_for_its_sandbox_grace():
    """code_judge runs each call 1 s past tool_timeout_s in the sandbox: tool_timeout_s in
    (599, 600] passed AgentConfig's own check and then every call was refused (and blamed on
    the environment). Refused when the episode (or the rollouts) is set up, naming the flag."""
    tok = load_tokenizer(486)
    fmt = dataclasses.replace(RSTAR2_OFFICIAL, system_prompt="short")
    too_long = AgentConfig(tool_timeout_s=ExecutorConfig.max_timeout - 0.5)
    with pytest.raises(ConfigError, match=r"^rl\.tool_timeout_s=599\.5 must be <= 599 seconds with the code_judge"):
        episode(tok, HeldExecutor(), too_long, fmt)
    episode(tok, HeldExecutor(), AgentConfig(tool_timeout_s=ExecutorConfig.max_timeout - 1), fmt)
    episode(tok, HeldExecutor(), too_long, COMPACT)  # the paper protocol runs tool_timeout_s itself


def test_arguments_the_executor_refuses_are_our_error_not_the_environments(tok):
    """A ValueError or TypeError from submit is raised (the run stops, saying why); an executor
    that is closed or broken is still the environment's failure (the episode ends as ERROR)."""
    ep = episode(tok, HeldExecutor(refuse=ValueError("timeout must be in (0, 600] seconds, got 601.0")))
    with pytest.raises(ValueError, match="timeout must be in"):
        end_turn(ep, tok, call_text())
    ep = episode(tok, HeldExecutor(refuse=RuntimeError("CodeExecutor is not running")))
    action = end_turn(ep, tok, call_text())
    assert isinstance(action, CallTool)
    with pytest.raises(Exception, match="code environment unavailable"):
        action.ids.result(timeout=0)


# ---- the slot's size -------------------------------------------------------------------------


def test_a_context_stop_keeps_only_the_tokens_the_slot_fed():
    """At a CONTEXT stop the last token was sampled with the slot full: it could never be fed,
    and kept it made prompt + response max_len + 1."""
    assert fed_tokens([5, 6, 7], [-1.0, -2.0, -3.0], DoneReason.CONTEXT) == ([5, 6], [-1.0, -2.0])
    assert fed_tokens([5, 6, 7], [-1.0, -2.0, -3.0], DoneReason.BUDGET) == ([5, 6, 7], [-1.0, -2.0, -3.0])
    assert fed_tokens([5, 6, 7], [-1.0, -2.0, -3.0], DoneReason.STOP) == ([5, 6, 7], [-1.0, -2.0, -3.0])


def test_the_turn_after_a_tool_response_is_budgeted_to_the_slots_room(tok):
    """The turn stops at its budget when the slot is full, never one token past it."""
    ex = HeldExecutor()
    ep = episode(tok, ex, AgentConfig(max_turns=4, max_response_len=10_000))
    action = end_turn(ep, tok, call_text())
    ex.answer(ExecResult("stdout", "42\n"))
    ids = action.ids.result()
    free_in_slot = len(ids) + 3
    extend = ep.on_tool_ready(ids, free_in_slot)
    assert isinstance(extend, Extend) and extend.max_new_tokens == 3
    response = len(ep.traj.response_ids)
    ids = list(range(10, 20))
    assert isinstance(ep.on_turn_end(ids, [-0.1] * len(ids), DoneReason.CONTEXT), Finish)
    assert len(ep.traj.response_ids) == response + len(ids) - 1
    assert [s.kind for s in ep.traj.segments] == [SegmentKind.MODEL, SegmentKind.TOOL, SegmentKind.MODEL]
