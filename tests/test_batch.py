"""TrainBatch layout and target/log-prob alignment on hand-made examples."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstarjax.rl.batch import TrainBatch, build_train_batch, pack_first_fit
from rstarjax.models.logprobs import token_logprobs_and_entropy
from rstarjax.rl.trajectory import FinishReason, Segment, SegmentKind, Trajectory


def _batch(*args, **kwargs):
    return build_train_batch(*args, **kwargs)[0]


M, T = SegmentKind.MODEL, SegmentKind.TOOL


def hand_traj():
    # prompt [11 12 13] | model [21 22] lp [-.1 -.2] | tool [31] | model [41] lp [-.4]
    return Trajectory(
        prompt_ids=np.array([11, 12, 13]),
        segments=[Segment(M, [21, 22], [-0.1, -0.2]), Segment(T, [31]), Segment(M, [41], [-0.4])],
        reward=1.0,
    )


def test_hand_layout_exact():
    t2 = Trajectory(prompt_ids=np.array([5]), segments=[Segment(M, [6, 7], [-1.0, -2.0])], reward=0.0)
    b = _batch([hand_traj(), t2], [0.5, -2.0], seq_len=8, pad_id=99)
    np.testing.assert_array_equal(b.tokens, [[11, 12, 13, 21, 22, 31, 41, 99], [5, 6, 7, 99, 99, 99, 99, 99]])
    np.testing.assert_array_equal(b.loss_mask, [[0, 0, 0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_allclose(b.old_logprobs, [[0, 0, 0, -0.1, -0.2, 0, -0.4, 0], [0, -1, -2, 0, 0, 0, 0, 0]])
    np.testing.assert_allclose(b.advantages, [[0, 0, 0, 0.5, 0.5, 0.5, 0.5, 0], [0, -2, -2, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b.rollout_logprobs, b.old_logprobs)
    assert b.tokens.dtype == np.int32 and b.loss_mask.dtype == np.float32


def test_hand_packing_exact():
    t2 = Trajectory(prompt_ids=np.array([5]), segments=[Segment(M, [6], [-1.0])], reward=0.0)
    b, layout = build_train_batch([hand_traj(), t2], [0.5, -2.0], seq_len=10, pad_id=0, pack=True)
    np.testing.assert_array_equal(b.tokens, [[11, 12, 13, 21, 22, 31, 41, 5, 6, 0]])
    np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 1, 1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 3, 4, 5, 6, 0, 1, 0]])
    np.testing.assert_array_equal(b.loss_mask, [[0, 0, 0, 1, 1, 0, 1, 0, 1, 0]])
    assert layout.placements[1].row == 0 and layout.placements[1].start == 7


def test_alignment_with_token_logprobs():
    """A 'sampler' draws each token from a known distribution given the previous position; the
    batch + token_logprobs must reproduce exactly the sampler's log-probs on every model token
    (so the ratio pi/pi_old is exactly 1), in padded and packed layouts."""
    rng = np.random.default_rng(0)
    V = 9
    trajs, dists = [], []
    for _ in range(5):
        p = int(rng.integers(1, 4))
        n = int(rng.integers(2, 7))
        seq_logits = rng.normal(size=(p + n, V)).astype(np.float32) * 2  # row j = dist of token j+1
        logp = seq_logits - np.log(np.exp(seq_logits).sum(-1, keepdims=True))
        ids = rng.integers(0, V, p + n)
        kinds = [M if rng.random() < 0.7 else T for _ in range(n)]
        segs = [Segment(k, [ids[p + j]], [logp[p + j - 1, ids[p + j]]] if k == M else None) for j, k in enumerate(kinds)]
        trajs.append(Trajectory(prompt_ids=ids[:p], segments=segs, reward=1.0))
        dists.append(seq_logits)
    for pack in (False, True):
        b, layout = build_train_batch(trajs, [1.0] * 5, seq_len=16, pad_id=0, pack=pack)
        logits = np.zeros(b.tokens.shape + (V,), np.float32)
        for pl, d in zip(layout.placements, dists):
            logits[pl.row, pl.start : pl.start + pl.length] = d[: pl.length]
        lp = np.asarray(token_logprobs_and_entropy(jnp.asarray(logits), jnp.asarray(b.tokens))[0])
        on = b.loss_mask > 0
        assert on.sum() == sum(t.num_model_tokens for t in trajs)
        np.testing.assert_allclose(lp[on], b.old_logprobs[on], atol=1e-5)


def test_too_long_raises_or_truncates_with_flag():
    t = hand_traj()  # 7 tokens
    with pytest.raises(ValueError, match="exceed seq_len"):
        _batch([t], [1.0], seq_len=5, pad_id=0)
    b, layout = build_train_batch([t], [1.0], seq_len=5, pad_id=0, truncate=True)
    np.testing.assert_array_equal(b.tokens, [[11, 12, 13, 21, 22]])
    np.testing.assert_array_equal(b.loss_mask, [[0, 0, 0, 1, 1]])
    assert layout.placements[0].truncated and sum(p.truncated for p in layout.placements) == 1
    with pytest.raises(ValueError, match="prompt"):
        _batch([t], [1.0], seq_len=3, pad_id=0, truncate=True)


def test_bad_inputs():
    with pytest.raises(ValueError):
        _batch([hand_traj()], [1.0, 2.0], seq_len=8, pad_id=0)
    with pytest.raises(ValueError):
        _batch([hand_traj()], [np.ones(3)], seq_len=8, pad_id=0)  # response has 4 tokens
    with pytest.raises(ValueError):
        _batch([hand_traj()], [float("nan")], seq_len=8, pad_id=0)
    with pytest.raises(ValueError, match="rows"):
        _batch([hand_traj()] * 3, [1.0] * 3, seq_len=8, pad_id=0, num_rows=2)
    probs = Trajectory(prompt_ids=np.array([1]), segments=[Segment(M, [2, 3], [0.9, 0.5])])  # probabilities, not logs
    with pytest.raises(ValueError, match="log-probs must be <= 0"):
        _batch([probs], [1.0], seq_len=8, pad_id=0)
    empty_prompt = Trajectory(prompt_ids=np.array([], np.int32), segments=[Segment(M, [1], [-1.0])])
    with pytest.raises(ValueError, match="empty prompt"):
        _batch([empty_prompt], [1.0], seq_len=8, pad_id=0)


def test_per_token_advantages_and_num_rows_padding():
    adv = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    b = _batch([hand_traj()], [adv], seq_len=8, pad_id=0, num_rows=4)
    assert b.shape == (4, 8)
    np.testing.assert_allclose(b.advantages[0], [0, 0, 0, 1, 2, 3, 4, 0])
    assert np.all(b.segment_ids[1:] == 0) and np.all(b.loss_mask[1:] == 0)


def test_overlong_filter_zeroes_truncated_rollouts():
    t = hand_traj()
    t.finish = FinishReason.MAX_LENGTH
    b = _batch([t, hand_traj()], [1.0, 1.0], seq_len=8, pad_id=0, overlong_filter=True)
    assert b.loss_mask[0].sum() == 0 and b.loss_mask[1].sum() == 3


def test_packing_preserves_every_sequence():
    rng = np.random.default_rng(1)
    trajs = []
    for _ in range(20):
        n = int(rng.integers(1, 9))
        segs = [Segment(M, rng.integers(1, 50, n), np.full(n, -0.5))]
        trajs.append(Trajectory(prompt_ids=rng.integers(1, 50, rng.integers(1, 6)), segments=segs))
    b, layout = build_train_batch(trajs, [0.0] * 20, seq_len=24, pad_id=0, pack=True)
    assert b.shape[0] < 20 and layout.fill > 0.5
    seen = np.zeros(b.shape, bool)
    for t, pl in zip(trajs, layout.placements):
        full = np.concatenate([t.prompt_ids, t.response_ids])
        np.testing.assert_array_equal(b.tokens[pl.row, pl.start : pl.start + pl.length], full)
        assert not seen[pl.row, pl.start : pl.start + pl.length].any()  # no overlap
        seen[pl.row, pl.start : pl.start + pl.length] = True
        assert b.positions[pl.row, pl.start] == 0
    assert (b.segment_ids > 0).sum() == seen.sum()
    assert pack_first_fit([5, 5, 5], 10) == [[0, 1], [2]]


def test_train_batch_is_a_pytree():
    b = _batch([hand_traj()], [1.0], seq_len=8, pad_id=0)
    assert len(jax.tree.leaves(b)) == 7
    out = jax.jit(lambda x: x.loss_mask.sum() + x.advantages.sum())(b)
    assert float(out) == pytest.approx(3 + 4.0)
    assert isinstance(jax.tree.map(lambda a: a[0:1], b), TrainBatch)


@pytest.mark.slow
def test_packed_and_padded_logprobs_agree_through_the_model():
    """Packing is only correct if positions restart and segment_ids isolate sequences in the real
    model: the per-token log-probs of every trajectory must not depend on the layout."""
    from flax import nnx

    from rstarjax.models import ModelConfig, Qwen3

    cfg = ModelConfig.preset("tiny")
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    trajs = []
    for _ in range(4):
        n = int(rng.integers(2, 6))
        trajs.append(Trajectory(prompt_ids=rng.integers(1, 500, int(rng.integers(1, 4))),
                                segments=[Segment(M, rng.integers(1, 500, n), np.full(n, -1.0)),
                                          Segment(T, rng.integers(1, 500, 2))]))
    padded, lay_p = build_train_batch(trajs, [1.0] * 4, seq_len=20, pad_id=0)
    # Same [4, 20] shape as the padded batch (one compile); packing uses only the first rows.
    packed, lay_k = build_train_batch(trajs, [1.0] * 4, seq_len=20, pad_id=0, pack=True, num_rows=4)
    assert packed.shape == padded.shape and max(pl.row for pl in lay_k.placements) <= 1

    @nnx.jit
    def logprobs(model, b):
        logits = model(b.tokens, positions=b.positions, segment_ids=b.segment_ids)
        return token_logprobs_and_entropy(logits, b.tokens)[0]

    lp_p, lp_k = np.asarray(logprobs(model, padded)), np.asarray(logprobs(model, packed))
    for a, b in zip(lay_p.placements, lay_k.placements):
        np.testing.assert_allclose(lp_k[b.row, b.start + 1 : b.start + b.length],
                                   lp_p[a.row, a.start + 1 : a.start + a.length], atol=2e-5)
