"""Trainer: micro-batched and sharded updates against an independent full-batch reference."""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from rstarjax.models import sharding as sharding_lib
from rstarjax.models.config import ModelConfig
from rstarjax.models.qwen3 import Qwen3
from rstarjax.rl import optim as optim_lib
from rstarjax.rl import trainer as trainer_lib
from rstarjax.rl.loss import LossConfig

B, L, PROMPT = 8, 24, 6


def tiny_model(seed=0):
    # f32 compute so the comparisons are tight; one layer keeps the compiles short
    cfg = ModelConfig.preset("tiny", dtype=jnp.float32, num_hidden_layers=1)
    return Qwen3(cfg, rngs=nnx.Rngs(seed))


def random_batch(seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(B, L)).astype(np.int32)
    lengths = rng.integers(PROMPT + 4, L + 1, size=B)
    col = np.arange(L)[None, :]
    valid = col < lengths[:, None]
    loss_mask = (valid & (col >= PROMPT)).astype(np.float32)
    loss_mask[:, PROMPT + 2] = 0.0  # a tool token in the middle of every response
    adv = np.where(rng.random(B) < 0.5, 1.0, -0.7)[:, None] * loss_mask
    # old log-probs away from the current policy so both clip branches are exercised
    old = (-6.2 + rng.normal(0, 0.4, size=(B, L))) * loss_mask
    return dict(
        tokens=tokens,
        positions=np.where(valid, col, 0).astype(np.int32),
        segment_ids=valid.astype(np.int32),
        loss_mask=loss_mask,
        old_logprobs=old.astype(np.float32),
        advantages=adv.astype(np.float32),
        rollout_logprobs=old.astype(np.float32),
    )


def reference_loss(model, batch, eps_low=0.2, eps_high=0.28, temperature=1.0):
    """rStar2-Agent eq. 6 transcribed directly over the whole batch (no micro-batching):
    -1/sum|o_i| sum_i sum_t min(r A, clip(r, 1-el, 1+eh) A), r = exp(logp - old); logp of the
    logits divided by the rollouts' ``temperature``."""
    logits = model(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                   segment_ids=jnp.asarray(batch["segment_ids"])) / temperature
    logp_all = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    tgt = jnp.asarray(batch["tokens"])[:, 1:]
    logp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
    mask = jnp.asarray(batch["loss_mask"])[:, 1:]
    adv = jnp.asarray(batch["advantages"])[:, 1:]
    old = jnp.asarray(batch["old_logprobs"])[:, 1:]
    ratio = jnp.exp(logp - old)
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    return -jnp.sum(obj * mask) / jnp.sum(mask)


def reference_sgd_params(batch, lr, temperature=1.0):
    model = tiny_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.grad(lambda p: reference_loss(nnx.merge(graphdef, p, rest), batch,
                                              temperature=temperature))(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), grads


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def logprob_gap(sampled, recomputed, mask):
    """The sampler / trainer log-prob mismatch in NumPy float64 (the reference for the trainer's
    on-device figures): mean |d|, and the mean k3 estimate exp(d) - 1 - d, d = trainer - sampler."""
    mask = np.asarray(mask, np.float64)
    n = max(mask.sum(), 1.0)
    d = (np.asarray(recomputed, np.float64) - np.asarray(sampled, np.float64)) * mask
    return {"logprob_gap_abs": float(np.abs(d).sum() / n),
            "logprob_gap_kl": float(((np.exp(d) - 1.0 - d) * mask).sum() / n)}


@pytest.mark.slow
def test_micro_batched_sharded_step_equals_full_batch_reference():
    """4 micro-batches on an 8-device (fsdp=4, tensor=2) mesh == eq. 6's full-batch gradient."""
    batch = random_batch()
    lr = 1.0  # plain SGD makes the parameter change equal the gradient
    ref_params, ref_grads = reference_sgd_params(batch, lr)
    assert max(float(np.abs(g).max()) for g in leaves(ref_grads)) > 1e-4  # a real gradient

    mesh = sharding_lib.make_mesh(1, 4, 2)
    tr = trainer_lib.Trainer(tiny_model(), None, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=False),
                             mesh=mesh, optimizer=optax.sgd(lr))
    metrics = tr.train(batch)
    assert tr.step == 1
    for got, want, g in zip(leaves(tr.state.params), leaves(ref_params), leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))
    # metrics summed over micro-batches are whole-batch quantities
    assert metrics["train/token_frac"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/tokens"] == pytest.approx(batch["loss_mask"].sum())
    ref_loss = float(reference_loss(tiny_model(), batch))
    assert metrics["train/loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert metrics["train/clip_frac_low"] + metrics["train/clip_frac_high"] > 0


@pytest.mark.slow
def test_sharded_adamw_steps_equal_single_device():
    """Two AdamW updates with old-log-prob recompute: 8 devices (data=2, fsdp=2, tensor=2) give the
    parameters of a 1-device run."""
    batches = [random_batch(1), random_batch(2)]
    optim_cfg = optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=2)
    cfg = trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=True)
    single = trainer_lib.Trainer(tiny_model(), optim_cfg, LossConfig(), cfg,
                                 mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    multi = trainer_lib.Trainer(tiny_model(), optim_cfg, LossConfig(), cfg,
                                mesh=sharding_lib.make_mesh(2, 2, 2))
    for b in batches:
        m1 = single.train(b)
        m8 = multi.train(b)
        assert m1["train/grad_norm"] == pytest.approx(m8["train/grad_norm"], rel=1e-4)
        assert m1["train/logprob_gap_abs"] == pytest.approx(m8["train/logprob_gap_abs"], rel=1e-4)
    assert single.step == multi.step == 2
    assert m8["train/lr"] == pytest.approx(1e-3)
    for a, b in zip(leaves(single.state.params), leaves(multi.state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # lr 1e-3: 2% of one update
    # sharded for real: some parameter is split over devices
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(multi.state.params))


def test_the_trainer_optimises_the_policy_at_the_rollout_temperature():
    """logit_temperature=T: the recomputed log-probs are log_softmax(logits / T) (torch) and one
    SGD update of eq. 6 equals the reference's at T, which differs from the one at T=1."""
    batch = random_batch(4)
    t, lr = 0.7, 1.0
    tr = trainer_lib.Trainer(tiny_model(), None, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=4, recompute_old_logprobs=False),
                             mesh=sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2]),
                             optimizer=optax.sgd(lr), logit_temperature=t)
    lp = np.asarray(tr.compute_logprobs(tr.put_batch(batch)))
    logits = tiny_model()(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                          segment_ids=jnp.asarray(batch["segment_ids"]))
    ref = torch.log_softmax(torch.tensor(np.asarray(logits[:, :-1], np.float64)) / t, -1).gather(
        -1, torch.tensor(batch["tokens"][:, 1:], dtype=torch.long)[..., None])[..., 0].numpy()
    np.testing.assert_allclose(lp[:, 1:], ref, rtol=1e-5, atol=1e-5)
    tr.train(batch)
    want, grads = reference_sgd_params(batch, lr, temperature=t)
    untempered, _ = reference_sgd_params(batch, lr)
    tol = 2e-5 * max(1.0, max(float(np.abs(g).max()) for g in leaves(grads)))
    for got, w in zip(leaves(tr.state.params), leaves(want)):
        np.testing.assert_allclose(got, w, rtol=2e-4, atol=tol)
    assert max(float(np.abs(a - b).max()) for a, b in zip(leaves(want), leaves(untempered))) > 10 * tol
    with pytest.raises(ValueError, match="logit_temperature"):
        trainer_lib.Trainer(tiny_model(), None, LossConfig(), trainer_lib.TrainerConfig(),
                            optimizer=optax.sgd(lr), logit_temperature=0.0)


def test_recompute_old_logprobs_matches_forward_and_gap_is_reported():
    batch = random_batch(3)
    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=2),
                             mesh=sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    g = tr.put_batch(batch)
    lp = np.asarray(tr.compute_logprobs(g))
    logits = tiny_model()(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                          segment_ids=jnp.asarray(batch["segment_ids"]))
    ref = torch.log_softmax(torch.tensor(np.asarray(logits[:, :-1])), -1).gather(
        -1, torch.tensor(batch["tokens"][:, 1:], dtype=torch.long)[..., None])[..., 0].numpy()
    np.testing.assert_allclose(lp[:, 1:], ref, rtol=1e-5, atol=1e-5)
    want = logprob_gap(batch["rollout_logprobs"], lp, batch["loss_mask"])
    m = tr.train(batch)
    assert m["train/logprob_gap_abs"] == pytest.approx(want["logprob_gap_abs"], rel=1e-5)
    assert m["train/logprob_gap_kl"] == pytest.approx(want["logprob_gap_kl"], rel=1e-4)
    # recomputed old log-probs == current policy: the first update's ratio is exactly 1
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["train/clip_frac_low"] == m["train/clip_frac_high"] == 0.0


@pytest.mark.parametrize("from_zero,updates_per_step", [(False, 1), (True, 1), (True, 2)])
def test_optimizer_matches_torch_adamw_with_clip_and_warmup(from_zero, updates_per_step):
    """optax chain == torch clip_grad_norm_ + AdamW + LambdaLR warmup, over 6 updates. The
    scheduler steps once per rollout step (after its ``updates_per_step`` updates), as verl's
    ``update_actor`` does; ``warmup_from_zero`` is verl's get_constant_schedule_with_warmup
    (rate k / warmup at rollout step k), the paper default starts one step further on."""
    cfg = optim_lib.OptimConfig(learning_rate=1e-2, warmup_steps=3, weight_decay=0.01, grad_clip_norm=1.0,
                                warmup_from_zero=from_zero)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [rng.normal(scale=s, size=(5, 3)).astype(np.float32) for s in (3.0, 0.1, 2.0, 0.5, 1.0, 0.3)]

    opt = optim_lib.make_optimizer(cfg, updates_per_step)
    w, state = jnp.asarray(w0), opt.init(jnp.asarray(w0))
    for g in grads:
        upd, state = opt.update(jnp.asarray(g), state, w)
        w = optax.apply_updates(w, upd)

    tw = torch.nn.Parameter(torch.tensor(w0))
    topt = torch.optim.AdamW([tw], lr=cfg.learning_rate, betas=(cfg.b1, cfg.b2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)
    first = 0 if from_zero else 1
    sched = torch.optim.lr_scheduler.LambdaLR(topt, lambda k: min(1.0, (k + first) / cfg.warmup_steps))
    rates = []
    for i, g in enumerate(grads):
        tw.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_norm_([tw], cfg.grad_clip_norm)
        rates.append(topt.param_groups[0]["lr"])
        topt.step()
        if (i + 1) % updates_per_step == 0:
            sched.step()
    np.testing.assert_allclose(np.asarray(w), tw.detach().numpy(), rtol=1e-5, atol=1e-7)
    schedule = optim_lib.lr_schedule(cfg, updates_per_step)
    np.testing.assert_allclose([float(schedule(i)) for i in range(len(grads))], rates, rtol=1e-6)
    assert (rates[0] == 0.0) == from_zero


def test_bad_shapes_fail_clearly():
    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=3),
                             mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    with pytest.raises(ValueError, match="micro_batch_size"):
        tr.train(random_batch())
    bad = random_batch()
    bad["advantages"] = bad["advantages"][:, :-1]
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        tr.put_batch(bad)
    with pytest.raises(ValueError, match="mini_batches"):
        trainer_lib.TrainerConfig(mini_batches=0)


# ------------------------------------------------------------------ metrics (pure functions)
def _traj(reward, calls, errors, tags, finish="answered", model_len=3, tool_len=2, group=0, turns=2):
    from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, ToolErrorCounts, Trajectory

    segs = [Segment(SegmentKind.MODEL, np.ones(model_len), np.zeros(model_len))]
    if tool_len:
        segs.append(Segment(SegmentKind.TOOL, np.ones(tool_len)))
    return Trajectory(prompt_ids=np.ones(4), segments=segs, turns=turns, tool_calls=calls,
                      tool_errors=ToolErrorCounts(parse=errors // 2, execution=errors - errors // 2),
                      answer_tags=tags, finish=FinishReason(finish), reward=reward, group_id=group)


def test_rollout_metrics_by_hand():
    from rstarjax.rl import metrics as M

    trajs = [
        _traj(1.0, calls=4, errors=1, tags=1, model_len=3, tool_len=2),  # len 5
        _traj(1.0, calls=0, errors=0, tags=2, model_len=6, tool_len=0),  # len 6
        _traj(0.0, calls=2, errors=2, tags=0, finish="max_length", model_len=9, tool_len=1),  # len 10
    ]
    m = M.rollout_metrics(trajs, prefix="")
    assert m["reward_mean"] == pytest.approx(2 / 3)
    assert m["response_length_mean"] == pytest.approx(7.0) and m["response_length_max"] == 10
    assert m["model_tokens_mean"] == pytest.approx(6.0)
    assert m["truncation_ratio"] == pytest.approx(1 / 3)
    assert m["tool_calls_mean"] == pytest.approx(2.0)
    assert m["tool_call_rate"] == pytest.approx(2 / 3)  # the second response made no call
    assert m["tool_error_ratio"] == pytest.approx(3 / 6)
    assert m["tool_error_ratio_positive"] == pytest.approx(1 / 4)  # Fig. 4: positives only
    assert m["positives_with_tool_error"] == pytest.approx(1 / 2)  # one of the two positives had a failed call
    assert m["format_violation_ratio"] == pytest.approx(2 / 3)  # 0 tags and 2 tags
    r = M.roc_metrics(trajs, trajs[1:])
    assert r["roc/tool_error_ratio_positive_before"] == pytest.approx(0.25)
    assert r["roc/tool_error_ratio_positive_after"] == 0.0  # the only positive left made no call
    assert r["roc/kept_fraction"] == pytest.approx(2 / 3)
    g = M.group_metrics([_traj(1, 0, 0, 1, group=0), _traj(1, 0, 0, 1, group=0),
                         _traj(0, 0, 0, 1, group=1), _traj(1, 0, 0, 1, group=1),
                         _traj(0, 0, 0, 1, group=2)], prefix="")
    assert g == {"groups_all_correct": pytest.approx(1 / 3), "groups_all_wrong": pytest.approx(1 / 3)}
    t = M.throughput_metrics(300, {"rollout": 2.0, "train": 1.0})
    assert t["perf/tokens_per_second"] == pytest.approx(100.0) and t["time/step"] == 3.0


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    from rstarjax.io import metrics_log as M

    with M.MetricsWriter(str(tmp_path)) as w:
        w.write(1, {"a": 1.5, "b": float("nan")})
        w.write(2, {"a": np.float32(2.5)})
    recs = M.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["a"]) for r in recs] == [(1, 1.5), (2, 2.5)] and recs[0]["b"] == "nan"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


# ------------------------------------------------------------------ stage-3 filter (§4.3)
def test_stage3_filter_drops_only_problems_solved_k_of_k(tmp_path):
    import json

    from rstarjax.io import files
    from rstarjax.recipes import stage3_filter as F

    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(7)]
    solved = {0: 8, 1: 7, 2: 0, 3: 8, 4: 1, 5: 8, 6: 4}  # correct rollouts out of 8 per problem

    def rollout_fn(recs, n, seed, version):
        return [_traj(float(j < solved[int(r["answer"])]), 0, 0, 1, group=g)
                for g, r in enumerate(recs) for j in range(n)]

    kept, summary = F.filter_problems(records, rollout_fn, k=8, batch_prompts=3, seed=0)
    assert [r["problem"] for r in kept] == ["p1", "p2", "p4", "p6"]
    assert [r["stage2_pass_rate"] for r in kept] == [7 / 8, 0.0, 1 / 8, 4 / 8]
    assert summary["dropped_all_correct"] == 3 and summary["kept"] == 4
    out = tmp_path / "f.jsonl"
    files.write_jsonl_atomic(str(out), kept, ensure_ascii=False)
    assert [json.loads(x)["answer"] for x in out.read_text().splitlines()] == ["1", "2", "4", "6"]
    # a problem whose rollouts did not all come back is an error, not silently kept or dropped
    with pytest.raises(ValueError, match="expected 8 rollouts"):
        F.filter_problems(records, lambda recs, n, s, v: rollout_fn(recs, n, s, v)[:-1], 8, 3, 0)


def test_an_interrupted_filter_keeps_its_finished_batches_and_resumes_from_them(tmp_path):
    """A stop signal during the third batch: the two finished batches are in the progress file
    and ``Interrupted`` says so; the rerun rolls out only the batches not finished and keeps
    the same problems as a run never stopped. A changed problem set redoes its batches."""
    import signal

    from rstarjax.recipes import preemption
    from rstarjax.recipes import stage3_filter as F

    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(7)]
    solved = {0: 8, 1: 7, 2: 0, 3: 8, 4: 1, 5: 8, 6: 4}
    calls = []

    def rollout_fn(recs, n, seed, version):
        calls.append([r["problem"] for r in recs])
        if len(calls) == 3 and stop:
            os.kill(os.getpid(), signal.SIGTERM)  # inside the rollouts: the batch is abandoned
            time.sleep(5)
        return [_traj(float(j < solved[int(r["answer"])]), 0, 0, 1, group=g)
                for g, r in enumerate(recs) for j in range(n)]

    path = str(tmp_path / "f.jsonl.progress.jsonl")
    stop = True
    with preemption.SignalGuard(60.0) as guard, pytest.raises(preemption.Interrupted) as e:
        F.filter_problems(records, rollout_fn, k=8, batch_prompts=2, seed=0, progress_path=path, guard=guard)
    assert e.value.exit_status == 143 and "4 of 7 problems are filtered and kept in" in str(e.value)
    assert len(open(path).read().splitlines()) == 2
    stop, calls[:] = False, []
    kept, summary = F.filter_problems(records, rollout_fn, k=8, batch_prompts=2, seed=0, progress_path=path)
    assert calls == [["p4", "p5"], ["p6"]] and summary["resumed_problems"] == 4
    assert [r["problem"] for r in kept] == ["p1", "p2", "p4", "p6"]
    calls[:] = []
    changed = [dict(records[0], answer="10"), records[1]]  # p0's answer changed: its batch runs again
    solved[10] = 0
    F.filter_problems(changed, rollout_fn, k=8, batch_prompts=2, seed=0, progress_path=path)
    assert calls == [["p0", "p1"]]


def test_run_filter_writes_the_stage3_dataset(tmp_path):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    import stage3

    from rstarjax.recipes import stage3_filter as F

    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"problem": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
    c = stage3.get_config("filter")
    c.data.train_path = str(data)
    c.logging.progress_bar = False
    c.model.random_init, c.model.preset = True, "tiny"  # the policy is scripted; no model directory needed

    def rollout_fn(recs, n, seed, version):  # problems with an even answer are always solved
        return [_traj(float(int(r["answer"]) % 2 == 0 or j == 0), 0, 0, 1, group=g)
                for g, r in enumerate(recs) for j in range(n)]

    from rstarjax.recipes.config import parse

    summary = F.run_filter(parse(c), str(tmp_path), rollout_fn=rollout_fn)
    rows = [json.loads(x) for x in (tmp_path / "filtered.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["1", "3"] and summary["dropped_all_correct"] == 3
    assert json.loads((tmp_path / "filtered.jsonl.summary.json").read_text())["kept"] == 2


def test_tokens_over_the_gap_threshold_are_counted_and_found_in_the_callers_rows():
    """``train(gap_threshold=...)``: the count of trained tokens whose sampler log-prob is off by
    more than the threshold, and where they are, in the caller's row order (the skip-padding
    reorder moves rows before they go on the mesh)."""
    batch = random_batch(4)
    batch["loss_mask"][[1, 5]] = 0.0  # padding rows: train() reorders the rest first
    batch["advantages"][[1, 5]] = 0.0
    tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(), LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=2),
                             mesh=sharding_lib.make_mesh(1, 2, 1, devices=jax.devices()[:2]))
    assert (tr.row_order(batch) != np.arange(B)).any(), "want rows that move"
    exact = np.asarray(tr.compute_logprobs(tr.put_batch(batch)))  # the sampler was exact...
    sampled = exact.copy()
    off = [(0, PROMPT + 1, 0.5), (3, PROMPT, -0.02), (6, PROMPT + 3, 3.0)]  # ...but here
    for r, c, delta in off:
        assert batch["loss_mask"][r, c] == 1.0
        sampled[r, c] += delta
    sampled[2, 1] += 5.0  # a prompt token: not trained, never counted
    sampled[3, PROMPT + 1] += 0.005  # below the threshold
    batch["rollout_logprobs"] = sampled.astype(np.float32)
    m = tr.train(batch, gap_threshold=0.01)
    assert m["train/logprob_gap_tokens_over"] == 3.0
    assert sorted(map(tuple, tr.logprob_gap_outliers.tolist())) == [(r, c) for r, c, _ in off]
    assert m["train/logprob_gap_max"] == pytest.approx(3.0, abs=1e-4)
    m = tr.train(batch)  # no threshold: no count
    assert "train/logprob_gap_tokens_over" not in m and len(tr.logprob_gap_outliers) == 0


def test_a_batch_with_the_wrong_rollout_count_is_refused_before_it_is_recorded(tmp_path):
    """A group short of k (or over it) is a clear error naming the row, and its batch is not on
    record, so the rerun rolls it out again instead of failing on it forever; a progress line
    that does not fit its batch (edited, or from an older run) is rolled out again too."""
    import json

    from rstarjax.recipes import stage3_filter as F

    records = [{"problem": f"p{i}", "answer": str(i)} for i in range(4)]
    path = str(tmp_path / "f.jsonl.progress.jsonl")
    extra = {"p2": 0}

    def rollout_fn(recs, n, seed, version):
        return [_traj(0.0, 0, 0, 1, group=g) for g, r in enumerate(recs) for _ in range(n + extra.get(r["problem"], 0))]

    for wrong in (-1, 1):
        extra["p2"] = wrong
        with pytest.raises(ValueError, match=r"expected 8 rollouts .* row 2 \('p2'\): " + str(8 + wrong)):
            F.filter_problems(records, rollout_fn, k=8, batch_prompts=2, seed=0, progress_path=path)
        assert len(open(path).read().splitlines()) == 1  # the first batch only
    extra["p2"] = 0
    kept, summary = F.filter_problems(records, rollout_fn, k=8, batch_prompts=2, seed=0, progress_path=path)
    assert len(kept) == 4 and summary["resumed_problems"] == 2
    rows = [json.loads(x) for x in open(path).read().splitlines()]
    rows[0]["counts"] = [[7, 7], [0, 8]]  # a short group on record
    open(path, "w").write("".join(json.dumps(r) + "\n" for r in rows))
    assert F.filter_problems(records, rollout_fn, k=8, batch_prompts=2, seed=0, progress_path=path)[1][
        "resumed_problems"] == 2


def test_the_filter_s_policy_identity_follows_the_reward_and_the_tool_limits(tmp_path):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    import stage3

    from rstarjax.recipes import stage3_filter as F
    from rstarjax.recipes.config import parse

    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"problem": "q", "answer": "1"}) + "\n")

    def identity(**changes):
        c = stage3.get_config("filter")
        c.data.train_path, c.model.random_init, c.model.preset = str(data), True, "tiny"
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(c, section), name, value)
        return F.policy_identity(parse(c))

    base = identity()
    assert base == identity(rl__rollout_timeout_s=100.0)  # how long a failure takes decides nothing
    for change in ({"reward__mode": "official"}, {"reward__time_limit_s": 4.0}, {"rl__tool_timeout_s": 9.0},
                   {"rl__max_tool_response_chars": 100}):
        assert identity(**change) != base, change


def test_a_filter_that_keeps_nothing_is_an_error_with_its_summary(tmp_path):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    import stage3

    from rstarjax.io.data import DataError
    from rstarjax.recipes import stage3_filter as F
    from rstarjax.recipes.config import parse

    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"problem": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    c = stage3.get_config("filter")
    c.data.train_path, c.logging.progress_bar = str(data), False
    c.model.random_init, c.model.preset = True, "tiny"
    solved = lambda recs, n, seed, version: [_traj(1.0, 0, 0, 1, group=g) for g in range(len(recs)) for _ in range(n)]
    with pytest.raises(DataError, match="kept none of 3 problems"):
        F.run_filter(parse(c), str(tmp_path), rollout_fn=solved)
    assert not (tmp_path / "filtered.jsonl").exists()
    assert json.loads((tmp_path / "filtered.jsonl.summary.json").read_text())["dropped_all_correct"] == 3


def test_a_resumed_filter_reuses_only_batches_of_the_same_policy(tmp_path):
    """A filter stopped after its first batch, rerun with another ``checkpoint.init_from``: that
    batch is rolled out again (it was reused, so the dataset mixed two policies' pass counts);
    rerun with the same one, it is reused; a finished filter rerun rolls out nothing again (it
    rolled out every problem anew). An init_from without a checkpoint is one line
    (``StageError``) before any rollout."""
    import json
    import sys

    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    import stage3

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import stage3_filter as F
    from rstarjax.recipes.config import parse
    from rstarjax.recipes.rl import StageError

    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"problem": f"q{i}", "answer": str(i)}) + "\n" for i in range(4)))
    policies = {}
    for name, value in (("a", 1.0), ("b", 2.0)):
        policies[name] = str(tmp_path / name / "checkpoints")
        with ckpt_lib.Checkpointer(policies[name], ckpt_lib.CheckpointConfig(async_save=False)) as ck:
            ck.save(3, {"params": {"w": jnp.full((4,), value)}}, {"step": 3})
    (tmp_path / "empty").mkdir()
    calls, fail_at = [], [2]

    def rollout_fn(recs, n, seed, version):
        calls.append([r["problem"] for r in recs])
        if len(calls) == fail_at[0]:
            raise RuntimeError("stopped")
        return [_traj(0.0, 0, 0, 1, group=g) for g in range(len(recs)) for _ in range(n)]

    def run(init_from):
        c = stage3.get_config("filter")
        c.data.train_path, c.checkpoint.init_from = str(data), init_from
        c.filter.batch_prompts, c.logging.progress_bar = 2, False
        c.model.random_init, c.model.preset = True, "tiny"
        calls.clear()
        return F.run_filter(parse(c), str(tmp_path / "filter"), rollout_fn=rollout_fn)

    with pytest.raises(RuntimeError, match="stopped"):
        run(policies["a"])  # the first batch finished with policy a, then the run stopped
    with pytest.raises(RuntimeError, match="stopped"):
        run(policies["b"])
    assert calls == [["q0", "q1"], ["q2", "q3"]]  # policy b: nothing of a's reused
    fail_at[0] = 0
    assert run(policies["b"])["resumed_problems"] == 2 and calls == [["q2", "q3"]]
    out = tmp_path / "filter" / "filtered.jsonl"
    first = out.read_text()
    out.unlink()  # a finished filter rerun as it was: nothing rolled out again, the same dataset
    assert run(policies["b"])["resumed_problems"] == 4 and calls == [] and out.read_text() == first
    with pytest.raises(StageError, match="holds no finished checkpoint"):
        run(str(tmp_path / "empty"))
    assert calls == []


def _schedule_count(tr):
    import optax as _optax
    return [int(s.count) for s in jax.tree.leaves(
        tr.state.opt_state, is_leaf=lambda x: isinstance(x, _optax.ScaleByScheduleState))
        if isinstance(s, _optax.ScaleByScheduleState)]


def test_a_skipped_update_keeps_its_place_in_the_lr_schedule_and_an_empty_step_trains_nothing():
    """verl steps its scheduler once a rollout step whether or not the optimizer stepped: with
    two mini-batches, one all padding, the next step's two updates still share one rate, and a
    non-finite update moves the schedule on too. A batch with no trained token (every group
    rejected) is no update at all, even in one mini-batch: params, optimizer and step stay."""
    cfg = optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=4)
    tr = trainer_lib.Trainer(tiny_model(), cfg, LossConfig(),
                             trainer_lib.TrainerConfig(micro_batch_size=2, mini_batches=2, recompute_old_logprobs=False),
                             mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    half = random_batch(0)
    half["loss_mask"][B // 2:] = 0  # the second mini-batch trains nothing
    m = tr.train(half)
    assert m["train/updates"] == 1 and _schedule_count(tr) == [2]
    m = tr.train(random_batch(1))
    assert m["train/updates"] == 2 and _schedule_count(tr) == [4]
    assert m["train/lr"] == pytest.approx(1e-3 * 2 / 4)  # rollout step 1 of a 4-step warmup, both updates
    bad = random_batch(2)
    bad["advantages"][0, bad["loss_mask"][0] > 0] = np.nan
    m = tr.train(bad)
    assert m["train/skipped_nonfinite"] == 0.5 and _schedule_count(tr) == [6]  # 1 of its 2 updates skipped

    one = trainer_lib.Trainer(tiny_model(), cfg, LossConfig(), trainer_lib.TrainerConfig(recompute_old_logprobs=False),
                              mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    one.train(random_batch(3))
    before = leaves(one.state.params) + leaves(one.state.opt_state)
    empty = random_batch(4)
    empty["loss_mask"][:] = 0
    m = one.train(empty)
    assert m["train/updates"] == 0 and one.step == 1
    for a, b in zip(leaves(one.state.params) + leaves(one.state.opt_state), before):
        np.testing.assert_array_equal(a, b)


def test_micro_batch_token_means_do_not_depend_on_skip_padding():
    """loss.token_mean="micro_batch" weights each micro-batch by its own rows: the micro-batches
    must be verl's (its real rows, in order), whether or not padding micro-batches are skipped
    (with skip_padding off they once mixed padding and real rows: another loss)."""
    batch = random_batch(0)
    batch["loss_mask"][1:3] = 0
    losses = []
    for skip in (False, True):
        tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=0),
                                 LossConfig(token_mean="micro_batch"),
                                 trainer_lib.TrainerConfig(micro_batch_size=2, recompute_old_logprobs=False,
                                                           skip_padding=skip),
                                 mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
        losses.append(tr.train({k: v.copy() for k, v in batch.items()})["train/loss"])
    # verl's actor: the real rows in order, micro-batches of 2, each its token mean times its rows
    model = tiny_model()
    real = [i for i in range(B) if batch["loss_mask"][i].sum() > 0]
    want = 0.0
    for j in range(0, len(real), 2):
        rows = real[j:j + 2]
        sub = {k: v[rows] for k, v in batch.items()}
        want += float(reference_loss(model, sub)) * len(rows) / len(real)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[1] == pytest.approx(want, rel=1e-4)


def test_gspo_updates_average_sequences_whatever_the_micro_batches():
    """GSPO's objective is a token mean per sequence, then a mean over the batch's trained
    sequences: the trainer's default normaliser counts them, so micro-batches of 1, 2 or 8 rows
    give the loss of one policy_loss call over the whole batch with that count."""
    from rstarjax.rl.loss import policy_loss, trained_sequences

    batch = random_batch(3)
    batch["loss_mask"][5] = 0  # a rejected row: not a sequence of the mean
    cfg = LossConfig(policy_loss="gspo")
    losses = []
    for micro in (1, 2, 8):
        tr = trainer_lib.Trainer(tiny_model(), optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=0), cfg,
                                 trainer_lib.TrainerConfig(micro_batch_size=micro, recompute_old_logprobs=False),
                                 mesh=sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
        losses.append(tr.train({k: v.copy() for k, v in batch.items()})["train/loss"])
    model = tiny_model()
    logits = model(jnp.asarray(batch["tokens"]), positions=jnp.asarray(batch["positions"]),
                   segment_ids=jnp.asarray(batch["segment_ids"]))
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), jnp.asarray(batch["tokens"])[:, 1:, None], -1)[..., 0]
    cut = {k: jnp.asarray(v)[:, 1:] for k, v in batch.items()}
    sequences = trained_sequences(cut["loss_mask"], cut["segment_ids"])
    assert float(sequences) == B - 1
    want, _ = policy_loss(logp, cut["old_logprobs"], cut["advantages"], cut["loss_mask"], sequences, cfg,
                          segment_ids=cut["segment_ids"])
    np.testing.assert_allclose(losses, [float(want)] * 3, rtol=1e-5, atol=1e-7)
