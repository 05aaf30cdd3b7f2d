"""Streamed text of the policy server (``completions.TextStream``): a character that Qwen3's
byte-level BPE splits across tokens (an emoji, a rare CJK character, a math symbol) is held
back until it completes, so the streamed pieces joined are ``tokenizer.decode`` of the ids;
decoding each token alone, as JetStream 0.2.2 does, turns it into U+FFFD."""
import numpy as np

from rstarjax.models import load_tokenizer
from rstarjax.serving.completions import TextStream

# The reviewer's strings: Qwen3 encodes each with a token that is a partial UTF-8 sequence of
# two or more bytes (JetStream's "<0xAB>" byte notation covers single bytes only).
SPLIT = "龘𠀀鱻齉爨靐䲜 ∮ ⨌ ⟁ ⛩ 🦜 🫠 ꙮ ᚠ ཀྵ ༀ ꧁ ﷽ 〶 ㍿ ⿰ 丶 乂 ㄅ ӂ Ԥ ᵹ".split()


def _stream(tok, ids, chunks=1):
    stream = TextStream(tok)
    pieces = [stream.add(ids[i:i + chunks]) for i in range(0, len(ids), chunks)]
    return pieces + [stream.finish()]


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_split_characters_stream_whole():
    tok = load_tokenizer()  # Qwen3's full vocabulary
    assert tok.encode("🦜") == [123918, 250]  # the reviewer's end-to-end case
    split = 0
    for s in SPLIT:
        ids = tok.encode(s)
        if not any(len(b) >= 2 and not _valid(b) for b in (tok.decode_bytes([i]) for i in ids)):
            continue
        split += 1
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == s, (s, ids, pieces)
        assert "\ufffd" not in "".join(pieces)
        assert all(p == "" or p in s for p in pieces)  # only whole characters, never a half
    assert split >= 5  # the list does exercise multi-byte partial tokens


def test_text_around_split_characters_and_chunked_steps():
    tok = load_tokenizer()
    text = "He said “don’t” — café 🙂 日本語 ⨌ 🦜🫠 done"
    ids = tok.encode(text)
    for chunks in (1, 2, 3, 7):
        assert "".join(_stream(tok, ids, chunks)) == text
    # a stream cut inside a character (max_tokens): the held bytes become U+FFFD at the end,
    # exactly as tokenizer.decode writes them
    cut = tok.encode("🦜")[:1]
    assert "".join(_stream(tok, cut)) == tok.decode(cut) == "\ufffd"


def test_random_ids_join_to_decode():
    """Any id sequence, valid UTF-8 or not (a policy can sample anything): the pieces joined
    equal tokenizer.decode, and a piece never ends in a character still incomplete."""
    tok = load_tokenizer()
    rng = np.random.default_rng(0)
    partial = [i for i in range(tok.num_regular_tokens) if not _valid(tok.decode_bytes([i]))][:2000]
    assert partial
    for _ in range(300):
        n = int(rng.integers(1, 12))
        ids = [int(rng.choice(partial)) if rng.random() < 0.6 else int(rng.integers(0, tok.num_tokens))
               for _ in range(n)]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids
