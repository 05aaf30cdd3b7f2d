"""Math problem datasets as grain pipelines, normalised to {"problem", "answer", "uid", "source"}.

Layouts understood (first match wins):
  * DAPO-Math-17k / verl: ``prompt`` = chat list [{"role": "user", "content": ...}] (the DAPO
    instruction wrapper is stripped) and ``reward_model.ground_truth``;
  * HF math sets: ``problem``/``Problem``/``question``/``Question`` and ``answer``/``Answer``/
    ``expected_answer``/``final_answer``/``ground_truth`` (MATH-500, AIME24/25, OpenMathReasoning);
    GSM8K-style answers "... #### 72" keep the part after "####".
Files: ``.jsonl`` / ``.json`` (a list of rows or JSON lines) and ``.parquet`` (needs pyarrow).

Rows are read and normalised eagerly on the host (datasets here are ~10^4-10^5 problems): bad rows
(undecodable JSON, missing or empty fields) are skipped and COUNTED by reason in ``DataReport``;
non-integer answers are filtered out when ``integer_only`` (rStar2-Agent §4.2) and counted too.
The pipeline is then: per-host shard (process_index::process_count) -> seeded shuffle, reshuffled
every epoch -> repeat(num_epochs) -> batch. Its iterator's ``get_state()`` / ``set_state()``
(a small dict) is what a checkpoint stores to resume exactly.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
from typing import Any, Iterable

import grain
import jax
import numpy as np

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


class BadRow(ValueError):
    """A row that cannot be normalised; ``reason`` is the counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclasses.dataclass
class DataReport:
    """What loading kept and dropped, by reason (never silent)."""

    total: int = 0
    kept: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def merge(self, other: "DataReport") -> "DataReport":
        return DataReport(self.total + other.total, self.kept + other.kept, self.skipped + other.skipped)

    def __str__(self) -> str:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"{self.kept}/{self.total} rows kept; skipped: {reasons}"


def _text(x: Any) -> str | None:
    if isinstance(x, str):
        return x.strip()
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    if isinstance(x, (float, np.floating)) and np.isfinite(x):
        return str(int(x)) if float(x).is_integer() else repr(float(x))
    return None


def strip_dapo_wrapper(text: str) -> str:
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text)).strip()


def _chat_user_content(prompt: Any) -> str | None:
    if isinstance(prompt, np.ndarray):
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)):
        return None
    for msg in prompt:
        if isinstance(msg, dict) and msg.get("role") == "user" and isinstance(msg.get("content"), str):
            return msg["content"]
    return None


def normalize_row(row: Any) -> dict[str, str]:
    """{"problem", "answer"} from any supported layout; raises BadRow otherwise."""
    if not isinstance(row, dict):
        raise BadRow("not_a_mapping", type(row).__name__)
    problem = None
    answer = None
    if "prompt" in row and not isinstance(row["prompt"], str):  # DAPO / verl layout
        content = _chat_user_content(row["prompt"])
        if content is None:
            raise BadRow("bad_chat_prompt")
        problem = strip_dapo_wrapper(content)
        rm = row.get("reward_model")
        if isinstance(rm, dict):
            answer = _text(rm.get("ground_truth"))
    else:
        for k in _PROBLEM_KEYS + ("prompt",):
            if k in row:
                problem = _text(row[k])
                break
    if answer is None:
        for k in _ANSWER_KEYS:
            if k in row and row[k] is not None:
                answer = _text(row[k])
                break
    if problem is None:
        raise BadRow("missing_problem")
    if answer is None:
        raise BadRow("missing_answer")
    if "####" in answer:  # GSM8K: rationale "#### final"
        answer = answer.rsplit("####", 1)[1].strip()
    if not problem:
        raise BadRow("empty_problem")
    if not answer:
        raise BadRow("empty_answer")
    return {"problem": problem, "answer": answer}


_INT_RE = re.compile(r"^[+-]?\d+(?:\.0+)?$")


def integer_answer(answer: str) -> str | None:
    """The canonical integer string of an answer ("\\boxed{1{,}000}" -> "1000"), or None.

    rStar2-Agent §4.2 trains only on integer answers (equivalence of expressions is unreliable).
    """
    a = answer.strip().strip("$").strip()
    m = re.fullmatch(r"\\boxed\{(.*)\}", a, re.S)
    if m:
        a = m.group(1).strip()
    a = a.replace("{,}", "").replace("\\,", "").replace("\\!", "").replace(" ", "")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.0+)?", a):
        a = a.replace(",", "")
    if not _INT_RE.match(a):
        return None
    return str(int(a.split(".")[0]))


def read_rows(path: str) -> tuple[list[Any], collections.Counter]:
    """Raw rows of a .jsonl/.json/.parquet file, plus counts of lines that did not decode."""
    bad: collections.Counter = collections.Counter()
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:  # lazily: pyarrow is large and only parquet files need it
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("reading parquet needs pyarrow (pip install pyarrow)") from e
        return pq.read_table(path).to_pylist(), bad
    if ext not in (".jsonl", ".json"):
        raise ValueError(f"unsupported dataset file {path!r} (expected .jsonl, .json or .parquet)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if ext == ".json" and text.lstrip().startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must be a list of rows")
        return data, bad
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad["bad_json"] += 1
    return rows, bad


def load_problems(paths: str | Iterable[str], integer_only: bool = True) -> tuple[list[dict[str, str]], DataReport]:
    """Normalised records from one or more files, and a report of everything dropped."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    records: list[dict[str, str]] = []
    report = DataReport()
    for path in paths:
        rows, bad = read_rows(os.fspath(path))
        report.total += len(rows) + sum(bad.values())
        report.skipped.update(bad)
        source = os.path.basename(os.fspath(path))
        for i, row in enumerate(rows):
            try:
                rec = normalize_row(row)
            except BadRow as e:
                report.skipped[e.reason] += 1
                continue
            if integer_only:
                canon = integer_answer(rec["answer"])
                if canon is None:
                    report.skipped["non_integer_answer"] += 1
                    continue
                rec["answer"] = canon
            rec["uid"] = f"{source}:{i}"
            rec["source"] = source
            records.append(rec)
    report.kept = len(records)
    if report.num_skipped:
        log.warning("dataset %s", report)
    if not records:
        raise ValueError(f"no usable rows in {list(paths)} ({report})")
    return records, report


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
) -> grain.IterDataset:
    """grain pipeline over records: host shard -> shuffle (per epoch) -> repeat -> batch (lists of dicts).

    ``num_epochs=None`` repeats forever. process_index/count default to jax.process_index/count.
    ``iter(ds)`` gives a grain DatasetIterator with get_state()/set_state() for checkpoints.
    """
    if batch_size <= 0:
        raise ValueError("batch_size must be > 0")
    if process_index is None or process_count is None:
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    ds = grain.MapDataset.source(records)[host_shard(len(records), process_index, process_count, even_shards)]
    if len(ds) == 0:
        raise ValueError(f"host {process_index}/{process_count} got no records out of {len(records)}")
    if drop_remainder and len(ds) < batch_size:
        raise ValueError(f"{len(ds)} records on this host cannot fill one batch of {batch_size}")
    if shuffle:
        ds = ds.shuffle(seed=seed)  # grain reshuffles with a new permutation each epoch of repeat()
    ds = ds.repeat(num_epochs)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    return ds.to_iter_dataset()


def problem_dataset(
    paths: str | Iterable[str],
    batch_size: int,
    seed: int = 0,
    num_epochs: int | None = 1,
    integer_only: bool = True,
    **kwargs,
) -> tuple[grain.IterDataset, DataReport]:
    """load_problems + make_dataset in one call."""
    records, report = load_problems(paths, integer_only=integer_only)
    return make_dataset(records, batch_size, seed=seed, num_epochs=num_epochs, **kwargs), report
