"""Data pipeline: every layout, bad rows counted, host shards, epochs, resume from iterator state."""
import json

import pytest

from rstarjax.io.data import (
    integer_answer,
    load_problems,
    make_dataset,
    normalize_row,
    problem_dataset,
)

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_row(problem, answer):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "x"},
    }


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def test_layouts_normalised():
    assert normalize_row(dapo_row("What is 1+1?", "2")) == {"problem": "What is 1+1?", "answer": "2"}
    assert normalize_row({"problem": "P", "answer": "\\frac{1}{2}", "solution": "..."}) == {"problem": "P", "answer": "\\frac{1}{2}"}
    assert normalize_row({"ID": "2024-I-1", "Problem": "AIME P", "Answer": 204}) == {"problem": "AIME P", "answer": "204"}
    assert normalize_row({"question": "Q", "answer": "so 3*4=12\n#### 12"}) == {"problem": "Q", "answer": "12"}
    assert normalize_row({"problem": "P", "expected_answer": "7"}) == {"problem": "P", "answer": "7"}


@pytest.mark.parametrize(
    "raw, canon",
    [("204", "204"), ("-3", "-3"), ("\\boxed{42}", "42"), ("$1{,}000$", "1000"), ("1,000,000", "1000000"),
     ("12.0", "12"), ("+5", "5"), ("1/2", None), ("\\frac{1}{2}", None), ("3.5", None), ("x=4", None), ("1,00", None),
     # ASCII digits only: the verifier (math-verify) reads no Arabic-Indic or full-width integer
     ("١٢", None), ("１２", None), ("1٢", None),
     # thousands in SI groups are the integer; other splits are two numbers, never joined
     ("1 000", "1000"), ("1\\,000", "1000"), ("-12 345 678", "-12345678"), ("32, 349", None), ("1 2", None),
     ("3 5", None), ("10 00", None),
     # read as the reward reads them (verify.integer_text): a text style, a bare decimal point, the
     # typeset minus sign (U+2212); "{,}" only in thousands groups, as ","
     ("\\text{42}", "42"), ("42.", "42"), ("\u22125", "-5"), ("$\\boxed{\\text{7}}$", "7"), ("1{,}00", None)],
)
def test_integer_answer(raw, canon):
    assert integer_answer(raw) == canon


def test_integer_golds_the_reward_reads_are_kept(tmp_path):
    """Golds the reward compares as integers were once skipped as non-integer answers."""
    rows = [{"problem": f"p{i}", "answer": a} for i, a in enumerate(["\\text{42}", "42.", "\u22125", "7"])]
    records, report = load_problems(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [r["answer"] for r in records] == ["42", "42", "-5", "7"]
    assert "non_integer_answer" not in report.skipped


def test_bad_rows_counted(tmp_path):
    rows = [
        dapo_row("good one", "5"),
        {"problem": "no answer here"},
        {"answer": "3"},
        {"problem": "   ", "answer": "1"},
        {"problem": "frac", "answer": "\\frac{1}{2}"},
        {"prompt": "not a chat list but a plain string", "answer": "9"},  # plain-string prompt is a problem
        {"prompt": [{"role": "system", "content": "no user"}], "reward_model": {"ground_truth": "1"}},
        [1, 2, 3],
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows, raw_lines=["{not json", ""])
    records, report = load_problems(path)
    assert [r["problem"] for r in records] == ["good one", "not a chat list but a plain string"]
    assert report.total == 9 and report.kept == 2
    assert dict(report.skipped) == {
        "bad_json": 1, "missing_answer": 1, "missing_problem": 1, "empty_problem": 1,
        "non_integer_answer": 1, "bad_chat_prompt": 1, "not_a_mapping": 1,
    }
    assert "2/9 rows kept" in str(report)
    recs_all, rep_all = load_problems(path, integer_only=False)
    assert rep_all.kept == 3 and "non_integer_answer" not in rep_all.skipped
    with pytest.raises(ValueError, match="no usable rows"):
        load_problems(write_jsonl(tmp_path / "bad.jsonl", [{"x": 1}]))


def test_chat_prompts_and_json_numbers_are_read_as_written(tmp_path):
    """A chat prompt is one user message (a system message is the template's to write); a
    conversation (several user turns, assistant turns) is skipped and counted, never cut to its
    first message. A JSON number answer past a float's exact integers is the integer the file
    writes (1e23 is 10**23, not int(1e23) = 99999999999999991611392)."""
    chat = lambda *msgs: {"prompt": [{"role": r, "content": c} for r, c in msgs], "reward_model": {"ground_truth": "4"}}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        json.dumps(chat(("system", "Answer in French."), ("user", "What is 2+2?"))),
        json.dumps(chat(("user", "Let x=3."), ("assistant", "ok"), ("user", "What is x+1?"))),
        json.dumps(chat(("user", "a"), ("user", "b"))),
        '{"problem": "What is 10^23?", "answer": 1e23}',
        '{"problem": "big", "answer": 12345678901234567.0}',
        '{"problem": "half", "answer": 2.5}']) + "\n")
    records, report = load_problems(str(path), integer_only=False)
    assert [(r["problem"], r["answer"]) for r in records] == [
        ("What is 2+2?", "4"), ("What is 10^23?", str(10**23)), ("big", "12345678901234567"), ("half", "2.5")]
    assert dict(report.skipped) == {"not_one_user_message": 2}


def test_parquet_and_json_layouts(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [dapo_row(f"p{i}", str(i)) for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    records, report = load_problems(str(tmp_path / "dapo.parquet"))
    assert [(r["problem"], r["answer"]) for r in records] == [(f"p{i}", str(i)) for i in range(4)]
    math500 = [{"problem": "a", "answer": "3", "subject": "Algebra", "level": 1, "unique_id": "x"}]
    pq.write_table(pa.Table.from_pylist(math500), tmp_path / "m.parquet")
    (tmp_path / "aime.json").write_text(json.dumps([{"Problem": "b", "Answer": 33}]))
    both, rep = load_problems([str(tmp_path / "m.parquet"), str(tmp_path / "aime.json")])
    assert [(r["problem"], r["answer"], r["source"]) for r in both] == [("a", "3", "m.parquet"), ("b", "33", "aime.json")]
    with pytest.raises(ValueError, match="unsupported"):
        load_problems(str(tmp_path / "x.csv"))


def records(n):
    return [{"problem": f"p{i}", "answer": str(i), "uid": f"u{i}"} for i in range(n)]


def uids(batches):
    return [r["uid"] for b in batches for r in b]


@pytest.mark.parametrize("shuffle", [False, True])
def test_host_shards_disjoint_and_covering(shuffle):
    recs = records(10)
    shards = [
        uids(make_dataset(recs, batch_size=1, seed=3, shuffle=shuffle, process_index=h, process_count=3,
                          even_shards=False))
        for h in range(3)
    ]
    flat = [u for s in shards for u in s]
    assert sorted(flat) == sorted(r["uid"] for r in recs) and len(flat) == 10  # disjoint + covering
    even = [len(uids(make_dataset(recs, 1, process_index=h, process_count=3))) for h in range(3)]
    assert even == [3, 3, 3]  # even shards: the same number of steps on every host


def test_epochs_shuffle_and_seed():
    recs = records(12)
    out = uids(make_dataset(recs, batch_size=4, seed=1, num_epochs=3, process_index=0, process_count=1))
    assert len(out) == 36
    epochs = [out[i * 12 : (i + 1) * 12] for i in range(3)]
    for e in epochs:
        assert sorted(e) == sorted(r["uid"] for r in recs)  # each epoch is a permutation
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    again = uids(make_dataset(recs, batch_size=4, seed=1, num_epochs=3, process_index=0, process_count=1))
    other = uids(make_dataset(recs, batch_size=4, seed=2, num_epochs=3, process_index=0, process_count=1))
    assert again == out and other != out


def test_resume_from_iterator_state(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row(f"q{i}", str(i)) for i in range(11)])
    ds, report = problem_dataset(path, batch_size=3, seed=5, num_epochs=2, process_index=0, process_count=1)
    it = iter(ds)
    for _ in range(4):  # crosses the first epoch boundary (11 records, batches of 3)
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # survives a JSON round trip (checkpointable)
    expected = [next(it) for _ in range(3)]
    ds2, _ = problem_dataset(path, batch_size=3, seed=5, num_epochs=2, process_index=0, process_count=1)
    it2 = iter(ds2)
    it2.set_state(state)
    assert [next(it2) for _ in range(3)] == expected


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_dataset(records(2), batch_size=4, process_index=0, process_count=1)
    with pytest.raises(ValueError):
        make_dataset(records(4), batch_size=1, process_index=3, process_count=2)
    with pytest.raises(ValueError):
        make_dataset(records(4), batch_size=0, process_index=0, process_count=1)


def test_answer_filter_integer_by_default_and_any_keeps_what_the_verifier_reads(tmp_path, caplog):
    """data.answer_filter (issue 47): "integer" (rStar2-Agent §4.2, the default) skips the other
    answers and says so in one warning line naming the setting that keeps them; "any" keeps every
    answer math-verify can read (and the official verifier then scores it right), integers still
    written canonically; an answer it cannot read is skipped and counted."""
    from rstarjax.env.verify import is_correct

    rows = [{"problem": "i", "answer": "1{,}000"}, {"problem": "f", "answer": "\\frac{1}{2}"},
            {"problem": "s", "answer": "\\sqrt{3}"}, {"problem": "u", "answer": "\\frac{"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level("WARNING", logger="rstarjax.io.data"):
        records, report = load_problems(path)
    assert [(r["problem"], r["answer"]) for r in records] == [("i", "1000")]
    lines = [r.getMessage() for r in caplog.records if "not an integer" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("dataset: 3 of 4 rows have an answer that is not an integer")
    assert "data.answer_filter=any" in lines[0]  # the setting, in the config's terms

    caplog.clear()
    with caplog.at_level("WARNING", logger="rstarjax.io.data"):
        records, report = load_problems(path, answer_filter="any")
    assert [(r["problem"], r["answer"]) for r in records] == [("i", "1000"), ("f", "\\frac{1}{2}"), ("s", "\\sqrt{3}")]
    assert dict(report.skipped) == {"unverifiable_answer": 1}
    assert not [r for r in caplog.records if "not an integer" in r.getMessage()]
    assert is_correct("<answer>\\boxed{0.5}</answer>", records[1]["answer"])  # the verifier compares it
    with pytest.raises(ValueError, match="answer_filter='fraction'"):
        load_problems(path, answer_filter="fraction")


def test_answer_filter_is_a_checked_data_setting(tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    import base

    from rstarjax.recipes.config import parse
    from rstarjax.validation import ConfigError

    c = base.get_config()
    c.model.random_init, c.model.preset = True, "tiny"
    c.data.train_path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "answer": "1"}])
    assert parse(c).data.answer_filter == "integer"
    c.data.answer_filter = "any"
    assert parse(c).data.answer_filter == "any"
    c.data.answer_filter = "all"
    with pytest.raises(ConfigError, match=r"--config.data.answer_filter='all': choose one of \['any', 'integer'\]"):
        parse(c)


def test_a_json_array_under_a_jsonl_name_loads_its_rows(tmp_path):
    """A JSON array file (pretty-printed or on one line) named .jsonl: its rows, as written, not
    one bad_json (or not_a_mapping) row per line and a run refused with a misleading message."""
    from rstarjax.io.data import dataset_problems

    rows = [{"problem": "What is 7 * 8?", "answer": "56"}, {"problem": "2 + 2?", "answer": 4}]
    for name, text in [("pretty.jsonl", json.dumps(rows, indent=2)), ("one_line.jsonl", json.dumps(rows) + "\n")]:
        path = tmp_path / name
        path.write_text(text)
        assert dataset_problems(str(path)) == []
        records, report = load_problems(str(path))
        assert [(r["problem"], r["answer"]) for r in records] == [("What is 7 * 8?", "56"), ("2 + 2?", "4")]
        assert (report.total, report.kept) == (2, 2)


def test_a_compressed_data_file_is_said_so(tmp_path):
    """A gzip'd .jsonl is refused in one line that says it is compressed, not as rows that are
    not UTF-8."""
    import gzip

    from rstarjax.io.data import dataset_problems

    path = tmp_path / "d.jsonl"
    with gzip.open(path, "wt") as f:
        f.write('{"problem": "p", "answer": "1"}\n')
    assert dataset_problems(str(path)) == ["is gzip-compressed: decompress it first (gunzip) (docs/data.md)"]


def test_no_prompt_short_enough_is_a_data_error(tmp_path):
    """Every prompt over rl.max_prompt_len is a data file the run cannot use: a DataError (one
    line, exit 2, rstarjax.main), not a ValueError's traceback."""
    from rstarjax.io.data import DataError, DataReport, drop_long_prompts

    report = DataReport(total=1, kept=1)
    with pytest.raises(DataError, match=r"every prompt is longer than --config.rl.max_prompt_len=8 tokens"):
        drop_long_prompts([{"problem": "long", "uid": "d.jsonl:1"}], report, lambda problem: 9, 8,
                          "--config.rl.max_prompt_len")


@pytest.mark.parametrize("handling", ["paper", "official"])
def test_a_lone_surrogate_escape_is_a_row_that_is_not_utf8(tmp_path, handling):
    """``"\\ud800"`` is valid JSON but no Unicode text: the tokenizer would read U+FFFD and the
    stage-3 filter's / evaluation's UTF-8 outputs would fail to write it after all the rollouts.
    Such a row is skipped and counted as not_utf8 at load, in either handling."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "bad \\ud800 text", "answer": "1"}\n{"problem": "ok", "answer": "\\udfff"}\n'
                    '{"problem": "fine", "answer": "2"}\n')
    records, report = load_problems(str(path), handling=handling)
    assert [(r["problem"], r["answer"]) for r in records] == [("fine", "2")]
    assert dict(report.skipped) == {"not_utf8": 2} and report.rows["not_utf8"][0].startswith("d.jsonl:1 [")
    for r in records:
        json.dumps(r, ensure_ascii=False).encode("utf-8")  # what the filter and the evaluation write


def test_a_gold_whose_comparison_hangs_the_verifier_is_skipped_at_load(tmp_path, monkeypatch):
    """A gold the verifier parses but cannot compare with anything in time (sympy evaluating
    10^{10^{10}}) would time out every verification, and a timeout scores 0 as the model's wrong
    answer: data.answer_filter=any skips it as unverifiable_answer, saying why."""
    from rstarjax.io import data

    monkeypatch.setattr(data, "VERIFIER_COMPARE_TIMEOUT_S", 1)  # the same verdicts, sooner
    rows = [{"problem": "power", "answer": "10^{10^{10}}"}, {"problem": "tower", "answer": "2^{2^{40}}"},
            {"problem": "half", "answer": "\\frac{1}{2}"}, {"problem": "seven", "answer": "7"}]
    records, report = load_problems(write_jsonl(tmp_path / "d.jsonl", rows), answer_filter="any")
    assert [r["problem"] for r in records] == ["half", "seven"]
    assert dict(report.skipped) == {"unverifiable_answer": 2}
    assert report.rows["unverifiable_answer"] == [
        "d.jsonl:1 [the verifier's comparison with it takes over 1 s]",
        "d.jsonl:2 [the verifier's comparison with it takes over 1 s]"]
    assert data.verifier_can_read("10^{10^{10}}") is False and data.verifier_can_read("\\frac{1}{2}") is True


def test_integer_golds_pass_the_verifier_check_without_sympy(tmp_path, monkeypatch):
    """The paper's data is integers: they are compared exactly by the verifier's fast path, so
    loading them never parses or compares with math-verify (42K rows at load)."""
    from rstarjax.io import data

    def no_sympy(*args, **kwargs):
        raise AssertionError("math-verify called for an integer gold")

    monkeypatch.setattr(data, "_parsed_gold", no_sympy)
    monkeypatch.setattr(data, "_comparison_times_out", no_sympy)
    rows = [{"problem": f"p{i}", "answer": a} for i, a in enumerate(["7", "-3", "1{,}000", "\\boxed{12}", "4.0"])]
    records, report = load_problems(write_jsonl(tmp_path / "d.jsonl", rows), answer_filter="any")
    assert [r["answer"] for r in records] == ["7", "-3", "1000", "12", "4"] and not report.skipped
    assert all(data.why_unverifiable(r["answer"]) is None for r in rows)  # as written (evaluation)


def test_the_gold_check_off_the_main_thread_parses_without_math_verifys_alarm(caplog):
    """math-verify's alarm exists only in the main thread: elsewhere the parse runs without it and
    the timed comparison is left out, said once in a warning, instead of failing every row."""
    import concurrent.futures

    from rstarjax.io import data

    with caplog.at_level("WARNING", logger="rstarjax.io.data"), concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(data.why_unverifiable, "\\frac{1}{2}").result(60) is None
        assert pool.submit(data.why_unverifiable, "\\boxed{}").result(60) == "the verifier cannot parse it"
    assert any("off the main thread" in r.getMessage() for r in caplog.records)
