"""Padding rows (rejected groups, unused packed rows) cost no forward or backward: ``train``
moves a mini-batch's real rows into its first micro-batches (``micro_major_order``) and the
step skips the micro-batches left with no trained token (``TrainerConfig.skip_padding``)."""
import os
import sys

import jax
import numpy as np
import optax
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_trainer import leaves, random_batch, reference_loss, reference_sgd_params, tiny_model  # noqa: E402

from rstarjax.models import sharding as sharding_lib  # noqa: E402
from rstarjax.rl import optim as optim_lib  # noqa: E402
from rstarjax.rl import trainer as trainer_lib  # noqa: E402
from rstarjax.rl.loss import LossConfig  # noqa: E402


def strided_micro_of(rows: int, mini_rows: int, num_micro: int) -> np.ndarray:
    """(mini-batch, micro-batch) of each global row under the trainer's split: contiguous
    mini-batches, then ``split_micro_batches`` (run on an index array, not re-derived)."""
    index = np.arange(rows)
    out = np.empty((rows, 2), int)
    for k in range(rows // mini_rows):
        split = np.asarray(trainer_lib.split_micro_batches(index[k * mini_rows:(k + 1) * mini_rows],
                                                           num_micro))
        for m in range(num_micro):
            out[split[m], 0], out[split[m], 1] = k, m
    return out


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_real_rows_fill_the_first_micro_batches_of_their_mini_batch(processes):
    rng = np.random.default_rng(processes)
    for _ in range(40):
        num_micro = int(rng.choice([1, 2, 4]))
        mini_batches = int(rng.choice([1, 2]))
        rows_per_micro = processes * int(rng.integers(1, 4))
        mini_rows = num_micro * rows_per_micro
        rows = mini_rows * mini_batches
        nonempty = rng.random(rows) < rng.random()
        local = rows // processes
        # each process orders its own rows; the global batch is their concatenation
        order = np.concatenate([
            p * local + trainer_lib.micro_major_order(nonempty[p * local:(p + 1) * local],
                                                      mini_rows=mini_rows, num_micro=num_micro,
                                                      offset=p * local)
            for p in range(processes)])
        assert sorted(order) == list(range(rows))
        where = strided_micro_of(rows, mini_rows, num_micro)
        assert (where[order, 0] == where[:, 0]).all()  # no row leaves its mini-batch
        for p in range(processes):  # nor its process
            assert ((order[p * local:(p + 1) * local] // local) == p).all()
        arranged = nonempty[order]
        process = np.arange(rows) // local
        for k in range(mini_batches):
            need = 0
            for p in range(processes):
                seg = np.flatnonzero((where[:, 0] == k) & (process == p))
                if not seg.size:
                    continue
                micro_major = seg[np.lexsort((seg, where[seg, 1]))]
                real_sources = order[micro_major][arranged[micro_major]]
                assert (np.diff(real_sources) > 0).all()  # real rows keep their order
                per_micro = seg.size // num_micro  # this process's rows in each micro-batch
                need = max(need, -(-int(nonempty[seg].sum()) // per_micro))
            # the micro-batches that hold a real row: as few as the fullest process allows
            used = {m for m in range(num_micro) if arranged[(where[:, 0] == k) & (where[:, 1] == m)].any()}
            assert used == set(range(need)), (used, need)


def test_order_refuses_a_mini_batch_that_does_not_split():
    with pytest.raises(ValueError, match="does not split"):
        trainer_lib.micro_major_order(np.ones(6, bool), mini_rows=6, num_micro=4)


def padded_batch(nan_probe: bool):
    """16 rows: 8 real ones of ``random_batch`` at random positions, 8 padding rows as
    ``place_rows`` leaves them; ``nan_probe`` puts NaN advantages in the padding rows, so any
    computed padding row turns the loss into NaN (loss mask 0 times NaN; the gradient stays
    finite: eq. 6's ratio is masked with ``where``)."""
    real = {k: np.concatenate([v, random_batch(seed=1)[k]]) for k, v in random_batch(seed=0).items()}
    rows = np.random.default_rng(3).permutation(16)[:8]
    batch = {k: np.zeros((16,) + v.shape[1:], v.dtype) for k, v in real.items()}
    for k in batch:
        batch[k][rows] = real[k][:8]
    if nan_probe:
        pad = np.setdiff1d(np.arange(16), rows)
        batch["advantages"][pad] = np.nan
    return batch, {k: v[:8] for k, v in real.items()}, rows


@pytest.mark.slow
def test_padded_batch_update_equals_reference_and_computes_no_padding_row():
    batch, real, rows = padded_batch(nan_probe=True)
    # the rows as given would put real and padding rows together in every micro-batch
    where = strided_micro_of(16, 16, 4)
    assert len({int(m) for m in where[rows, 1]}) == 4
    ref_params, ref_grads = reference_sgd_params(real, lr=1.0)  # the 8 real rows alone
    mesh = sharding_lib.make_mesh(1, 4, 2)

    def train(skip):
        tr = trainer_lib.Trainer(tiny_model(), None, LossConfig(),
                                 trainer_lib.TrainerConfig(micro_batch_size=4, skip_padding=skip,
                                                           recompute_old_logprobs=False),
                                 mesh=mesh, optimizer=optax.sgd(1.0))
        return tr, tr.train(batch)

    tr, metrics = train(skip=True)
    for got, want, g in zip(leaves(tr.state.params), leaves(ref_params), leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, np.abs(g).max()))
    assert metrics["train/tokens"] == pytest.approx(real["loss_mask"].sum())
    assert metrics["train/token_frac"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/loss"] == pytest.approx(float(reference_loss(tiny_model(), real)),
                                                  rel=1e-4, abs=1e-6)
    # the probe works: computing every row (the former step) makes the loss NaN
    tr_all, metrics_all = train(skip=False)
    assert np.isnan(metrics_all["train/loss"])
    # the old-log-prob recompute skips the padding micro-batches too: zeros there, the same
    # log-probs as a forward of every row on the real ones
    arranged = tr.arrange_rows(trainer_lib.batch_to_dict(batch))
    real_rows = arranged["loss_mask"].any(axis=1)
    skipped = np.asarray(tr.compute_logprobs(tr.put_batch(arranged)))
    full = np.asarray(tr_all.compute_logprobs(tr_all.put_batch(arranged), tr.state.params))
    assert (skipped[~real_rows] == 0).all() and (full[~real_rows] != 0).any()
    np.testing.assert_allclose(skipped[real_rows], full[real_rows], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_mini_batch_of_padding_only_is_no_update():
    """mini_batches=2 with every real row in the first half: one AdamW update, the same as a
    one-mini-batch update on that half (an update on the empty half would still move the
    weights through AdamW's momentum and weight decay)."""
    half = random_batch(seed=0)
    batch = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in half.items()}
    mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])

    def trainer(mini_batches):
        return trainer_lib.Trainer(
            tiny_model(), optim_lib.OptimConfig(learning_rate=1e-3, warmup_steps=0, weight_decay=0.1),
            LossConfig(), trainer_lib.TrainerConfig(micro_batch_size=4, mini_batches=mini_batches,
                                                    recompute_old_logprobs=False), mesh=mesh)

    two, one = trainer(2), trainer(1)
    for _ in range(2):  # the second round has momentum to carry
        metrics = two.train(batch)
        one.train(half)
    assert metrics["train/updates"] == 1 and two.step == one.step == 2
    for a, b in zip(leaves(two.state.params), leaves(one.state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
