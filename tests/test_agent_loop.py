"""Agent loop against the real code environment, real tokenizer and real (tiny) model.

The policy is scripted: each request carries a fixed token stream that the engine
teacher-forces, so turns and tool calls are known; the engine still runs the model and reports
each token's log-prob, which is checked against the uncached training forward.
"""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.env import CodeExecutor, ExecResult, format_tool_response
from rstarjax.models.chat_template import COMPACT, encode_prompt, encode_tool_response_turn
from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.models.tokenizer import load_tokenizer
from rstarjax.recipes.config import as_flags
from rstarjax.rl.agent_loop import AgentConfig, RolloutRequest, run_rollouts
from rstarjax.rl.trajectory import FinishReason, SegmentKind
from rstarjax.serving import Engine, SamplingParams
from rstarjax.serving.scheduler import RolloutScheduler

MAX_LEN = 1024
TOOL = "execute_python_code_with_standard_io"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(486)  # 486 BPE ranks + 26 added tokens = vocab 512


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, vocab_size=512)
    return Qwen3(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, num_slots=4, max_len=MAX_LEN, buckets=(64, 256, MAX_LEN),
                  cache_dtype=jnp.float32)


@pytest.fixture(scope="module")
def executor():
    with CodeExecutor(num_workers=2) as ex:
        yield ex


def call(code, stdin=""):
    args = json.dumps({"code": code, "input": stdin})
    return f'<reason>run it</reason><tool_call>\n{{"name": "{TOOL}", "arguments": {args}}}\n</tool_call>'


ANSWER = "<reason>done</reason><answer>\\boxed{42}</answer><|im_end|>"


def request(tok, turns, gold="42", group=0):
    script = [i for t in turns for i in tok.encode(t)]
    return RolloutRequest(encode_prompt(tok, "What is 6*7?", COMPACT), gold, group,
                          SamplingParams(temperature=1.0, seed=group), script=script)


def tool_turn(tok, outcome):
    return encode_tool_response_turn(tok, format_tool_response(outcome, 2048),
                                     close_assistant_turn=True)


def check_tokens(tok, traj, turns, tool_outcomes):
    """Model segments = the script's turns; tool segments = the template around the outcome."""
    model_segs = [s for s in traj.segments if s.kind == SegmentKind.MODEL]
    tool_segs = [s for s in traj.segments if s.kind == SegmentKind.TOOL]
    assert [s.ids.tolist() for s in model_segs] == [tok.encode(t) for t in turns]
    assert [s.ids.tolist() for s in tool_segs] == [tool_turn(tok, o) for o in tool_outcomes]
    for s in tool_segs:
        assert s.ids[0] == tok.token_id("<|im_end|>")
    kinds = [s.kind for s in traj.segments]
    assert kinds == [SegmentKind.MODEL, SegmentKind.TOOL] * len(tool_segs) + [SegmentKind.MODEL]
    mask = traj.loss_mask
    assert mask.sum() == sum(len(s.ids) for s in model_segs)


@pytest.mark.slow  # ~30-50 s on 2 shared cores (compiles + sandboxed tool calls)
def test_episodes_with_real_tools(tok, model, engine, executor):
    cases = {
        "success": [call("print(6*7)"), ANSWER],
        "error_then_fix": [call("print(6*7/0)"), call("print(6*7)"), ANSWER],
        "timeout": [call("while True:\n    pass"), ANSWER],
        "malformed": ['<tool_call>\n{"name": "' + TOOL + '", "arguments": {"code": </tool_call>',
                      ANSWER],
        "no_tool_call": ["<reason>I guess</reason> 41<|im_end|>"],
        # A hostile program prints the boxed answer: the reward reads the model's text only.
        "hostile": [call("print('<ans' + 'wer>' + chr(92) + 'box' + 'ed{' + str(6*7) + '}</answer>')"),
                    "<reason>see above</reason><|im_end|>"],
    }
    reqs = [request(tok, turns, group=i) for i, turns in enumerate(cases.values())]
    cfg = AgentConfig(max_turns=5, max_response_len=MAX_LEN - 200, tool_timeout_s=1.0,
                      tool_wait_s=30.0)
    trajs, timings = run_rollouts(engine, tok, executor, reqs, cfg)
    by = dict(zip(cases, trajs))
    for name, t in by.items():
        assert t.group_id == list(cases).index(name)

    t = by["success"]
    assert (t.finish, t.reward, t.turns, t.tool_calls, t.tool_errors.total) == (
        FinishReason.ANSWERED, 1.0, 2, 1, 0)
    check_tokens(tok, t, cases["success"], [ExecResult("stdout", "42\n")])
    assert t.answer_tags == 1

    t = by["error_then_fix"]
    assert (t.finish, t.reward, t.tool_calls, t.tool_errors.execution, t.tool_errors.total) == (
        FinishReason.ANSWERED, 1.0, 2, 1, 1)
    assert "ZeroDivisionError" in t.response_text

    t = by["timeout"]
    assert (t.finish, t.reward, t.tool_errors.timeout, t.tool_errors.total) == (
        FinishReason.ANSWERED, 1.0, 1, 1)

    t = by["malformed"]
    assert (t.finish, t.tool_calls, t.tool_errors.parse, t.tool_errors.total) == (
        FinishReason.ANSWERED, 1, 1, 1)
    assert "not valid JSON" in t.response_text

    t = by["no_tool_call"]
    assert (t.finish, t.reward, t.turns, t.tool_calls) == (FinishReason.NO_TOOL_CALL, 0.0, 1, 0)
    check_tokens(tok, t, cases["no_tool_call"], [])

    t = by["hostile"]
    assert t.finish == FinishReason.NO_TOOL_CALL and t.reward == 0.0 and t.answer_tags == 0
    assert "\\boxed{42}" in t.response_text
    # what the verifier judged (and evaluation votes on): the model's turns, no program output
    assert t.graded_text == "".join(cases["hostile"]) and "boxed" not in t.graded_text
    assert by["success"].graded_text == "".join(cases["success"])

    # Sampled (here: forced) log-probs are the policy's under the uncached forward.
    t = by["error_then_fix"]
    ids = np.concatenate([t.prompt_ids, t.response_ids])
    logits = np.asarray(model(jnp.asarray(ids[None, :-1]))[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    p = len(t.prompt_ids)
    ref = logp[np.arange(p - 1, len(ids) - 1), ids[p:]]
    m = t.loss_mask.astype(bool)
    np.testing.assert_allclose(t.sampled_logprobs[m], ref[m], atol=1e-4)
    assert timings["timing/rollout_s"] > 0 and timings["rollout/infra_errors"] == 0


def test_max_turns_and_max_length(tok, engine, executor):
    many_calls = [call("print(1)"), call("print(2)"), call("print(3)"), ANSWER]
    trajs, _ = run_rollouts(engine, tok, executor, [request(tok, many_calls)],
                            AgentConfig(max_turns=2, max_response_len=300))
    t = trajs[0]
    assert (t.finish, t.turns, t.tool_calls, t.reward) == (FinishReason.MAX_TURNS, 2, 1, 0.0)
    check_tokens(tok, t, many_calls[:2], [ExecResult("stdout", "1\n")])

    # A budget that the first turn + tool response leave almost exhausted.
    first = len(tok.encode(many_calls[0]))
    budget = first + len(tool_turn(tok, ExecResult("stdout", "1\n"))) + 5
    trajs, _ = run_rollouts(engine, tok, executor, [request(tok, many_calls)],
                            AgentConfig(max_turns=10, max_response_len=budget))
    t = trajs[0]
    assert t.finish == FinishReason.MAX_LENGTH and t.truncated and t.reward == 0.0
    assert t.graded_text is None  # cut at its length: scored 0 unverified
    assert len(t.response_ids) == budget
    assert t.segments[-1].kind == SegmentKind.MODEL and len(t.segments[-1].ids) == 5

    # The tool response itself does not fit: truncated before appending it, and the call is
    # not run (it was, its output discarded); at the closing tag's own token too.
    for room in (3, 0):
        counting = FlakyExecutor(executor)
        trajs, _ = run_rollouts(engine, tok, counting, [request(tok, many_calls)],
                                AgentConfig(max_turns=10, max_response_len=first + room))
        t = trajs[0]
        assert t.finish == FinishReason.MAX_LENGTH and len(t.segments) == 1
        assert (counting.submitted, t.tool_calls) == (0, 0), room


def test_static_and_dynamic_schedulers_agree(tok, model, engine, executor):
    """Same trajectories whatever the policy or slice count (scripted + seeded: deterministic)."""
    turns = [[call(f"print({i}*7)"), ANSWER] for i in range(5)] + [[ANSWER]] * 3
    reqs = [request(tok, tt, gold=str(42), group=i) for i, tt in enumerate(turns)]
    engine2 = Engine(model, num_slots=4, max_len=MAX_LEN, buckets=(64, 256, MAX_LEN),
                     cache_dtype=jnp.float32)
    cfg = AgentConfig(max_turns=4, max_response_len=300)
    outs = []
    for policy in ("dynamic", "static"):
        sched = RolloutScheduler([engine, engine2], max_rollout_len=MAX_LEN, policy=policy)
        trajs, timings = run_rollouts(sched, tok, executor, reqs, cfg)
        outs.append(trajs)
        assert timings["timing/rollout_makespan_s"] > 0
    for a, b in zip(*outs):
        assert a.response_ids.tolist() == b.response_ids.tolist()
        np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=1e-5)
        assert (a.finish, a.reward, a.group_id) == (b.finish, b.reward, b.group_id)
    assert [t.reward for t in outs[0]] == [1.0] * 8  # every script answers \\boxed{42}


def test_trainer_rollout_hook_samples_real_episodes(tok, model, executor):
    """ColocatedRollouts / update_params as the RL recipe builds and calls them (sampling, not
    scripted), configured from the base config's rl and serving sections."""
    import importlib.util
    import pathlib

    from rstarjax.rl import agent_loop
    from rstarjax.rl.config import RLConfig

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "base.py"
    spec = importlib.util.spec_from_file_location("base_config", path)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    config = base.get_config()
    config.rl.max_prompt_len, config.rl.max_response_len, config.rl.max_turns = 256, 48, 3
    rl = RLConfig(**dict(config.rl))

    def rollouts(**kwargs):
        return agent_loop.ColocatedRollouts(model, tokenizer=tok, executor=executor, agent=rl.agent(),
                                            sampling=rl.sampling(), max_prompt_len=rl.max_prompt_len,
                                            fmt=COMPACT, serving=agent_loop.ServingConfig(**dict(config.serving)),
                                            **kwargs)

    fn = rollouts(num_slots=4)
    records = [{"problem": "What is 6*7?", "answer": "42"}, {"problem": "1+1?", "answer": "2"}]
    trajs, timings = fn(records, 3, 11, 5)
    assert [t.group_id for t in trajs] == [0, 0, 0, 1, 1, 1]
    assert all(t.policy_version == 5 and t.turns >= 1 for t in trajs)
    assert all(len(t.response_ids) <= 48 and t.loss_mask[0] == 1.0 for t in trajs)
    assert len({tuple(t.response_ids.tolist()) for t in trajs}) > 1  # seeded, not identical
    assert "timing/rollout_s" in timings
    other = Qwen3(model.config, rngs=nnx.Rngs(3))
    fn.update_params(other)  # the engine's serving copy now holds the new weights
    np.testing.assert_array_equal(np.asarray(fn.engine.params.embed), np.asarray(other.embed[...]))
    # A pool that cannot hold one rollout of max_prompt_len + max_response_len is refused at
    # start, naming the flag that fixes it (the setting, which the recipes print as its flag).
    config.serving.kv_pages = 3
    with pytest.raises(ValueError) as refused:
        rollouts()
    assert "--config.serving.kv_pages" in as_flags(str(refused.value))


# ---- infrastructure errors are the environment's, not the model's --------------------------------
class FlakyExecutor:
    """The real executor behind switches: the first ``infra_failures`` tool calls come back as the
    pool's infrastructure answer (as for a dead worker); results arrive ``delay_s`` late; the
    verifications of the gold answers in ``hang_verify`` never answer."""

    def __init__(self, real, infra_failures=0, delay_s=0.0, hang_verify=()):
        import threading

        self.real, self.left, self.delay_s, self.hang_verify = real, infra_failures, delay_s, hang_verify
        self.lock = threading.Lock()
        self.submitted = 0

    def submit(self, code, stdin="", timeout=None):
        import concurrent.futures
        import threading

        with self.lock:
            self.submitted += 1
            fail, self.left = self.left > 0, self.left - (self.left > 0)
        out = concurrent.futures.Future()
        if fail:
            out.set_result(ExecResult("error", "SandboxError: worker died", infra_error=True))
            return out
        real = self.real.submit(code, stdin, timeout)
        if not self.delay_s:
            return real
        timer = threading.Timer(self.delay_s, lambda: out.set_result(real.result(timeout=120)))
        timer.daemon = True
        timer.start()
        return out

    def submit_verify(self, response_text, gold, timeout=None, mode="answer"):
        import concurrent.futures

        if gold in self.hang_verify:
            return concurrent.futures.Future()  # never answers
        return self.real.submit_verify(response_text, gold, timeout, mode)


SUCCESS = [call("print(6*7)"), ANSWER]


def test_infrastructure_failures_are_retried_and_never_shown_to_the_model(tok, engine, executor):
    flaky = FlakyExecutor(executor, infra_failures=2)
    trajs, timings = run_rollouts(engine, tok, flaky, [request(tok, SUCCESS)],
                                  AgentConfig(max_turns=3, max_response_len=300, infra_retries=2,
                                              infra_retry_delay_s=0.05))
    t = trajs[0]
    assert (t.finish, t.reward, t.tool_errors.total) == (FinishReason.ANSWERED, 1.0, 0)
    assert "SandboxError" not in t.response_text and flaky.submitted == 3
    check_tokens(tok, t, SUCCESS, [ExecResult("stdout", "42\n")])
    assert timings["rollout/infra_retries"] == 2 and timings["rollout/infra_errors"] == 0


def test_persistent_infrastructure_failure_ends_the_episode_as_an_infra_error(tok, engine, executor):
    flaky = FlakyExecutor(executor, infra_failures=3)
    trajs, timings = run_rollouts(engine, tok, flaky, [request(tok, SUCCESS)],
                                  AgentConfig(max_turns=3, max_response_len=300, infra_retries=2,
                                              infra_retry_delay_s=0.05))
    t = trajs[0]
    assert t.finish == FinishReason.ERROR and t.infra_error and t.reward == 0.0
    assert "code environment failed 3 time(s)" in t.error
    assert t.tool_errors.total == 0 and "SandboxError" not in t.response_text  # not the model's error
    assert timings["rollout/infra_errors"] == 1


def test_a_tool_call_the_scheduler_gave_up_on_ends_cleanly(tok, engine, executor, caplog):
    """The scheduler cancels a tool future it stopped waiting for; the late answer is dropped
    (no InvalidStateError in the executor's callback) and the episode is an infra error."""
    import logging
    import time

    flaky = FlakyExecutor(executor, delay_s=1.5)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        trajs, _ = run_rollouts(engine, tok, flaky, [request(tok, SUCCESS)],
                                AgentConfig(max_turns=3, max_response_len=300, tool_wait_s=0.3))
        time.sleep(2.0)  # the late answer arrives
    t = trajs[0]
    assert t.finish == FinishReason.ERROR and "did not return within" in t.error
    assert not [r for r in caplog.records if "exception calling callback" in r.getMessage()], caplog.text


def test_each_episode_has_its_own_verify_deadline(tok, engine, executor):
    """A verification that never answers ends its episode as an infrastructure error (not reward
    0 for the model); the other episodes are verified as usual."""
    flaky = FlakyExecutor(executor, hang_verify=("43",))
    reqs = [request(tok, [ANSWER], gold="42", group=0), request(tok, [ANSWER], gold="43", group=1)]
    trajs, timings = run_rollouts(engine, tok, flaky, reqs,
                                  AgentConfig(max_turns=2, max_response_len=300, verify_timeout_s=0.5,
                                              verify_wait_s=1.0))
    assert (trajs[0].finish, trajs[0].reward) == (FinishReason.ANSWERED, 1.0)
    assert trajs[1].finish == FinishReason.ERROR and "verifier did not answer" in trajs[1].error
    assert timings["rollout/verify_infra_errors"] == 1 and timings["rollout/infra_errors"] == 1


def test_colocated_rollouts_over_tensor_parallel_slices(tok, model, executor):
    """``serving.tensor_parallel = 4, slices_per_host = 2``: two engines, each on a TP-4 mesh of
    its own devices, share the rollouts (admission by free pages, unchanged) and sample the
    same greedy trajectories as the one engine of ``tensor_parallel = 0``."""
    from rstarjax.rl.agent_loop import ColocatedRollouts
    from rstarjax.serving.colocated import ServingConfig

    agent = AgentConfig(max_turns=2, max_response_len=32)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)

    def rollouts(**serving):
        return ColocatedRollouts(model, tokenizer=tok, executor=executor, agent=agent,
                                 sampling=greedy, max_prompt_len=256, fmt=COMPACT, num_slots=4,
                                 serving=ServingConfig(**serving))

    records = [{"problem": "What is 6*7?", "answer": "42"}, {"problem": "1+1?", "answer": "2"}]
    one = rollouts()
    sliced = rollouts(tensor_parallel=4, slices_per_host=2)
    assert len(one.engines) == 1 and len(sliced.engines) == 2
    assert [sorted(d.id for d in e.mesh.devices.flat) for e in sliced.engines] == [[0, 1, 2, 3],
                                                                                  [4, 5, 6, 7]]
    want, _ = one(records, 3, 0, 0)
    got, _ = sliced(records, 3, 0, 0)
    for a, b in zip(got, want):
        assert a.response_ids.tolist() == b.response_ids.tolist()
        np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=1e-4)
    assert all(e.generated_tokens > 0 for e in sliced.engines)  # both slices served rollouts
    sliced.update_params(Qwen3(model.config, rngs=nnx.Rngs(3)))  # every slice gets new weights
    assert all(e.params.layers[0]["q_proj"].sharding.mesh == e.mesh for e in sliced.engines)


def test_official_layout_episodes(tok, engine, executor):
    """The official loop's protocol (issue #27; microsoft/rStar rstar2_agent/rollout/rstar2_agent_loop.py):
    decoding runs past </tool_call> to <|im_end|>, the first complete call of the turn is run (a
    malformed one answered as a tool response), the tool turn follows the model's <|im_end|>
    directly and ends with the <reason> prefill; reward.mode=official scores the whole text. The
    official layout with a short system prompt (the test model's budget)."""
    import dataclasses

    from rstarjax.models.chat_template import RSTAR2_OFFICIAL

    fmt = dataclasses.replace(RSTAR2_OFFICIAL, system_prompt="Use python_code_with_standard_io.")
    name = "python_code_with_standard_io"

    def official_call(code):
        args = json.dumps({"code": code, "input": ""})
        return f'run it</reason>\n<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'

    cases = {
        "success": [official_call("print(6*7)"), "done</reason><answer>\\boxed{42}</answer><|im_end|>"],
        "malformed": ['x</reason>\n<tool_call>\n{"name": "' + name + '", </tool_call> more<|im_end|>',
                      "done</reason><answer>\\boxed{41}</answer><|im_end|>"],
        # a program prints the box: the official reward reads the whole response, tool output included
        "printed": [official_call("print(chr(92) + 'boxed{42}')"), "see above</reason><|im_end|>"],
    }
    reqs = [RolloutRequest(encode_prompt(tok, "What is 6*7?", fmt), "42", i,
                           SamplingParams(temperature=1.0, seed=i), script=[j for t in turns for j in tok.encode(t)])
            for i, turns in enumerate(cases.values())]
    cfg = AgentConfig(max_turns=5, max_response_len=MAX_LEN - 200, tool_timeout_s=2.0, tool_wait_s=30.0,
                      reward_mode="official")
    trajs, _ = run_rollouts(engine, tok, executor, reqs, cfg, fmt)
    by = dict(zip(cases, trajs))
    for case, t in by.items():
        model_segs = [s.ids.tolist() for s in t.segments if s.kind == SegmentKind.MODEL]
        assert model_segs == [tok.encode(x) for x in cases[case]]  # each turn ran to its <|im_end|>
        tool = [s for s in t.segments if s.kind == SegmentKind.TOOL]
        assert len(tool) == 1 and tok.decode(tool[0].ids).startswith("<|im_start|>user\n<tool_response>\n")
        assert tok.decode(tool[0].ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>")
    assert (by["success"].finish, by["success"].reward, by["success"].tool_calls) == (FinishReason.ANSWERED, 1.0, 1)
    assert by["malformed"].tool_errors.parse == 1 and by["malformed"].reward == 0.0
    assert "Failed to decode tool call: " in by["malformed"].response_text  # the official text (issue #50)
    assert (by["printed"].finish, by["printed"].reward) == (FinishReason.NO_TOOL_CALL, 1.0)
    assert "\\boxed{42}" in by["printed"].graded_text  # the official reward's text: tool output included


def test_the_reward_mode_reaches_the_verifier(tok, engine, executor):
    """A box written outside any <answer> block: no answer under the paper's reward (eq. 3 reads
    the box in <answer>), the answer under reward.mode=boxed."""
    turns = ["<reason>so it is \\boxed{42}</reason><|im_end|>"]
    rewards = {}
    for mode in ("answer", "boxed"):
        cfg = AgentConfig(max_turns=2, max_response_len=MAX_LEN - 200, reward_mode=mode)
        trajs, _ = run_rollouts(engine, tok, executor, [request(tok, turns)], cfg)
        rewards[mode] = trajs[0].reward
    assert rewards == {"answer": 0.0, "boxed": 1.0}


# ---- edges the scheduler reaches -----------------------------------------------------------------
class AnsweredByTheTest:
    """Tool calls answered with ``result``: at once, or (``held``) only when the test calls
    ``answer_all``; verifications at once (correct)."""

    def __init__(self, result, held=True):
        import concurrent.futures

        self.result, self.held, self.pending, self.futures = result, held, [], concurrent.futures

    def submit(self, code, stdin="", timeout=None):
        fut = self.futures.Future()
        self.pending.append(fut)
        if not self.held:
            fut.set_result(self.result)
        return fut

    def answer_all(self):
        for fut in self.pending:
            fut.set_result(self.result)

    def submit_verify(self, response_text, gold, timeout=None, mode="answer"):
        from rstarjax.env.results import VerifyResult

        fut = self.futures.Future()
        fut.set_result(VerifyResult(True))
        return fut


def test_a_tool_answer_after_the_scheduler_gave_up_leaves_the_trajectory_as_it_was(tok, engine):
    """The scheduler stops waiting (tool_wait_s) and ends the episode as ERROR; the sandbox's
    answer, a timeout, comes after run_rollouts returned: the returned trajectory stays as it was."""
    late = AnsweredByTheTest(ExecResult("timeout", "TimeoutError: execution exceeded the 5 s time limit"))
    trajs, timings = run_rollouts(engine, tok, late, [request(tok, SUCCESS)],
                                  AgentConfig(max_turns=3, max_response_len=300, tool_wait_s=0.3))
    t = trajs[0]
    before = (t.finish, t.error, dict(vars(t.tool_errors)), t.tool_calls, len(t.segments))
    assert t.finish == FinishReason.ERROR and "did not return within" in t.error
    late.answer_all()
    assert (t.finish, t.error, dict(vars(t.tool_errors)), t.tool_calls, len(t.segments)) == before
    assert t.tool_errors.total == 0 and timings["rollout/infra_errors"] == 1


def test_prompt_and_response_never_exceed_the_slot(tok, model):
    """An engine whose slot is shorter than prompt + max_response_len (no rollout length cap: the
    slot's end is it). A tool response that leaves room for exactly one more token, and a first
    turn that runs into the slot's end: each ends with prompt + response == max_len, not one more
    (the token sampled when the slot was full was never fed)."""
    output = "B " * 40
    tool_ids = tool_turn(tok, ExecResult("stdout", output))
    first = call("X")
    prompt = len(request(tok, [first]).prompt_ids)
    max_len = prompt + len(tok.encode(first)) + len(tool_ids) + 1
    small = Engine(model, num_slots=2, max_len=max_len, buckets=(64, max_len), cache_dtype=jnp.float32)
    tools = AnsweredByTheTest(ExecResult("stdout", output), held=False)
    long_first_turn = "<reason>" + "a " * max_len
    reqs = [request(tok, [first, ANSWER], group=0), request(tok, [long_first_turn], group=1)]
    trajs, _ = run_rollouts(small, tok, tools, reqs,
                            AgentConfig(max_turns=3, max_response_len=2 * max_len, tool_timeout_s=1.0))
    for t in trajs:
        assert t.finish == FinishReason.MAX_LENGTH, t.finish
        assert len(t.prompt_ids) + len(t.response_ids) == max_len, (len(t.prompt_ids), len(t.response_ids))
    assert [s.kind for s in trajs[0].segments] == [SegmentKind.MODEL, SegmentKind.TOOL, SegmentKind.MODEL]
