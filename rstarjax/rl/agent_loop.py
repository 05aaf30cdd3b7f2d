"""Multi-turn agent rollouts with a Python tool (rStar2-Agent §2.1), producing ``Trajectory``s.

One episode: prompt (system + question, paper Fig. 3) -> decode until ``</tool_call>``,
``<|im_end|>`` or EOS -> parse the call -> run it in the code environment -> append the tool
response turn -> decode on, until one of:

- a turn ends with ``<|im_end|>``/EOS: ``ANSWERED`` if the model's text has an ``<answer>``
  block, else ``NO_TOOL_CALL`` (the paper ends the rollout when a turn has no tool call). A
  ``<tool_call>`` such a turn opened but never closed with ``</tool_call>`` is not run: it is
  counted as a tool call with a parse error (``tool_calls`` and ``tool_errors.parse``), and the
  episode still ends as the model chose, ``ANSWERED`` or ``NO_TOOL_CALL`` (no call was run);
- the ``max_turns``-th turn asks for a tool: ``MAX_TURNS`` (that call is not executed);
- the response budget (model + tool tokens) or the slot's context is exhausted:
  ``MAX_LENGTH`` (truncated, reward 0). Prompt + response stay within the slot (``max_len``):
  a turn after a tool response is budgeted to the slot's room, and the token sampled when the
  slot was already full (a CONTEXT stop), which was never fed, is dropped. (Left: a first turn
  whose stop token is sampled just as the slot fills keeps it: max_len + 1 tokens, where the
  scheduler has no rollout cap below the slot. Never with ``ColocatedRollouts``: its slots hold
  max_prompt_len + max_response_len, so the response budget ends a turn first);
- the infrastructure fails (SkyRL-Agent §3.4 "terminal" conditions): ``ERROR``, with
  ``Trajectory.error`` saying what failed. An infrastructure answer of the code environment
  (``ExecResult.infra_error``: a worker died, the queue timed out, overload) is retried up to
  ``AgentConfig.infra_retries`` times and never shown to the model; past that, or when the
  executor is gone, a tool wait or the verification exceeds its bound, the episode ends. The
  trainer excludes ``ERROR`` trajectories from the update and counts them: they are the
  environment's errors, not the model's. Recoverable conditions (a malformed call, code that
  raises or times out) go back to the model inside ``<tool_response>``. A tool answer that
  arrives after the episode ended (the scheduler stopped waiting for it) changes nothing. The
  executor refusing a call's arguments (``ValueError``/``TypeError``: a time limit above the
  pool's) is a bug of ours, not of the environment: it is raised, not counted as ``ERROR``;
  ``require_tool_timeout_fits`` refuses such a configuration when the rollouts are set up.

Token bookkeeping (token-in/token-out, never re-tokenized):

- a MODEL segment is exactly what the engine sampled in a turn, ending with its stop id
  (``</tool_call>``, ``<|im_end|>`` or EOS), with the sampler's log-probs (loss mask 1);
- the engine stops *at* ``</tool_call>`` (the tool is dispatched the moment the call is
  complete), so the model never generates the ``<|im_end|>`` closing that turn: the TOOL
  segment appended by ``encode_tool_response_turn(..., close_assistant_turn=True)`` starts
  with ``<|im_end|>`` and runs to the next ``<|im_start|>assistant\\n``. All template tokens
  are loss-mask 0: the model is not trained to close a turn after a tool call (it can't not
  stop there at inference time anyway, as the engine stops it).

The official layout (``ChatFormat.official_layout``, chat format ``rstar2_official``) is the
official loop's protocol (microsoft/rStar ``rstar2_agent/rollout/rstar2_agent_loop.py``): the
engine decodes a turn to ``<|im_end|>`` / EOS (never stopping at ``</tool_call>``), the complete
``<tool_call>`` blocks of the turn are parsed afterwards and the first one is run (verl's
``max_parallel_calls=1``; a malformed one comes back as a tool response), and the TOOL segment
(``encode_tool_response_turn(..., fmt=fmt)``) follows the model's own ``<|im_end|>`` directly; a
turn without a complete call ends the episode.

The reward (``AgentConfig.reward_mode="answer"``, the paper's) is
``executor.submit_verify(model_text, gold)`` on the *model's* text only, so a program printing
``\\boxed{...}`` in a tool response cannot earn it; truncated / errored episodes get 0 without
verification. ``reward_mode="official"`` scores as the official reward manager does: the whole
decoded response (tool turns included, special tokens dropped) with the official compute_score
(``env.official_reward``), truncated responses included. Each episode waits for its own verification at most
``verify_wait_s`` from the moment it was submitted, or from the end of the batch's rollouts when
that is later (queueing in the pool included); a verifier that ran out of its own wall-clock
limit in the sandbox (``verify_timeout_s``) scores 0, as a wrong answer, while one that never
answered is an infrastructure error.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from rstarjax.env import ToolCallError, classify_tool_error, format_tool_response, parse_tool_call
from rstarjax.env.executor import ExecutorConfig
from rstarjax.env.official_reward import REWARD_MODES
from rstarjax.env import code_judge
from rstarjax.env.tools import CODE_JUDGE, parse_tool_calls, tool_result
from rstarjax.models.chat_template import RSTAR2, ChatFormat, encode_prompt, encode_tool_response_turn
from rstarjax.protocol import ANSWER_OPEN, STOP_TOKENS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory
from rstarjax.serving.colocated import ColocatedEngines, ServingConfig
from rstarjax.serving.engine import Engine
from rstarjax.serving.programs import DoneReason
from rstarjax.serving.sampling import SamplingParams
from rstarjax.serving.scheduler import CallTool, Extend, Finish, RolloutScheduler
from rstarjax.validation import one_of, require


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """One episode's budgets and the bounds on waiting for the environment (derived from a run's
    config in one place, ``RLConfig.agent``; an evaluation's budgets go over it). The defaults
    of the fields the ``rl`` section exposes are written here, once: RLConfig's are these."""

    max_turns: int = 10  # T: model turns per episode
    max_response_len: int = 8192  # model + tool tokens after the prompt
    tool_timeout_s: float = 5.0  # wall-clock limit of one code execution (in the sandbox)
    tool_wait_s: float = 60.0  # bound on waiting for the executor itself (infrastructure)
    verify_timeout_s: float = 30.0  # the verifier's own wall-clock limit in the sandbox
    # per episode: from its verification's submission, and never less than this after the last
    # rollout ended (the pool is then free of tool calls), an answer must come (queue + run)
    verify_wait_s: float = 300.0
    infra_retries: int = 2  # infrastructure failures of one tool call retried before the episode ends
    infra_retry_delay_s: float = 0.5  # before retry k: k times this (the pool replaces dead workers)
    max_tool_response_chars: int = 2048
    rollout_timeout_s: float = 3600.0
    # env.official_reward.REWARD_MODES: "answer" (paper eq. 3: the model's last boxed answer) or
    # "official" (the official compute_score on the whole response, truncated ones included)
    reward_mode: str = "answer"

    def __post_init__(self):
        pool_limit = ExecutorConfig.max_timeout  # the code pool refuses calls with a longer limit
        require(one_of("reward_mode", self.reward_mode, REWARD_MODES),
                (self.max_turns >= 1, f"max_turns={self.max_turns} must be >= 1"),
                (self.max_response_len >= 2, f"max_response_len={self.max_response_len} must be >= 2"),
                # (a negative one cut the official protocol's text at text[:-n]; 0 meant "no cut" in one
                # protocol and an empty text behind a marker in the other)
                (self.max_tool_response_chars >= 1,
                 f"max_tool_response_chars={self.max_tool_response_chars} must be >= 1 (the characters of a "
                 "tool's output the model is shown)"),
                (0 < self.tool_timeout_s <= pool_limit,
                 f"tool_timeout_s={self.tool_timeout_s} must be in (0, {pool_limit:g}] seconds, the code pool's "
                 "limit per call: outside it every tool call fails as an infrastructure error"),
                (self.rollout_timeout_s > 0,
                 f"rollout_timeout_s={self.rollout_timeout_s} must be > 0 seconds (the bound on a step's rollouts)"),
                (self.infra_retries >= 0 and self.infra_retry_delay_s >= 0,
                 "infra_retries and infra_retry_delay_s must be >= 0"),
                (self.verify_wait_s >= self.verify_timeout_s,
                 f"verify_wait_s={self.verify_wait_s} must cover verify_timeout_s={self.verify_timeout_s}"))


def require_tool_timeout_fits(config: AgentConfig, fmt: ChatFormat) -> None:
    """The code-judge protocol's sandbox runs each call ``code_judge.SANDBOX_GRACE_S`` past the
    program's own limit (``tool_timeout_s``): that too must be within the code pool's limit per
    call, or the pool would refuse every call. (AgentConfig alone cannot know the protocol.)"""
    if fmt.tool_protocol != CODE_JUDGE:
        return
    pool_limit = ExecutorConfig.max_timeout
    most = pool_limit - code_judge.SANDBOX_GRACE_S
    require((config.tool_timeout_s <= most,
             f"rl.tool_timeout_s={config.tool_timeout_s} must be <= {most:g} seconds with the code_judge tool "
             f"protocol: its sandbox runs each call {code_judge.SANDBOX_GRACE_S:g} s longer, within the code "
             f"pool's limit of {pool_limit:g} s per call"))


class InfrastructureError(RuntimeError):
    """A tool call the environment could not serve (after retries): ends the episode as ``ERROR``."""


def _settle(fut: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    """Complete ``fut`` unless it is already done: the scheduler cancels a tool future it stopped
    waiting for, and a late answer must then be dropped, not raise ``InvalidStateError``."""
    if fut.done():
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between the check and the set
        pass


@dataclasses.dataclass
class RolloutRequest:
    prompt_ids: Sequence[int]
    gold_answer: str
    group_id: int = 0
    sampling: SamplingParams = SamplingParams()
    policy_version: int = 0
    sample_index: int = 0  # which of its group's rollouts (``Trajectory.sample_index``)
    # Teacher-forced model tokens (all turns concatenated): a scripted policy for tests and
    # benchmarks. The engine still runs the model and reports each forced token's log-prob.
    script: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class StopIds:
    tool_call_end: int
    im_end: int
    eos: int
    at_tool_call: bool = True  # False: the official loop's decoding, to <|im_end|> / EOS only

    @classmethod
    def from_tokenizer(cls, tokenizer, fmt: ChatFormat = RSTAR2) -> "StopIds":
        return cls(*(tokenizer.token_id(t) for t in STOP_TOKENS), at_tool_call=fmt.stops_at_tool_call)

    @property
    def all(self) -> tuple[int, ...]:
        return (self.tool_call_end, self.im_end, self.eos) if self.at_tool_call else (self.im_end, self.eos)


class AgentEpisode:
    """The per-rollout state machine the scheduler drives (``serving.scheduler.Episode``)."""

    def __init__(self, request: RolloutRequest, tokenizer, executor, config: AgentConfig,
                 stops: StopIds, fmt: ChatFormat = RSTAR2):
        require_tool_timeout_fits(config, fmt)
        self.request = request
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.executor = executor
        self.config = config
        self.stops = stops
        self.prompt_ids = [int(t) for t in request.prompt_ids]
        self.sampling = dataclasses.replace(request.sampling, stop_ids=stops.all,
                                            max_new_tokens=config.max_response_len)
        self.traj = Trajectory(prompt_ids=np.asarray(self.prompt_ids, np.int32), segments=[],
                               group_id=request.group_id, policy_version=request.policy_version,
                               sample_index=request.sample_index)
        self.model_text = ""
        self.verify_future: concurrent.futures.Future | None = None
        self.verify_submitted = 0.0  # monotonic time the verification was submitted
        self.tool_wait_s = 0.0
        self.infra_retries = 0  # tool calls resubmitted after an infrastructure answer
        self.done = False
        self._scripted = 0  # script tokens consumed by finished turns
        self._tool_turn_floor: int | None = None  # _shortest_tool_turn, computed once
        self._lock = threading.Lock()  # tool callbacks run on executor threads

    # ---- scheduler hooks ------------------------------------------------------------------
    def forced_token(self, turn_offset: int) -> int:
        script = self.request.script
        if script is None:
            return -1
        i = self._scripted + turn_offset
        return int(script[i]) if i < len(script) else -1

    def on_turn_end(self, ids, logprobs, reason: DoneReason):
        """A model turn ended (rStar2-Agent §2.1's rollout): at its length budget the rollout ends
        (truncated); a turn with a tool call has it run and its response appended for the next
        turn, up to ``max_turns``; a turn without one ends the rollout, which is then scored."""
        t = self.traj
        self._scripted += len(ids)
        ids, logprobs = fed_tokens(ids, logprobs, reason)
        t.segments.append(Segment(SegmentKind.MODEL, ids, logprobs))
        t.turns += 1
        text = self.tokenizer.decode(ids)
        self.model_text += text
        t.response_text += text
        t.answer_tags = self.model_text.count(ANSWER_OPEN)
        if reason in (DoneReason.BUDGET, DoneReason.CONTEXT):
            return self._finish(FinishReason.MAX_LENGTH)
        if self.fmt.official_layout:
            call = official_turn_call(text, self.fmt.tool_names, self.fmt.tool_protocol, self.config.tool_timeout_s)
        elif ids[-1] == self.stops.tool_call_end:
            call = parse_tool_call(text, self.fmt.tool_names)
            call = ToolCallError("Tool call has no opening <tool_call> tag.") if call is None else call
        else:
            call = None
            unclosed = unterminated_call(text, self.fmt.tool_names)
            if unclosed is not None:  # a call the model opened, then ended its turn: never run
                t.tool_calls += 1
                self._count_error(unclosed)
        if call is None:  # <|im_end|> or EOS without a call to run: the episode is over
            return self._finish(FinishReason.ANSWERED if t.answer_tags else FinishReason.NO_TOOL_CALL)
        if t.turns >= self.config.max_turns:
            return self._finish(FinishReason.MAX_TURNS)
        if self.config.max_response_len - len(t.response_ids) < self._shortest_tool_turn() + 1:
            # no tool turn and one more model token fit (on_tool_ready would end it so): the call
            # is not run, its output could not be appended
            return self._finish(FinishReason.MAX_LENGTH)
        t.tool_calls += 1
        return CallTool(self._dispatch(call))

    def _shortest_tool_turn(self) -> int:
        """A floor on any tool turn's tokens: the turn around an empty output, less one (an
        output's first token may merge with the wrapper's)."""
        if self._tool_turn_floor is None:
            wrapper = encode_tool_response_turn(self.tokenizer, "", close_assistant_turn=self.fmt.stops_at_tool_call,
                                                fmt=self.fmt)
            self._tool_turn_floor = max(1, len(wrapper) - 1)
        return self._tool_turn_floor

    def on_tool_ready(self, ids, free_tokens_in_slot: int):
        room = self.config.max_response_len - len(self.traj.response_ids)
        # The tool turn must fit with room for at least one more model token.
        if len(ids) + 1 > min(room, free_tokens_in_slot):
            return self._finish(FinishReason.MAX_LENGTH)
        self.traj.segments.append(Segment(SegmentKind.TOOL, list(ids)))
        self.traj.response_text += self.tokenizer.decode(ids)
        # to the slot's room too: the turn then stops at its budget with prompt + response at
        # most the slot's size, never at a full slot (CONTEXT) with a token it could not feed
        return Extend(ids, max_new_tokens=min(room, free_tokens_in_slot) - len(ids))

    def on_abort(self, why: str) -> None:
        self._infra_error(why)

    def continue_under(self, version: int, sampled: int) -> None:
        """A paused rollout goes on under policy ``version`` from its ``sampled``-th model token
        (the scheduler's ``n_sampled`` when it paused): recorded in ``traj.version_starts``."""
        t = self.traj
        current = t.version_starts[-1][1] if t.version_starts else t.policy_version
        if int(version) != current:
            t.version_starts.append((int(sampled), int(version)))

    # ---- internals ----------------------------------------------------------------------------
    def _infra_error(self, why: str) -> None:
        self.traj.error = why
        self.traj.reward = 0.0
        self._finish(FinishReason.ERROR)

    def _finish(self, finish: FinishReason):
        with self._lock:  # a tool answer's bookkeeping (an executor thread) sees it finished or not at all
            self.traj.finish = finish
            self.done = True
        official = self.config.reward_mode == "official"
        # the official reward manager scores every response, truncated ones too
        unscored = (FinishReason.ERROR,) if official else (FinishReason.MAX_LENGTH, FinishReason.ERROR)
        if finish not in unscored:
            try:
                if official:  # the whole decoded response, as the official reward manager reads it
                    text = self.tokenizer.decode(self.traj.response_ids, skip_special_tokens=True)
                    self.verify_future = self.executor.submit_verify(
                        text, self.request.gold_answer, timeout=self.config.verify_timeout_s, mode="official")
                else:
                    text = self.model_text
                    self.verify_future = self.executor.submit_verify(
                        text, self.request.gold_answer, timeout=self.config.verify_timeout_s,
                        mode=self.config.reward_mode)
                self.traj.graded_text = text
                self.verify_submitted = time.monotonic()
            except Exception as e:  # the executor is gone: the environment's failure
                self._infra_error(f"the verifier could not be reached: {e!r}")
        return Finish()

    def _dispatch(self, call) -> concurrent.futures.Future:
        """Future of the tool turn's ids; execution starts now (asynchronous to decoding)."""
        out: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(call, ToolCallError):
            self._count_error(call)
            out.set_result(self._tool_turn_ids(call))
            return out
        self._submit_tool(call, out, attempt=0, t0=time.monotonic())
        return out

    def _submit_tool(self, call, out: concurrent.futures.Future, attempt: int, t0: float) -> None:
        if out.done():  # the scheduler stopped waiting (cancelled): nothing to retry for
            return
        try:
            fut = self.executor.submit(call.code, call.stdin, timeout=call.sandbox_timeout_s or self.config.tool_timeout_s)
        except (ValueError, TypeError):
            # the executor refused our arguments (e.g. a time limit above the pool's): a bug or a
            # configuration of ours that no retry fixes; blamed on the environment, every episode
            # would end as ERROR in silence
            raise
        except Exception as e:  # the executor is closed or broken: infrastructure
            _settle(out, exc=InfrastructureError(f"code environment unavailable: {e!r}"))
            return
        fut.add_done_callback(lambda f: self._on_tool_result(f, call, out, attempt, t0))

    def _retry_tool(self, call, out: concurrent.futures.Future, attempt: int, t0: float) -> None:
        """A retry, on a timer thread: nothing above it would see an exception, so whatever fails
        ends the episode through ``out``."""
        try:
            self._submit_tool(call, out, attempt, t0)
        except BaseException as e:  # noqa: BLE001 - reported through the future the scheduler waits on
            _settle(out, exc=e)

    def _gave_up_on(self, out: concurrent.futures.Future) -> bool:
        """Has the scheduler stopped waiting for ``out`` (it cancels it) or the episode ended? Then
        a tool answer changes nothing: the trajectory is final. (Call with ``_lock`` held.)"""
        return self.done or out.done()

    def _on_tool_result(self, f: concurrent.futures.Future, call, out: concurrent.futures.Future,
                        attempt: int, t0: float) -> None:
        """Runs on an executor thread: never blocks (a retry is resubmitted from a timer thread)."""
        try:
            result = f.result()
            if getattr(result, "infra_error", False):
                if attempt < self.config.infra_retries:
                    with self._lock:
                        if self._gave_up_on(out):
                            return
                        self.infra_retries += 1
                    timer = threading.Timer(self.config.infra_retry_delay_s * (attempt + 1), self._retry_tool,
                                            args=(call, out, attempt + 1, t0))
                    timer.daemon = True
                    timer.start()
                    return
                raise InfrastructureError(f"code environment failed {attempt + 1} time(s): {result.text[:300]}")
            result = tool_result(result, self.fmt.tool_protocol)
            ids = self._tool_turn_ids(result)
            with self._lock:
                if self._gave_up_on(out):
                    return
                self.tool_wait_s += time.monotonic() - t0
                self._add_error(result)
            _settle(out, result=ids)
        except BaseException as e:  # executor failure, or our own: the episode ends as ERROR
            _settle(out, exc=e)

    def _count_error(self, outcome) -> None:
        with self._lock:
            self._add_error(outcome)

    def _add_error(self, outcome) -> None:
        """Count a failed call's error by kind (with ``_lock`` held)."""
        kind = classify_tool_error(outcome)
        if kind is not None:
            errs = self.traj.tool_errors
            setattr(errs, kind, getattr(errs, kind) + 1)

    def _tool_turn_ids(self, outcome) -> list[int]:
        text = format_tool_response(outcome, max_chars=self.config.max_tool_response_chars,
                                    protocol=self.fmt.tool_protocol)
        # an engine stopped at </tool_call> left the turn open; the official loop's turn ended
        # with the model's own <|im_end|>
        return encode_tool_response_turn(self.tokenizer, text, close_assistant_turn=self.fmt.stops_at_tool_call,
                                          fmt=self.fmt)


def official_turn_call(text: str, tool_names: tuple[str, ...], protocol: str = "paper", time_limit_s: float = 4.0):
    """The call the official loop runs after a turn (microsoft/rStar
    rstar2_agent/tools/tool_parser.py and rollout/rstar2_agent_loop.py): None unless the turn holds
    both "<tool_call>" and "</tool_call>" and at least one complete block; else the first block
    (verl's max_parallel_calls=1), parsed or, when malformed, a ToolCallError returned to the
    model as its tool response. protocol="code_judge" parses it as the official code does
    (env/code_judge.official_turn_call: its errors, its wrapper program with time_limit_s)."""
    if protocol == CODE_JUDGE:
        return code_judge.official_turn_call(text, time_limit_s)
    if TOOL_CALL_OPEN not in text or TOOL_CALL_CLOSE not in text:
        return None
    calls = parse_tool_calls(text, tool_names)
    return calls[0] if calls else None


def unterminated_call(text: str, tool_names: tuple[str, ...]) -> ToolCallError | None:
    """The parse error of a ``<tool_call>`` in a turn that ended without the ``</tool_call>`` stop
    (paper layout: the engine dispatches a call at that token, so such a call never runs), or None
    when the turn opened no call."""
    if TOOL_CALL_OPEN not in text:
        return None
    call = parse_tool_call(text, tool_names)
    if isinstance(call, ToolCallError):
        return call  # e.g. "Tool call is not terminated: ..."
    # a closing tag spelled in plain tokens, not the stop token: still not a call that ran
    return ToolCallError(f"Tool call is not terminated: expected the {TOOL_CALL_CLOSE} token.")


def fed_tokens(ids, logprobs, reason: DoneReason) -> tuple[list[int], list[float]]:
    """A turn's tokens and log-probs that belong to the trajectory. At a CONTEXT stop the slot was
    already full when the last token was sampled: that token could never be fed, and kept it
    would make prompt + response one longer than the slot (``max_len``)."""
    ids, logprobs = list(ids), list(logprobs)
    if reason == DoneReason.CONTEXT and len(ids) > 1:
        return ids[:-1], logprobs[:-1]
    return ids, logprobs


def _collect_rewards(episodes: Sequence[AgentEpisode], rollouts_end: float) -> dict[str, int]:
    """Fill ``traj.reward`` from each episode's verification, waiting for each at most until its
    own deadline: ``verify_wait_s`` after it was submitted, or after ``rollouts_end`` when that is
    later (a verification queued behind the batch's tool calls gets its full window once they
    are done; one batch-wide window would run out for the last ones in the queue). A
    verification that never answered, or answered with an infrastructure error, ends the episode
    as ``ERROR`` (excluded from the update); one the sandbox stopped at ``verify_timeout_s``
    scores 0 like a wrong answer."""
    counts = {"verify_timeouts": 0, "verify_infra_errors": 0}
    for ep in episodes:
        ep.traj.reward = 0.0
        if ep.verify_future is None:
            continue
        deadline = max(ep.verify_submitted, rollouts_end) + ep.config.verify_wait_s
        try:
            verdict = ep.verify_future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            verdict, why = None, f"the verifier did not answer within {ep.config.verify_wait_s:g} s"
        except Exception as e:  # the executor failed
            verdict, why = None, f"the verifier failed: {e!r}"
        else:  # a verifier the sandbox stopped at its time limit decided (reward 0), whatever it says why
            why = "" if getattr(verdict, "timed_out", False) else getattr(verdict, "error", "")
            if why:
                verdict, why = None, f"the verifier failed: {why}"
        if verdict is None:
            counts["verify_infra_errors"] += 1
            ep.traj.error = why
            ep.traj.finish = FinishReason.ERROR
            ep.traj.graded_text = None
            continue
        counts["verify_timeouts"] += int(bool(getattr(verdict, "timed_out", False)))
        ep.traj.reward = float(bool(verdict))
    return counts


def _scheduler_for(scheduler_or_engines, requests: Sequence[RolloutRequest], config: AgentConfig):
    """A given scheduler as is; engines given directly get a dynamic scheduler with
    ``max_rollout_len`` = the longest prompt + ``max_response_len`` (capped to the slot size)."""
    if hasattr(scheduler_or_engines, "run"):  # a RolloutScheduler (or one with its interface)
        return scheduler_or_engines
    engines = ([scheduler_or_engines] if isinstance(scheduler_or_engines, Engine)
               else list(scheduler_or_engines))
    longest = max((len(r.prompt_ids) for r in requests), default=1)
    return RolloutScheduler(
        engines, max_rollout_len=min(engines[0].max_len, longest + config.max_response_len),
        policy="dynamic", tool_timeout_s=config.tool_wait_s, timeout_s=config.rollout_timeout_s)


def run_rollouts(scheduler_or_engines: RolloutScheduler | Engine | Sequence[Engine], tokenizer,
                 executor, requests: Sequence[RolloutRequest], config: AgentConfig = AgentConfig(),
                 fmt: ChatFormat = RSTAR2) -> tuple[list[Trajectory], dict[str, float]]:
    """Run every request to a ``Trajectory`` (same order) with its reward; plus timings.

    Engines given directly get a dynamic scheduler (``_scheduler_for``)."""
    stops = StopIds.from_tokenizer(tokenizer, fmt)
    scheduler = _scheduler_for(scheduler_or_engines, requests, config)
    episodes = [AgentEpisode(r, tokenizer, executor, config, stops, fmt) for r in requests]
    _, timings = run_episodes(scheduler, episodes)
    return [ep.traj for ep in episodes], timings


def run_episodes(scheduler, episodes: Sequence[AgentEpisode], *, token_budget: int = 0,
                 carried: Sequence = (), keep_kv: bool = False) -> tuple[list, dict[str, float]]:
    """Drive ``episodes`` and ``carried`` (rollouts an earlier run paused, each ``.episode`` an
    ``AgentEpisode``) through ``scheduler``: to the end, or with ``token_budget`` > 0 until each
    has sampled that many tokens in this run (partial rollouts; ``keep_kv``: the paused ones
    keep their KV pages, ``RolloutScheduler.run``). Every episode that finished gets its reward. Returns the rollouts paused at the budget (the next run's ``carried``) and
    this run's timings."""
    touched = list(episodes) + [r.episode for r in carried]
    tool_wait_before = sum(ep.tool_wait_s for ep in touched)
    retries_before = sum(ep.infra_retries for ep in touched)
    t0 = time.perf_counter()
    budgeted = ({"token_budget": token_budget, "carried": carried, "keep_kv": keep_kv}
                if token_budget or carried else {})
    stats = scheduler.run(episodes, **budgeted)
    t1 = time.perf_counter()
    finished = [ep for ep in touched if ep.done]
    verify = _collect_rewards(finished, rollouts_end=time.monotonic())
    timings = {f"timing/rollout_{k}": v for k, v in stats.as_dict().items()}
    timings.update({
        "timing/rollout_s": t1 - t0,
        "timing/verify_wait_s": time.perf_counter() - t1,
        "timing/tool_exec_wait_s": float(sum(ep.tool_wait_s for ep in touched) - tool_wait_before),
        "rollout/verify_timeouts": float(verify["verify_timeouts"]),
        "rollout/verify_infra_errors": float(verify["verify_infra_errors"]),
        "rollout/infra_retries": float(sum(ep.infra_retries for ep in touched) - retries_before),
        # episodes ended by the infrastructure (excluded from training by the trainer)
        "rollout/infra_errors": float(sum(ep.traj.finish == FinishReason.ERROR for ep in finished)),
    })
    return list(getattr(stats, "paused", ())), timings


@dataclasses.dataclass
class RolloutRound:
    """One budgeted rollout run (``ColocatedRollouts.partial``): the trajectories that finished in
    it (new requests' and carried ones'), the rollouts it paused, its timings."""

    finished: list[Trajectory]
    paused: list
    timings: dict[str, float]


class ColocatedRollouts:
    """The ``RolloutFn`` of the recipes (``trajectory.RolloutFn``): (records, n per prompt, seed,
    policy version) -> (trajectories with ``group_id`` = record index, timings), on the paged
    engines of ``serving.colocated.ColocatedEngines`` over the trainer's devices (kimi k1.5 §4.2
    hybrid deployment: new params arrive in memory), sized from ``serving`` (refused, naming the
    flag, when one rollout of ``max_prompt_len + agent.max_response_len`` tokens cannot fit),
    and a code executor the caller owns."""

    def __init__(self, model, *, tokenizer, executor, agent: AgentConfig, sampling: SamplingParams,
                 max_prompt_len: int, fmt: ChatFormat = RSTAR2, serving: ServingConfig = ServingConfig(),
                 num_slots: int | None = None):
        """``num_slots`` (> 0) overrides ``serving.num_slots`` (evaluation and the demo)."""
        require_tool_timeout_fits(agent, fmt)  # before any engine is built
        self.agent_config = agent
        self.sampling = sampling
        self.max_prompt_len = int(max_prompt_len)
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.executor = executor
        self.serving = ColocatedEngines(
            model, serving=serving, max_len=self.max_prompt_len + agent.max_response_len,
            vocab_limit=len(self.tokenizer), tool_timeout_s=agent.tool_wait_s,
            timeout_s=agent.rollout_timeout_s, num_slots=num_slots)
        self.engines, self.engine = self.serving.engines, self.serving.engine
        self.scheduler = self.serving.scheduler

    @property
    def serving_dtype(self) -> str:
        """The dtype of the serving weights and KV pages (``ColocatedEngines.serving_dtype``)."""
        return self.serving.serving_dtype

    def update_params(self, model_or_state) -> None:
        """Serve new weights (``ColocatedEngines.update_params``)."""
        self.serving.update_params(model_or_state)

    def stage_params(self, model_or_state) -> list:
        """New weights' serving copies, made now, served by ``serve_staged`` (``ColocatedEngines``)."""
        return self.serving.stage_params(model_or_state)

    def serve_staged(self, staged: list) -> None:
        """Serve what ``stage_params`` made, between rollout rounds (``ColocatedEngines``)."""
        self.serving.serve_staged(staged)

    def release_memory(self) -> None:
        """Free the engines' serving copies and KV pools (``ColocatedEngines.release_memory``)."""
        self.serving.release_memory()

    def requests(self, records, n_per_prompt: int, seed: int, policy_version: int,
                 sampling: SamplingParams | None = None, group_ids: Sequence[int] | None = None
                 ) -> list[RolloutRequest]:
        """``n_per_prompt`` requests per record, seeded from ``seed`` and the record's position;
        ``group_ids`` (default the positions) label each record's group."""
        sampling = sampling or self.sampling
        group_ids = range(len(records)) if group_ids is None else list(group_ids)
        requests = []
        for g, (rec, gid) in enumerate(zip(records, group_ids, strict=True)):
            prompt = encode_prompt(self.tokenizer, rec["problem"], self.fmt)
            if len(prompt) > self.max_prompt_len:
                raise ValueError(f"prompt of record {g} has {len(prompt)} tokens > "
                                 f"max_prompt_len {self.max_prompt_len}")
            for j in range(n_per_prompt):
                sp = dataclasses.replace(sampling, seed=(seed * 1_000_003 + g * n_per_prompt + j) % (2**31 - 1))
                requests.append(RolloutRequest(prompt, str(rec["answer"]), int(gid), sp, policy_version,
                                               sample_index=j))
        return requests

    def __call__(self, records, n_per_prompt: int, seed: int, policy_version: int,
                 sampling: SamplingParams | None = None):
        """``sampling`` overrides the configured one for this call (e.g. greedy evaluation)."""
        requests = self.requests(records, n_per_prompt, seed, policy_version, sampling)
        return run_rollouts(self.scheduler, self.tokenizer, self.executor, requests,
                            self.agent_config, fmt=self.fmt)

    def partial(self, records, n_per_prompt: int, seed: int, policy_version: int, *, token_budget: int,
                carried: Sequence = (), group_ids: Sequence[int] | None = None,
                keep_kv: bool = True) -> RolloutRound:
        """Partial rollouts (Kimi k1.5 §2.6.2): continue ``carried`` (an earlier round's
        ``paused``) under ``policy_version``, start the requests of ``records`` (labelled
        ``group_ids``), and pause every rollout that samples ``token_budget`` tokens in this
        round. The carried rollouts decode on from the KV they kept (``keep_kv``, as slime and
        SkyRL do: the KV of their earlier tokens is the older weights'), or are re-prefilled
        under the weights served now (``keep_kv=False``; also whenever their pages were
        needed, e.g. ``serving.release_during_update``); their tokens from here on carry the
        new version (``Trajectory.version_starts``)."""
        stops = StopIds.from_tokenizer(self.tokenizer, self.fmt)
        episodes = [AgentEpisode(r, self.tokenizer, self.executor, self.agent_config, stops, self.fmt)
                    for r in self.requests(records, n_per_prompt, seed, policy_version, group_ids=group_ids)]
        for r in carried:
            r.episode.continue_under(policy_version, r.n_sampled)
        paused, timings = run_episodes(self.scheduler, episodes, token_budget=token_budget, carried=carried,
                                       keep_kv=keep_kv)
        finished = [ep.traj for ep in list(episodes) + [r.episode for r in carried] if ep.done]
        return RolloutRound(finished, paused, timings)
