"""benchmarks/simulate_pipeline.py: its event loop against step-by-step sums written out here."""
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import simulate_pipeline as sim  # noqa: E402

HW = sim.Hardware()
MODEL = sim.ModelShape.of("qwen3-1.7b", 4096)


def _rollout(decode, waits=(), prompt=100, tool=20, group=0):
    return sim.Rollout(group, list(decode), list(waits), tool, prompt)


def _step(context):
    return sim.decode_step_seconds(MODEL, HW, 1, context)


def test_one_row_costs_its_prefill_and_one_step_per_token_at_its_growing_context():
    r = _rollout([50])
    got = sim.run_rollouts([r], 1, 4, MODEL, HW, 1)
    want = sim.prefill_seconds(MODEL, HW, 1, 100) + sum(_step(100 + i) for i in range(50))
    assert got == pytest.approx(want, rel=1e-9)
    assert r.finished


def test_a_tool_wait_idles_the_row_and_its_output_is_extended_before_the_next_turn():
    r = _rollout([10, 5], waits=[7.0])
    got = sim.run_rollouts([r], 1, 4, MODEL, HW, 1)
    first = sum(_step(100 + i) for i in range(10))
    want = (sim.prefill_seconds(MODEL, HW, 1, 100) + first + sim.prefill_seconds(MODEL, HW, 1, 20)
            + 7.0 + sum(_step(130 + i) for i in range(5)))
    assert got == pytest.approx(want, rel=1e-9)


def test_two_rows_share_each_step():
    a, b = _rollout([30], prompt=10), _rollout([30], prompt=10)
    got = sim.run_rollouts([a, b], 1, 2, MODEL, HW, 1)
    want = 2 * sim.prefill_seconds(MODEL, HW, 1, 10) + sum(_step(2 * (10 + i)) for i in range(30))
    assert got == pytest.approx(want, rel=1e-9)


def test_a_full_slice_admits_from_the_queue_as_rows_finish():
    short, long_, late = _rollout([5]), _rollout([40]), _rollout([5])
    sim.run_rollouts([short, long_, late], 1, 2, MODEL, HW, 1)
    assert short.finished and long_.finished and late.finished
    one_row = sim.run_rollouts([_rollout([5]), _rollout([40]), _rollout([5])], 1, 1, MODEL, HW, 1)
    two_rows = sim.run_rollouts([_rollout([5]), _rollout([40]), _rollout([5])], 1, 2, MODEL, HW, 1)
    assert two_rows < one_row


def test_a_budget_pauses_a_rollout_and_the_next_call_continues_it_where_it_stopped():
    paused = _rollout([60, 40], waits=[0.0])
    calls = 0
    while not paused.finished:
        sim.run_rollouts([paused], 2, 2, MODEL, HW, 1, budget=25)
        calls += 1
        assert calls < 10
    assert calls == 4  # 100 model tokens in budgets of 25 (a turn boundary does not reset it)
    assert paused.slice_id >= 0 and paused.done_in_turn == 40


def test_a_budget_no_rollout_reaches_changes_nothing():
    w = sim.Workload(prompts=3, samples=4, max_response=2048, mean_response=600.0)
    plain = sim.sample_rollouts(w, np.random.default_rng(0))
    budgeted = sim.sample_rollouts(w, np.random.default_rng(0))
    a = sim.run_rollouts(plain, 2, 3, MODEL, HW, 1)
    b = sim.run_rollouts(budgeted, 2, 3, MODEL, HW, 1, budget=10_000)
    assert a == pytest.approx(b, rel=1e-12) and all(r.finished for r in budgeted)


def test_sampled_rollouts_fit_the_response_budget_and_the_turn_cap():
    w = sim.Workload(prompts=20, samples=8, max_response=1000, mean_response=900.0, max_turns=4)
    rollouts = sim.sample_rollouts(w, np.random.default_rng(1))
    assert len(rollouts) == 160
    assert max(r.total_tokens for r in rollouts) <= 1000
    assert max(len(r.decode) for r in rollouts) <= 4


def test_quick_run_prints_every_schedule_and_overlap_never_loses(capsys):
    out = sim.main(["--quick"])
    assert out["simulation"] is True
    for name in ("sync", "sync_disaggregated", "async", "partial", "async_partial"):
        assert out[name]["tokens_per_s"] > 0
    assert out["async"]["tokens_per_s"] >= out["sync_disaggregated"]["tokens_per_s"]
    assert '"bench": "simulate_pipeline"' in capsys.readouterr().out
