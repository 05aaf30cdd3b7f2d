"""Math problem datasets as grain pipelines, normalised to {"problem", "answer", "uid", "source"}.

Layouts understood (first match wins):
  * DAPO-Math-17k / verl: ``prompt`` = chat list [{"role": "user", "content": ...}] (the DAPO
    instruction wrapper is stripped) and ``reward_model.ground_truth``;
  * HF math sets: ``problem``/``Problem``/``question``/``Question`` and ``answer``/``Answer``/
    ``expected_answer``/``final_answer``/``ground_truth``, else ``reward_model.ground_truth`` (MATH-500,
    AIME24/25, OpenMathReasoning, open-r1/DAPO-Math-17k-Processed);
    GSM8K-style answers "... #### 72" keep the part after "####".
Files: ``.jsonl`` / ``.json`` (a list of rows or JSON lines) and ``.parquet`` (needs pyarrow).

Rows are read and normalised eagerly on the host (datasets here are ~10^4-10^5 problems): bad rows
(a line that is not UTF-8 or not JSON, missing, empty or wrong-type fields, repeated problems) are
skipped and COUNTED by reason in ``DataReport``, with their first rows (``FILE:ROW``);
``handling`` (``DATA_HANDLINGS``) says what is done to the rows kept: "paper" (the default) strips
and canonicalises as below, "official" keeps prompt and answer as written and every repeat, as the
official rStar2-Agent code does. The answers kept (paper handling) are ``answer_filter``'s
(``ANSWER_FILTERS``: "integer", rStar2-Agent §4.2's and the default, or "any" the verifier can
compare), and integers past Python's int-string limit (4,300 digits), which no answer the verifier
reads can equal, are counted too. docs/data.md is the user's guide.
The pipeline is then: per-host shard (process_index::process_count) -> seeded shuffle, reshuffled
every epoch -> repeat(num_epochs) -> batches of rows (official handling: the official loader's
order, ``OfficialOrder``). Its iterator's ``get_state()`` /
``set_state()`` (a small dict: the position in rows) is what a checkpoint stores to resume exactly,
also with another batch size.
"""
from __future__ import annotations

import codecs
import collections
import dataclasses
import decimal
import hashlib
import json
import logging
import math
import os
import re
import sys
from typing import Any, Callable, Iterable, Iterator

import grain
import jax
import numpy as np

from rstarjax import processes
from rstarjax.env.verify import integer_text

log = logging.getLogger(__name__)

_PROBLEM_KEYS = ("problem", "Problem", "question", "Question")
_ANSWER_KEYS = ("answer", "Answer", "expected_answer", "final_answer", "ground_truth", "solution_answer")

# DAPO-Math-17k wraps every problem in this instruction; our chat template adds its own.
_DAPO_PREFIX = re.compile(
    r"^\s*Solve the following math problem step by step\. The last line of your response should be of the form "
    r"Answer: \$Answer \(without quotes\) where \$Answer is the answer to the problem\.\s*",
    re.S,
)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$", re.S)

# data.handling: what loading does to the rows it keeps (docs/data.md "Handling")
#   "paper":    ours, the default: the DAPO instruction wrapper and the whitespace around problem
#               and answer stripped, GSM8K answers cut after "####", answers filtered and integers
#               written canonically (answer_filter), a repeated problem dropped (the first row wins)
#   "official": what the official rStar2-Agent code does (microsoft/rStar ecbfb94
#               data_preprocess/*_rstar2_agent_loop.py, then J-shang/verl d0dc976 RLHFDataset):
#               the user message and the ground truth as written (nothing stripped, no answer
#               filter, no canonical form) and every row kept, repeats included, drawn in the
#               official loader's order (OfficialOrder); rows it cannot read at all (no problem,
#               no answer, not JSON) are still skipped and counted
DATA_HANDLINGS = ("paper", "official")


class DataError(ValueError):
    """A data file a run cannot use at all (no usable row, too few for one batch): said in one
    line, exit status 2 (``rstarjax.main``), as a configuration error is."""


class BadRow(ValueError):
    """A row that cannot be normalised; ``reason`` is the counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# rows named per skip reason in a report (the rest are counted only)
EXAMPLE_ROWS = 5


@dataclasses.dataclass
class DataReport:
    """What loading kept and dropped, by reason, with the first rows of each ("FILE:ROW", rows
    numbered from 1: a .jsonl file's line numbers) so they can be found and fixed (never silent)."""

    total: int = 0
    kept: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    rows: dict = dataclasses.field(default_factory=dict)  # reason -> the first EXAMPLE_ROWS "FILE:ROW"

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, reason: str, where: str) -> None:
        """Count one skipped row of ``reason`` at ``where`` ("FILE:ROW")."""
        self.skipped[reason] += 1
        examples = self.rows.setdefault(reason, [])
        if len(examples) < EXAMPLE_ROWS:
            examples.append(where)

    def merge(self, other: "DataReport") -> "DataReport":
        rows = {k: (self.rows.get(k, []) + other.rows.get(k, []))[:EXAMPLE_ROWS] for k in {*self.rows, *other.rows}}
        return DataReport(self.total + other.total, self.kept + other.kept, self.skipped + other.skipped, rows)

    def describe(self, reason: str) -> str:
        """``reason=N (rows a, b, ...)``."""
        n, rows = self.skipped[reason], self.rows.get(reason, [])
        more = ", ..." if n > len(rows) else ""
        return f"{reason}={n}" + (f" (rows {', '.join(rows)}{more})" if rows else "")

    def __str__(self) -> str:
        reasons = ", ".join(self.describe(k) for k in sorted(self.skipped)) or "none"
        return f"{self.kept}/{self.total} rows kept; skipped: {reasons}"


def _text(x: Any) -> str | None:
    if isinstance(x, str):
        return x.strip()
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    if isinstance(x, (float, np.floating)) and np.isfinite(x):
        # the shortest text that reads back as the float: 1e23 -> "1000...0", not int(1e23)'s
        # 99999999999999991611392 (floats past 2**53 are not the integers they were written as)
        return str(int(decimal.Decimal(repr(float(x))))) if float(x).is_integer() else repr(float(x))
    return None


def _verbatim(x: Any) -> str | None:
    """The text of a field as written (a number as ``_text`` writes it); None for other types."""
    return x if isinstance(x, str) else _text(x)


def strip_dapo_wrapper(text: str) -> str:
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text)).strip()


def _chat_user_content(prompt: Any) -> str | None:
    """The problem of a chat-layout prompt: its one user message (system messages are left to the
    chat template, which writes its own). None for a prompt that is no list of messages; BadRow
    for one that is a conversation (several user messages, or assistant turns), which no single
    problem text can stand for."""
    if isinstance(prompt, np.ndarray):
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)):
        return None
    roles = [msg.get("role") if isinstance(msg, dict) else None for msg in prompt]
    users = [msg for msg, role in zip(prompt, roles) if role == "user"]
    others = sorted({str(role) for role in roles if role not in ("user", "system")})
    if len(users) > 1 or others:
        raise BadRow("not_one_user_message",
                     f"{len(users)} user message(s)" + (f" and {'/'.join(others)} messages" if others else "")
                     + "; a problem is one user message")
    if users and isinstance(users[0].get("content"), str):
        return users[0]["content"]
    return None


def _kind(x: Any) -> str:
    """What a JSON value is, for a message: null, a bool, a list, ..."""
    if x is None:
        return "null"
    if isinstance(x, float) and not np.isfinite(x):
        return repr(x)
    return type(x).__name__


def _field(candidates: list[tuple[str, Any]], what: str) -> str:
    """The text of the first candidate (key, value) that is text or a number; raises BadRow
    ``missing_{what}`` when there is none, ``{what}_wrong_type`` (naming the keys and the types
    found) when the fields are there but hold nulls, lists, bools, objects."""
    wrong = []
    for key, value in candidates:
        text = _text(value)
        if text is not None:
            return text
        wrong.append(f"{key} is {_kind(value)}")
    if wrong:
        raise BadRow(f"{what}_wrong_type", "; ".join(wrong))
    raise BadRow(f"missing_{what}")


def official_row(row: Any) -> dict[str, str]:
    """{"problem", "answer"} as the official code trains on them (``handling="official"``): verl's
    chat ``prompt`` must be one user message, whose content the template renders as written
    (``RLHFDataset._build_messages`` hands the list over unchanged), and the answer is
    ``reward_model.ground_truth`` as written (what ``compute_score`` receives); the HF layouts'
    columns are taken as written too (the official aime/math500 preprocessing copies ``problem``
    / ``question`` and ``answer`` unchanged). Raises BadRow for what it cannot read."""
    if not isinstance(row, dict):
        raise BadRow("not_a_mapping", type(row).__name__)
    prompt = row.get("prompt")
    if prompt is not None and not isinstance(prompt, str):  # verl layout
        messages = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
        if (not messages or len(messages) != 1 or not isinstance(messages[0], dict)
                or messages[0].get("role") != "user" or not isinstance(messages[0].get("content"), str)):
            raise BadRow("not_one_user_message", "the official template renders one user message here")
        problem = messages[0]["content"]
    else:  # the preprocessing's inputs: open-r1's DAPO rows (prompt text), the HF sets' columns
        problem = _verbatim_field([(k, row[k]) for k in _PROBLEM_KEYS + ("prompt",) if k in row], "problem")
    # what compute_score receives, in either layout (the preprocessing copies it there)
    answer = _verbatim_field(_ground_truth(row) + [(k, row[k]) for k in _ANSWER_KEYS if k in row], "answer")
    return {"problem": problem, "answer": answer}


def _verbatim_field(candidates: list[tuple[str, Any]], what: str) -> str:
    """``_field`` without the strip: the first candidate that is text or a number, as written."""
    for _, value in candidates:
        text = _verbatim(value)
        if text is not None:
            return text
    return _field(candidates, what)  # raises: missing, or the types found


def _ground_truth(row: dict) -> list[tuple[str, Any]]:
    """verl's ``reward_model.ground_truth`` as an answer candidate, where the row has one."""
    rm = row.get("reward_model")
    return [("reward_model.ground_truth", rm["ground_truth"])] if isinstance(rm, dict) and "ground_truth" in rm else []


def normalize_row(row: Any) -> dict[str, str]:
    """{"problem", "answer"} from any supported layout; raises BadRow otherwise."""
    if not isinstance(row, dict):
        raise BadRow("not_a_mapping", type(row).__name__)
    if "prompt" in row and not isinstance(row["prompt"], str):  # DAPO / verl layout
        content = _chat_user_content(row["prompt"])
        if content is None:
            raise BadRow("bad_chat_prompt")
        problem = strip_dapo_wrapper(content)
        answers = _ground_truth(row)
        answers += [(k, row[k]) for k in _ANSWER_KEYS if k in row]
    else:
        problem = _field([(k, row[k]) for k in _PROBLEM_KEYS + ("prompt",) if k in row], "problem")
        # an answer column first; else verl's ground truth (open-r1/DAPO-Math-17k-Processed's rows:
        # the problem as plain text in ``prompt``, the answer in ``solution`` and the ground truth)
        answers = [(k, row[k]) for k in _ANSWER_KEYS if k in row] + _ground_truth(row)
    answer = _field(answers, "answer")
    if "####" in answer:  # GSM8K: rationale "#### final"
        answer = answer.rsplit("####", 1)[1].strip()
    if not problem:
        raise BadRow("empty_problem")
    if not answer:
        raise BadRow("empty_answer")
    return {"problem": problem, "answer": answer}


# data.answer_filter: which answers an RL run trains on (docs/data.md "Answers")
#   "integer": integers only, written canonically (rStar2-Agent §4.2: equivalence of expressions is
#              unreliable to verify); the paper's and the default
#   "any":     integers (canonical) and every other answer the verifier can read (math-verify parses
#              it: fractions, expressions, intervals, sets, ...); the rest are skipped and counted
ANSWER_FILTERS = ("integer", "any")
VERIFIER_PARSE_TIMEOUT_S = 5  # one gold answer's parse (math-verify's own alarm; main thread only)
# One non-integer gold's comparison with 0 at load (math-verify's own alarm, whole seconds; main
# thread only): far below the sandbox's verification limit (reward.time_limit_s, 30 s), far above
# an ordinary comparison (milliseconds; up to about 0.3 s for the process's first, sympy importing).
VERIFIER_COMPARE_TIMEOUT_S = 2


def integer_answer(answer: str) -> str | None:
    """The canonical integer string of an answer ("\\boxed{1{,}000}" -> "1000"), or None.

    rStar2-Agent §4.2 trains only on integer answers (equivalence of expressions is unreliable).
    The verifier's own reading (``verify.integer_text``), so a gold kept here as an integer is
    the integer the reward compares with, and no integer gold the reward reads is skipped.
    """
    return integer_text(answer)


def _int_max_digits() -> int:
    """Python's int-string conversion limit (0: none)."""
    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0


def _json_int(text: str) -> int | str:
    """``json.loads``' parse_int: an integer literal over Python's int-string limit stays its
    digits (an int() of it raises, naming neither file nor row)."""
    limit = _int_max_digits()
    return text if limit and len(text.lstrip("-")) > limit else int(text)


def _json_float(text: str) -> float | int:
    """``json.loads``' parse_float: a literal that writes a whole number past a float's exact
    integers ("1e23", "12345678901234567.0") is that integer, not the float nearest it."""
    value = float(text)
    if math.isfinite(value) and value.is_integer() and abs(value) >= 2**53:
        exact = decimal.Decimal(text)
        if exact == exact.to_integral_value():
            return int(exact)
    return value


def _decode_line(line: bytes) -> Any:
    """One JSON-lines row, or a BadRow saying why it is none."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow("not_utf8", f"byte {e.start + 1} of the line is {line[e.start:e.start + 1]!r}")
    try:
        return json.loads(text, parse_int=_json_int, parse_float=_json_float)
    except ValueError as e:  # JSONDecodeError, and whatever json raises past it
        return BadRow("bad_json", str(e).splitlines()[0][:200])


def read_numbered_rows(path: str) -> list[tuple[int, Any]]:
    """(row number, raw row) of each row of a .jsonl/.json/.parquet file, numbered from 1 (a
    .jsonl file's line numbers; blank lines are no rows). A .jsonl row that does not decode (not
    UTF-8, not JSON) is a ``BadRow`` in its place; a .json file is one document, so a byte that
    is not UTF-8 or a JSON error in it raises, naming the file and the line. A .jsonl file that is
    one JSON array (a common mistake) is read as that array, rows numbered by their place in it."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:  # lazily: pyarrow is large and only parquet files need it
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("reading parquet needs pyarrow (pip install pyarrow)") from e
        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if ext not in (".jsonl", ".json"):
        raise ValueError(f"unsupported dataset file {path!r} (expected .jsonl, .json or .parquet)")
    with open(path, "rb") as f:
        data = f.read()
    data = data.removeprefix(codecs.BOM_UTF8)
    if ext == ".jsonl" and data.lstrip().startswith(b"["):
        rows = _one_json_array(data)
        if rows is not None:  # a JSON array under a .jsonl name: its rows, not one bad row per line
            return list(enumerate(rows, start=1))
    if ext == ".json" and data.lstrip().startswith(b"["):
        try:
            rows = json.loads(data.decode("utf-8"), parse_int=_json_int, parse_float=_json_float)
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ValueError(f"{path}: line {line} is not UTF-8 (byte "
                             f"{data[e.start:e.start + 1]!r} at offset {e.start}); a .json dataset is one document: "
                             "fix the file, or write it as .jsonl, whose bad lines are skipped and counted") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset must be a list of rows")
        return list(enumerate(rows, start=1))
    return [(number, _decode_line(line)) for number, line in enumerate(data.split(b"\n"), start=1) if line.strip()]


def _one_json_array(data: bytes) -> list | None:
    """The rows of ``data`` when the whole of it is one JSON array, else None (JSON lines whose
    first row is a list; what does not decode is then counted line by line)."""
    try:
        rows = json.loads(data.decode("utf-8"), parse_int=_json_int, parse_float=_json_float)
    except ValueError:  # UnicodeDecodeError, JSONDecodeError
        return None
    return rows if isinstance(rows, list) else None


SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
HEAD_ROWS = 64  # the rows ``dataset_problems`` reads


def has_known_layout(row: Any) -> bool:
    """Whether a row has the columns of a layout ``normalize_row`` reads: a problem column and an
    answer column, or verl's chat ``prompt`` with ``reward_model.ground_truth``."""
    if not isinstance(row, dict):
        return False
    rm = row.get("reward_model")
    return (any(k in row for k in _PROBLEM_KEYS + ("prompt",))
            and (any(k in row for k in _ANSWER_KEYS) or (isinstance(rm, dict) and "ground_truth" in rm)))


def _head_rows(path: str, n: int) -> list[Any]:
    """Up to the first ``n`` rows of a dataset file (``BadRow`` for a .jsonl line that does not
    decode), reading no more of a .jsonl or .parquet file than they take."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
        return [] if batch is None else batch.to_pylist()
    if ext in (".json", ".jsonl"):
        with open(path, "rb") as f:
            first = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        if first.startswith(b"["):  # one document: read whole (read_numbered_rows says where it breaks)
            return [row for _, row in read_numbered_rows(path)[:n]]
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f):
            if line.strip():
                rows.append(_decode_line(line.removeprefix(codecs.BOM_UTF8) if number == 0 else line))
            if len(rows) >= n:
                break
    return rows


# what a data file's rows must hold, by kind: (the check of one row, the columns accepted in words)
ROW_LAYOUTS = {
    "problems": (has_known_layout,
                 f"a problem column ({', '.join(_PROBLEM_KEYS)}) with an answer column ({', '.join(_ANSWER_KEYS)}), "
                 "or verl's prompt + reward_model.ground_truth (docs/data.md)"),
    "conversations": (lambda row: isinstance(row, dict) and "messages" in row,
                      'a "messages" column: an OpenAI-style chat list (docs/data.md)'),
}


# a .jsonl/.json file whose first bytes are one of these is no text: said as what it is, where its
# lines would only read as rows that are not UTF-8
_BINARY_SIGNATURES = {
    b"\x1f\x8b": "is gzip-compressed: decompress it first (gunzip)",
    b"\x28\xb5\x2f\xfd": "is zstd-compressed: decompress it first (zstd -d)",
    b"BZh": "is bzip2-compressed: decompress it first (bunzip2)",
    b"\xfd7zXZ\x00": "is xz-compressed: decompress it first (unxz)",
    b"PK\x03\x04": "is a zip archive: extract the data file from it",
    b"PAR1": "is a parquet file: give it the .parquet extension",
}


def _binary_kind(path: str) -> str | None:
    """What ``_BINARY_SIGNATURES`` says a .jsonl/.json file's first bytes are, or None."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((what for magic, what in _BINARY_SIGNATURES.items() if head.startswith(magic)), None)


def dataset_problems(path: str, kind: str = "problems") -> list[str]:
    """What makes ``path`` unusable as a data file of ``kind`` (``ROW_LAYOUTS``), found cheaply
    before a run (its first ``HEAD_ROWS`` rows): not a readable file of a supported type, empty,
    or none of those rows has the columns of a known layout (the message lists the columns found
    and those accepted). [] when a run can read it; rows it cannot use are the loader's to report."""
    row_ok, accepted = ROW_LAYOUTS[kind]
    if os.path.isdir(path):
        return [f"is a directory: give one {' / '.join(SUPPORTED_EXTENSIONS)} file (docs/data.md)"]
    if not os.path.isfile(path):
        return ["does not exist" if not os.path.exists(path) else "is not a regular file"]
    if os.path.splitext(path)[1].lower() not in SUPPORTED_EXTENSIONS:
        return [f"is not a {' / '.join(SUPPORTED_EXTENSIONS)} file (docs/data.md)"]
    if not os.access(path, os.R_OK):
        return ["is not readable (check its permissions)"]
    if os.path.getsize(path) == 0:
        return ["is empty"]
    binary = _binary_kind(path) if os.path.splitext(path)[1].lower() != ".parquet" else None
    if binary:
        return [f"{binary} (docs/data.md)"]
    try:
        rows = _head_rows(path, HEAD_ROWS)
    except (OSError, ValueError) as e:  # a .json document that does not parse, a damaged parquet file
        return [f"cannot be read: {str(e).splitlines()[0]}"]
    except Exception as e:  # noqa: BLE001 - pyarrow's own errors: not a parquet file
        return [f"cannot be read: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
    if not rows:
        return ["has no rows"]
    if any(row_ok(row) for row in rows):
        return []
    decoded = [row for row in rows if not isinstance(row, BadRow)]
    if not decoded:
        return [f"its first {len(rows)} rows are not JSON ({rows[0]})"]
    columns = sorted({str(k) for row in decoded if isinstance(row, dict) for k in row})
    return [f"its first {len(rows)} rows lack the columns of a known layout; found {columns or 'no columns'}; "
            f"accepted: {accepted}"]


def read_rows(path: str) -> tuple[list[Any], collections.Counter]:
    """Raw rows of a .jsonl/.json/.parquet file, plus counts of lines that did not decode."""
    rows, bad = [], collections.Counter()
    for _, row in read_numbered_rows(path):
        if isinstance(row, BadRow):
            bad[row.reason] += 1
        else:
            rows.append(row)
    return rows, bad


def records_digest(records: Iterable[dict]) -> str:
    """A digest of the problems and answers of ``records``, in order: what a stage's data
    position indexes into (a resumed stage checks that it draws from the data its checkpoints
    drew from). The files' paths and the rows' numbers are not in it: moved data is the same data."""
    digest = hashlib.sha256()
    for record in records:
        for field in (record["problem"], record["answer"]):
            data = str(field).encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


def load_problems(paths: str | Iterable[str], integer_only: bool = True,
                  answer_filter: str | None = None,
                  handling: str = "paper") -> tuple[list[dict[str, str]], DataReport]:
    """Normalised records from one or more files, and a report of everything dropped, with the
    rows (``FILE:ROW [why]``). A record's ``uid`` is ``FILE:ROW`` (``read_numbered_rows``'
    numbering). A problem seen before (in any of the files) is dropped as ``duplicate``, or as
    ``duplicate_other_answer`` when its answer differs: the first row wins.

    ``answer_filter`` (``ANSWER_FILTERS``; an RL run's ``data.answer_filter``) chooses the answers
    kept; without it ``integer_only`` says ("integer", or every answer as written: evaluation).
    Answers the filter drops are counted, and said in one warning line with the setting that
    keeps them.

    ``handling="official"`` (``DATA_HANDLINGS``; ``data.handling``) reads the rows as the official
    code does (``official_row``): nothing stripped, no answer filter, and a repeated problem is
    KEPT (its own row, uid and GRPO group, as verl gives every row of a batch a fresh uid); the
    repeats are counted in one log line."""
    if handling not in DATA_HANDLINGS:
        raise ValueError(f"handling={handling!r}: choose one of {list(DATA_HANDLINGS)}")
    if handling == "official":
        return _load_official(paths)
    if answer_filter is None:
        answer_filter = "integer" if integer_only else ""
    elif answer_filter not in ANSWER_FILTERS:
        raise ValueError(f"answer_filter={answer_filter!r}: choose one of {list(ANSWER_FILTERS)}")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    records: list[dict[str, str]] = []
    report = DataReport()
    seen: dict[str, tuple[str, str]] = {}  # problem -> (answer, uid) of its first row
    for rec, where, source in _readable_rows(paths, lambda row: _checked_record(row, answer_filter), report):
        first = seen.setdefault(rec["problem"], (rec["answer"], where))
        if first[1] != where:
            same = first[0] == rec["answer"]
            report.skip("duplicate" if same else "duplicate_other_answer",
                        f"{where} [of {first[1]}{'' if same else f', answer {first[0]!r}'}]")
            continue
        records.append({**rec, "uid": where, "source": source})
    report.kept = len(records)
    if report.num_skipped:
        log.warning("dataset %s", report)
    dropped = report.skipped["non_integer_answer"]
    if dropped:
        log.warning("dataset: %d of %d rows have an answer that is not an integer and are skipped: RL trains on "
                    "integer answers only, as rStar2-Agent (data.answer_filter='integer'); "
                    "data.answer_filter=any keeps every answer the verifier can compare (docs/data.md)",
                    dropped, report.total)
    if not records:
        hint = ("; data.answer_filter=any keeps every answer the verifier can compare (docs/data.md)"
                if dropped else "")
        raise DataError(f"no usable rows in {list(paths)} ({report}){hint}")
    return records, report


def _readable_rows(paths: list, read: Callable[[Any], dict[str, str]], report: DataReport
                   ) -> Iterator[tuple[dict[str, str], str, str]]:
    """(record, uid "file:row", file name) of each row of ``paths`` that ``read`` turns into a
    record, in file order; every row is counted in ``report`` and one that ``read`` refuses
    (``BadRow``) is skipped there with its reason."""
    for path in paths:
        source = os.path.basename(os.fspath(path))
        for number, row in read_numbered_rows(os.fspath(path)):
            report.total += 1
            where = f"{source}:{number}"
            try:
                rec = read(row)
            except BadRow as e:
                report.skip(e.reason, f"{where} [{e.detail}]" if e.detail else where)
                continue
            yield rec, where, source


def _unicode_text(rec: dict[str, str]) -> dict[str, str]:
    """``rec`` when its problem and answer are Unicode text; a JSON ``\\ud800`` escape (a lone
    surrogate) decodes to none: the tokenizer would read it as U+FFFD, and the stage-3 filter's
    and the evaluation's UTF-8 outputs would fail on it after all their rollouts. Raises BadRow
    ``not_utf8``, as for a byte that is not UTF-8."""
    for field in ("problem", "answer"):
        try:
            rec[field].encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow("not_utf8", f"the {field} holds a lone surrogate {rec[field][e.start]!r} "
                                     "(a JSON \\u escape)") from None
    return rec


def _official_record(row: Any) -> dict[str, str]:
    if isinstance(row, BadRow):  # a .jsonl line that did not decode
        raise row
    return _unicode_text(official_row(row))


def _load_official(paths: str | Iterable[str]) -> tuple[list[dict[str, str]], DataReport]:
    """``load_problems(handling="official")``: every row ``official_row`` reads, in file order."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    records: list[dict[str, str]] = []
    report = DataReport()
    first: dict[str, str] = {}  # problem -> the uid of its first row (only to count the repeats)
    repeats = []
    for rec, where, source in _readable_rows(paths, _official_record, report):
        if first.setdefault(rec["problem"], where) != where:
            repeats.append(f"{where} [of {first[rec['problem']]}]")
        records.append({**rec, "uid": where, "source": source})
    report.kept = len(records)
    if report.num_skipped:
        log.warning("dataset %s", report)
    if repeats:
        log.info("dataset: %d rows repeat an earlier problem and are kept, as the official code keeps them "
                 "(data.handling='official'): rows %s%s", len(repeats), ", ".join(repeats[:EXAMPLE_ROWS]),
                 ", ..." if len(repeats) > EXAMPLE_ROWS else "")
    if not records:
        raise DataError(f"no usable rows in {list(paths)} ({report})")
    return records, report


def verifier_can_read(answer: str) -> bool:
    """Whether the verifier can check answers against ``answer`` as their gold answer
    (``why_unverifiable`` finds nothing against it)."""
    return why_unverifiable(answer) is None


def why_unverifiable(answer: str) -> str | None:
    """Why the verifier (``env.verify``) cannot use ``answer`` as a gold answer, or None when it
    can; a gold it cannot use would score nearly every rollout 0, blamed on the model:

    * math-verify does not parse it into a mathematical object (only its text, which it could
      match only character for character), or not within ``VERIFIER_PARSE_TIMEOUT_S``;
    * its comparison with another value (0) does not end within ``VERIFIER_COMPARE_TIMEOUT_S``
      (``10^{10^{10}}``: sympy evaluates the power), so every verification of it would time out,
      and a timeout scores 0. Comparing it with itself would prove nothing: equal trees are equal
      at once.

    An integer passes at once, without sympy: the verifier compares integers exactly (its fast
    path), and the paper's data is integers. Both time limits are math-verify's alarm, which only
    the main thread has (where datasets are loaded); elsewhere the parse runs without one and the
    comparison is not tried."""
    if integer_answer(answer) is not None:
        return None
    import threading

    main = threading.current_thread() is threading.main_thread()
    parsed = _parsed_gold(answer, VERIFIER_PARSE_TIMEOUT_S if main else None)
    if not any(not isinstance(p, str) for p in parsed):
        return "the verifier cannot parse it"
    if not main:
        _warn_comparison_not_timed()
        return None
    if _comparison_times_out(parsed, VERIFIER_COMPARE_TIMEOUT_S):
        return f"the verifier's comparison with it takes over {VERIFIER_COMPARE_TIMEOUT_S} s"
    return None


def _parsed_gold(answer: str, timeout_s: int | None) -> list:
    """math-verify's parse of the gold ``\\boxed{answer}`` (as the verifier parses it); [] when it
    fails or runs past ``timeout_s``."""
    from math_verify import grader, parser  # sympy-heavy: imported on first use

    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True  # no once-per-process notice
    try:
        return parser.parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s)
    except Exception:  # noqa: BLE001 - math-verify's timeout, or a parser error: unreadable either way
        return []


def _comparison_times_out(parsed_gold: list, timeout_s: int) -> bool:
    """Whether math-verify's comparison of ``parsed_gold`` with 0 runs past ``timeout_s`` (main
    thread only). An error it raises came in time: the verifier handles it as it does any."""
    from math_verify import grader, parser
    from math_verify.errors import TimeoutException

    try:
        # raise_on_error: without it math-verify answers a timeout False, as it does "not equal"
        grader.verify(parsed_gold, parser.parse("\\boxed{0}", parsing_timeout=None), timeout_seconds=timeout_s,
                      raise_on_error=True)
    except TimeoutException:
        return True
    except Exception:  # noqa: BLE001 - it answered in time
        return False
    return False


_comparison_warned = []


def _warn_comparison_not_timed() -> None:
    if not _comparison_warned:
        _comparison_warned.append(True)
        log.warning("dataset: loaded off the main thread, where math-verify has no time limit: non-integer gold "
                    "answers whose comparison would hang the verifier are not detected (load in the main thread)")


def _checked_record(row: Any, answer_filter: str) -> dict[str, str]:
    """``normalize_row``, then the answer ``answer_filter`` keeps (integers canonical; "" keeps
    every answer as written); raises BadRow."""
    if isinstance(row, BadRow):
        raise row
    rec = _unicode_text(normalize_row(row))
    if answer_filter:
        canon = integer_answer(rec["answer"])
        if canon is None:
            if answer_filter == "integer":
                raise BadRow("non_integer_answer")
            why = why_unverifiable(rec["answer"])
            if why:
                raise BadRow("unverifiable_answer", why)
            return rec
        limit = _int_max_digits()
        # int() refuses it, and no answer can equal it: the verifier reads none over
        # verify.MAX_ANSWER_CHARS (1,000) characters
        if limit and len(canon.lstrip("-")) > limit:
            raise BadRow("answer_too_long", f"{len(canon.lstrip('-'))} digits, Python's limit is {limit}")
        rec["answer"] = canon
    return rec


def drop_long_prompts(records: list[dict], report: DataReport, prompt_len, max_len: int, flag: str) -> list[dict]:
    """``records`` without those whose prompt is longer than ``max_len`` tokens
    (``prompt_len(problem)`` measures it as the rollouts will encode it), each counted in
    ``report`` as ``prompt_too_long`` with its row (a record's ``uid``). Raises DataError (a data
    file the run cannot use), naming ``flag``, when none is left."""
    kept = []
    for rec in records:
        if prompt_len(rec["problem"]) > max_len:
            report.skip("prompt_too_long", rec.get("uid", "?"))
        else:
            kept.append(rec)
    report.kept = len(kept)
    if len(kept) < len(records):
        log.warning("dataset: %d prompts longer than %s=%d tokens skipped; %s", len(records) - len(kept), flag,
                    max_len, report.describe("prompt_too_long"))
    if not kept:
        raise DataError(f"every prompt is longer than {flag}={max_len} tokens ({report})")
    return kept


def host_shard(num_records: int, process_index: int, process_count: int, even: bool = True) -> slice:
    """Record indices owned by this host: a strided slice.

    ``even`` drops the last num_records % process_count records so every host has the same number
    of batches (hosts that ran out early would hang in the next collective).
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    stop = num_records - num_records % process_count if even else num_records
    return slice(process_index, stop, process_count)


def make_dataset(
    records: list[dict[str, str]],
    batch_size: int,
    seed: int = 0,
    num_epochs: int | None = 1,
    shuffle: bool = True,
    process_index: int | None = None,
    process_count: int | None = None,
    drop_remainder: bool = True,
    even_shards: bool = True,
    handling: str = "paper",
) -> "RowBatches":
    """Batches (lists of dicts) of ``records``: host shard -> shuffle (per epoch) -> repeat,
    then ``batch_size`` rows at a time (``RowBatches``).

    ``num_epochs=None`` repeats forever. process_index/count default to jax.process_index and the training processes'
    count (``rstarjax.processes``).
    ``iter(ds)`` gives an iterator with get_state()/set_state() for checkpoints, which count rows.
    ``handling="official"``: the official loader's order instead (``OfficialOrder``; ``seed`` unused).
    """
    if batch_size <= 0:
        raise ValueError("batch_size must be > 0")
    if process_index is None or process_count is None:
        process_index = jax.process_index() if process_index is None else process_index
        process_count = processes.training_count() if process_count is None else process_count
    if handling == "official":
        order = OfficialOrder(records, batch_size * process_count, process_index, process_count, num_epochs, shuffle)
        return RowBatches(order, batch_size, drop_remainder)
    ds = grain.MapDataset.source(records)[host_shard(len(records), process_index, process_count, even_shards)]
    if len(ds) == 0:
        raise ValueError(f"host {process_index}/{process_count} got no records out of {len(records)}")
    if drop_remainder and len(ds) < batch_size:
        raise DataError(f"{len(ds)} usable records on this host cannot fill one batch of {batch_size} prompts "
                        f"(the prompts per step, over the processes that read data)")
    if shuffle:
        ds = ds.shuffle(seed=seed)  # grain reshuffles with a new permutation each epoch of repeat()
    return RowBatches(ds.repeat(num_epochs).to_iter_dataset(), batch_size, drop_remainder)


# verl's create_rl_sampler seeds its torch.Generator with data.seed, which the official run leaves
# at its default (legacy_data.yaml sets none: 1)
OFFICIAL_DATA_SEED = 1


def torch_randperms(n: int, seed: int = OFFICIAL_DATA_SEED, skip: int = 0):
    """The permutations ``torch.randperm(n, generator=g)`` returns call after call for a CPU
    generator ``g`` seeded ``seed``, from call number ``skip`` on, without torch: torch's CPU
    randperm swaps position i with i + (a 32-bit MT19937 draw % (n - i)) for i < n - 1, and its
    generator is the MT19937 that numpy's legacy ``RandomState(seed)`` seeds the same way."""
    if not 0 < n < 2**32 // 20:  # past that bound torch draws 64-bit numbers
        raise ValueError(f"n={n} must be in (0, {2**32 // 20})")
    bits = np.random.RandomState(seed)._bit_generator
    bits.random_raw(skip * (n - 1))
    while True:
        perm = np.arange(n)
        for i, draw in enumerate(bits.random_raw(n - 1).tolist()):
            z = i + draw % (n - i)
            perm[i], perm[z] = perm[z], perm[i]
        yield perm


class OfficialOrder:
    """Rows in the order the official trainer reads them (``data.handling="official"``): verl's
    StatefulDataLoader over its RLHFDataset (J-shang/verl d0dc976 ``ray_trainer._create_dataloader``
    and ``main_ppo.create_rl_sampler``): torch's ``RandomSampler`` with a generator seeded
    ``OFFICIAL_DATA_SEED`` (``shuffle``; else the file order), batches of ``global_batch`` rows
    with ``drop_last=True``, so each epoch's last ``len(records) % global_batch`` rows of its
    order are not read. ``RandomSampler.__iter__`` draws one permutation per epoch and a second,
    empty-sliced one as it ends, so epoch e reads permutation 2e. This process reads every
    ``process_count``-th row of that sequence from ``process_index`` (its strided share of each
    global batch). Iterating gives an iterator with grain's ``get_state``/``set_state``
    (``{"next_index": rows read}``), as ``RowBatches`` needs."""

    def __init__(self, records: list, global_batch: int, process_index: int = 0, process_count: int = 1,
                 num_epochs: int | None = None, shuffle: bool = True):
        self.per_epoch = len(records) // global_batch * global_batch
        if self.per_epoch == 0:
            raise DataError(f"{len(records)} usable records cannot fill one batch of {global_batch} prompts "
                        f"(the prompts per step)")
        if global_batch % process_count:
            raise ValueError(f"a batch of {global_batch} rows does not split over {process_count} processes")
        self.records, self.index, self.count = records, process_index, process_count
        self.num_epochs, self.shuffle = num_epochs, shuffle

    def __iter__(self) -> "_OfficialRows":
        return _OfficialRows(self)


class _OfficialRows:
    def __init__(self, order: OfficialOrder):
        self.order, self.next_index = order, 0
        self._epoch, self._perm = -1, None

    def __iter__(self):
        return self

    def _permutation(self, epoch: int):
        if epoch != self._epoch:
            n = len(self.order.records)
            self._perm = next(torch_randperms(n, skip=2 * epoch)) if self.order.shuffle else np.arange(n)
            self._epoch = epoch
        return self._perm

    def __next__(self):
        o = self.order
        epoch, row = divmod(self.next_index * o.count + o.index, o.per_epoch)
        if o.num_epochs is not None and epoch >= o.num_epochs:
            raise StopIteration
        self.next_index += 1
        return o.records[int(self._permutation(epoch)[row])]

    def get_state(self) -> dict:
        return {"next_index": self.next_index}

    def set_state(self, state: dict) -> None:
        self.next_index = int(state["next_index"])


class RowBatches:
    """``batch_size`` rows at a time from a row-level grain dataset. Its iterators' state (what a
    checkpoint stores) is the position in ROWS: a run resumed with another batch size (e.g. a
    changed ``rl.prompts_per_step``) continues at the next row, where a batch count would skip
    or repeat data. Rows cross epoch boundaries as one sequence, as ``grain``'s ``batch`` does."""

    def __init__(self, rows: grain.IterDataset, batch_size: int, drop_remainder: bool = True):
        self.rows, self.batch_size, self.drop_remainder = rows, batch_size, drop_remainder

    def __iter__(self) -> "RowBatchIterator":
        return RowBatchIterator(iter(self.rows), self.batch_size, self.drop_remainder)


class RowBatchIterator:
    """``next()``: the next batch; a last batch short of ``batch_size`` ends the iteration when
    ``drop_remainder``. ``get_state()`` = ``{"rows": rows consumed}``."""

    def __init__(self, rows, batch_size: int, drop_remainder: bool):
        self._rows, self.batch_size, self.drop_remainder = rows, batch_size, drop_remainder

    def __iter__(self):
        return self

    def __next__(self) -> list:
        batch = []
        for _ in range(self.batch_size):
            try:
                batch.append(next(self._rows))
            except StopIteration:
                break
        if not batch or (self.drop_remainder and len(batch) < self.batch_size):
            raise StopIteration
        return batch

    def take(self, n: int) -> list:
        """The next ``n`` rows (fewer where finite data ends; [] once it has), whatever the batch
        size: partial rollouts start only as many prompts as completed groups made room for."""
        rows = []
        for _ in range(max(0, int(n))):
            try:
                rows.append(next(self._rows))
            except StopIteration:
                break
        return rows

    def get_state(self) -> dict:
        return {"rows": int(self._rows.get_state()["next_index"])}

    def set_state(self, state: dict) -> None:
        """A state of ``get_state``; or ``{"next_index": batches}`` as checkpoints written before
        positions counted rows hold it, read as that many batches of this iterator's size (right
        when the batch size did not change since)."""
        rows = state["rows"] if "rows" in state else int(state["next_index"]) * self.batch_size
        self._rows.set_state({"next_index": int(rows)})


def problem_dataset(
    paths: str | Iterable[str],
    batch_size: int,
    seed: int = 0,
    num_epochs: int | None = 1,
    integer_only: bool = True,
    answer_filter: str | None = None,
    handling: str = "paper",
    **kwargs,
) -> tuple[RowBatches, DataReport]:
    """load_problems + make_dataset in one call."""
    records, report = load_problems(paths, integer_only=integer_only, answer_filter=answer_filter,
                                    handling=handling)
    return make_dataset(records, batch_size, seed=seed, num_epochs=num_epochs, **kwargs), report
