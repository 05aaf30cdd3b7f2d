"""The official run's data and schedule in --config.profile=rstar2_official (issue #50, item 5),
against the official code itself run on fixed rows: its preprocessing
(tests/fixtures/rstar2_official/dapo_rstar2_agent_loop.py and aime2024_rstar2_agent_loop.py,
microsoft/rStar ecbfb94, run as ``__main__``) and verl's dataset as the official trainer uses it
(rl_dataset.py, J-shang/verl d0dc976: ``RLHFDataset``, then ``maybe_filter_out_long_prompts`` with
the tool schemas, as rstar2_agent/main_rstar2_agent.py calls it, then ``__getitem__``'s
``raw_prompt``). Only HTTP/file plumbing is stood in for (``datasets``' parquet I/O, hdfs, verl's
padding helpers). data.handling='official' must give the rows the official trainer rolls out, in
order; the paper's handling stays the default and unchanged."""
import copy
import importlib.util
import json
import pathlib
import re
import runpy
import sys
import types

import pytest

from rstarjax.io.data import drop_long_prompts, load_problems
from rstarjax.models import chat_template as ct

ROOT = pathlib.Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "rstar2_official"
sys.path.insert(0, str(ROOT / "configs"))

WRAPPER = ("Solve the following math problem step by step. The last line of your response should be of the form "
           "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
           "Remember to put your answer on its own line after \"Answer:\".")
LONG = "Find the sum of the digits of " + " + ".join(str(7 ** k) for k in range(60)) + "."
# rows in open-r1/DAPO-Math-17k-Processed's layout (what data_preprocess/dapo_rstar2_agent_loop.py
# reads): whitespace around a problem and an answer, the DAPO wrapper, a repeat, a repeat with
# another answer, answers that are not canonical integers, one prompt over the length limit
DAPO_ROWS = [
    ("  In triangle $ABC$, $AB = 13$ and $BC = 14$. Find the area.\n", "84"),
    (WRAPPER.format("What is $2 + 3$?"), "5"),
    ("  In triangle $ABC$, $AB = 13$ and $BC = 14$. Find the area.\n", "84"),
    ("What is $2 + 3$?", " 5 "),
    ("How many positive divisors does $2^{10}$ have?", "11"),
    ("Write one thousand in digits.", "1{,}000"),
    (LONG, "7"),
    ("What is $2 + 3$?", "6"),
    ("Compute $\\frac{1}{2} + \\frac{1}{3}$ as $m/n$; give $m + n$.", "The sum is 5/6, so #### 11"),
]


def open_r1_row(i, problem, answer):
    return {"prompt": problem, "solution": answer, "data_source": "math_dapo", "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(i)}}


class _Dataset:
    """What the official code uses of a HuggingFace ``datasets.Dataset``."""

    def __init__(self, rows):
        self.rows = [copy.deepcopy(r) for r in rows]

    def map(self, function, with_indices=False):
        out = []
        for i, row in enumerate(self.rows):
            row = copy.deepcopy(row)  # the function pops columns; the rest stay, its returns win
            row.update(function(row, i) if with_indices else function(row))
            out.append(row)
        return _Dataset(out)

    def filter(self, function, num_proc=None, desc=None):
        return _Dataset([r for r in self.rows if function(copy.deepcopy(r))])

    def to_parquet(self, path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(self.rows), path)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, item):
        return copy.deepcopy(self.rows[item])


def _stand_ins(monkeypatch, hub: dict):
    """``datasets`` (the hub's rows in memory, parquet through pyarrow), ``omegaconf``'s types,
    and the verl helpers the fixtures import that only copy files, pad or count positions."""
    import pyarrow.parquet as pq

    def load_dataset(name, config=None, data_files=None):
        if name == "parquet":
            return {"train": _Dataset(pq.read_table(data_files).to_pylist())}
        return {split: _Dataset(rows) for split, rows in hub[(name, config)].items()}

    def concatenate_datasets(parts):
        return _Dataset([r for p in parts for r in p.rows])

    mods = {
        "datasets": dict(load_dataset=load_dataset, concatenate_datasets=concatenate_datasets, Dataset=_Dataset),
        "omegaconf": dict(DictConfig=type("DictConfig", (dict,), {}), ListConfig=type("ListConfig", (list,), {})),
        "verl": {}, "verl.utils": {},
        "verl.utils.hdfs_io": dict(copy=lambda src, dst: None, makedirs=lambda path: None),
        "verl.utils.fs": dict(copy_to_local=lambda src, cache_dir=None, use_shm=False: src),
        "verl.utils.torch_functional": dict(postprocess_data=lambda input_ids, attention_mask, **kw: (
            input_ids, attention_mask)),
        "verl.utils.model": dict(compute_position_id_with_mask=lambda mask: mask.cumsum(-1) - 1),
    }
    for name, attrs in mods.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys.modules["verl"], "utils", sys.modules["verl.utils"], raising=False)


def run_preprocessing(script: str, out_dir, monkeypatch) -> pathlib.Path:
    """The official preprocessing script, as its README runs it, writing into ``out_dir``."""
    pathlib.Path(out_dir).mkdir(parents=True)  # the script writes into an existing folder
    monkeypatch.setattr(sys, "argv", [script, "--local_dir", str(out_dir)])
    runpy.run_path(str(FIXTURES / script), run_name="__main__")
    return next(pathlib.Path(out_dir).glob("*.parquet"))


class _Tokenizer4:
    """An HF tokenizer whose ``apply_chat_template(tokenize=True)`` returns the ids, as the
    transformers 4.x the official code ran on did (5.x returns a BatchEncoding, whose len is 2)."""

    def __init__(self, hf):
        self.hf = hf

    def apply_chat_template(self, *args, **kwargs):
        if kwargs.get("tokenize", True):
            kwargs.setdefault("return_dict", False)
        return self.hf.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.hf, name)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(our small tokenizer, the same as an HF tokenizer with the official template, the tool schemas)."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from rstarjax.models.tokenizer import load_tokenizer

    small = load_tokenizer(3000)
    trainer = yaml.safe_load((FIXTURES / "rstar2_agent_trainer.yaml").read_text())
    template = trainer["actor_rollout_ref"]["model"]["custom_chat_template"]
    tools = [t["tool_schema"] for t in yaml.safe_load((FIXTURES / "python_tool_config.yaml").read_text())["tools"]]
    path = small.save_pretrained(tmp_path_factory.mktemp("official"), chat_template=template)
    return small, _Tokenizer4(AutoTokenizer.from_pretrained(str(path), local_files_only=True)), tools


def official_rows(parquet, tokenizer, tools, max_prompt_len, monkeypatch) -> list[tuple[str, str]]:
    """(user message, ground truth) of each row the official trainer rolls out, in dataset order:
    verl's RLHFDataset with the run script's data settings, filtered with the tools as
    main_rstar2_agent.py does, each row's ``raw_prompt`` (the messages the agent loop renders) and
    ``reward_model.ground_truth`` (what compute_score gets)."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("official_rl_dataset", FIXTURES / "rl_dataset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = {"max_prompt_length": max_prompt_len, "filter_overlong_prompts": True, "truncation": "error",
              "return_raw_chat": True, "filter_overlong_prompts_workers": 1}
    dataset = module.RLHFDataset(data_files=[str(parquet)], tokenizer=tokenizer, config=config)
    dataset.dataframe = dataset.maybe_filter_out_long_prompts(dataset.dataframe, tools=tools)
    out = []
    for i in range(len(dataset)):
        row = dataset[i]
        assert len(row["raw_prompt"]) == 1 and row["raw_prompt"][0]["role"] == "user"
        out.append((row["raw_prompt"][0]["content"], row["reward_model"]["ground_truth"]))
    return out


def ours(path, small, max_prompt_len, handling="official") -> list[tuple[str, str]]:
    """What our loader gives a run (recipes.build.problems: load, then drop the prompts longer than
    ``max_prompt_len`` tokens as the rollouts encode them with the official template)."""
    records, report = load_problems(str(path), handling=handling)
    fmt = ct.RSTAR2_OFFICIAL
    records = drop_long_prompts(records, report, lambda q: len(ct.encode_prompt(small, q, fmt)), max_prompt_len,
                                "--config.rl.max_prompt_len")
    return [(r["problem"], r["answer"]) for r in records]


def test_official_handling_gives_the_rows_the_official_trainer_rolls_out(tokenizers, tmp_path, monkeypatch):
    small, hf, tools = tokenizers
    hub = {("open-r1/DAPO-Math-17k-Processed", "en"): {"train": [open_r1_row(i, *r) for i, r in enumerate(DAPO_ROWS)]}}
    _stand_ins(monkeypatch, hub)
    parquet = run_preprocessing("dapo_rstar2_agent_loop.py", tmp_path / "dapo", monkeypatch)
    # the limit: the longest prompt but LONG's, exactly (kept: verl keeps <= max_prompt_length)
    lengths = {q: len(ct.encode_prompt(small, q, ct.RSTAR2_OFFICIAL)) for q, _ in DAPO_ROWS}
    limit = max(n for q, n in lengths.items() if q != LONG)
    assert lengths[LONG] > limit
    theirs = official_rows(parquet, hf, tools, limit, monkeypatch)
    assert len(theirs) == len(DAPO_ROWS) - 1 and LONG not in [q for q, _ in theirs]
    assert theirs[0] == theirs[2] and theirs[1][0].startswith("Solve the following")  # kept as written
    # ours, from the official parquet and from the rows it was made of
    assert ours(parquet, small, limit) == theirs
    raw = tmp_path / "open_r1.jsonl"
    raw.write_text("".join(json.dumps(row) + "\n" for row in hub[next(iter(hub))]["train"]))
    assert ours(raw, small, limit) == theirs
    # the HF layout (problem / answer columns), as the official AIME 2024 preprocessing reads it
    aime = [{"id": i, "problem": q, "answer": a, "solution": "", "url": ""} for i, (q, a) in enumerate(DAPO_ROWS)]
    hub[("HuggingFaceH4/aime_2024", "default")] = {"train": aime}
    aime_parquet = run_preprocessing("aime2024_rstar2_agent_loop.py", tmp_path / "aime", monkeypatch)
    theirs = official_rows(aime_parquet, hf, tools, limit, monkeypatch)
    assert ours(aime_parquet, small, limit) == theirs
    (tmp_path / "aime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in aime))
    assert ours(tmp_path / "aime.jsonl", small, limit) == theirs


def test_the_paper_handling_stays_the_default(tmp_path):
    """The same rows without the profile: wrapper and whitespace stripped, answers canonical
    integers (rStar2-Agent §4.2), a repeated problem dropped, as before issue #50."""
    path = tmp_path / "open_r1.jsonl"
    chat = [{"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": a}} for q, a in DAPO_ROWS]
    path.write_text("".join(json.dumps(r) + "\n" for r in chat))
    records, report = load_problems(str(path))
    assert [(r["problem"], r["answer"]) for r in records] == [
        ("In triangle $ABC$, $AB = 13$ and $BC = 14$. Find the area.", "84"),
        ("What is $2 + 3$?", "5"),
        ("How many positive divisors does $2^{10}$ have?", "11"),
        ("Write one thousand in digits.", "1000"),
        (LONG, "7"),
        ("Compute $\\frac{1}{2} + \\frac{1}{3}$ as $m/n$; give $m + n$.", "11"),
    ]
    assert report.skipped == {"duplicate": 2, "duplicate_other_answer": 1}
    assert load_problems(str(path), handling="paper")[0] == records
    # open-r1's own rows (the problem as plain text in prompt, the answer in reward_model.ground_truth
    # and solution): read the same way (before, every row lacked an answer column)
    raw = tmp_path / "raw.jsonl"
    rows = [open_r1_row(i, q, a) for i, (q, a) in enumerate(DAPO_ROWS) if not q.startswith("Solve")]
    for row in rows:
        del row["solution"]
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["problem"], r["answer"]) for r in load_problems(str(raw))[0]] == [
        (r["problem"], r["answer"]) for r in records]


def test_official_handling_counts_what_it_cannot_read(tmp_path):
    """Rows the official template could not render as one user message, or without a problem or an
    answer, are skipped and counted (the official code would stop); the rest stay as written."""
    rows = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
             "reward_model": {"ground_truth": "1"}},
            {"prompt": [{"role": "user", "content": " q "}], "reward_model": {"ground_truth": 2}},
            {"problem": "p"}, "not json"]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    records, report = load_problems(str(path), handling="official")
    assert [(r["problem"], r["answer"], r["uid"]) for r in records] == [(" q ", "2", "rows.jsonl:2")]
    assert report.skipped == {"not_one_user_message": 1, "missing_answer": 1, "bad_json": 1}
    with pytest.raises(ValueError, match="handling"):
        load_problems(str(path), handling="verbatim")


def _script_number(key: str) -> int:
    text = (FIXTURES / "run_qwen3-14b_rstar2_agent_weave.sh").read_text()
    return int(re.search(rf"\b{re.escape(key)}=(\d+)", text).group(1))


@pytest.mark.parametrize("stage, paper_steps", [("stage1", 300), ("stage2", 385), ("stage3", 510)])
def test_the_profile_runs_the_official_schedule(stage, paper_steps, tmp_path):
    """examples/run_qwen3-14b_rstar2_agent_weave.sh is one stage: trainer.total_training_steps and
    trainer.total_epochs are the profile's total_steps and data.num_epochs whatever stage config
    it is given (the command line's total_steps still wins); without the profile each stage keeps
    the paper's steps and the paper's data handling."""
    from rstarjax.recipes.config import parse

    c = __import__(stage).get_config()
    c.model.random_init, c.model.preset = True, "tiny"
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    c.data.train_path = str(data)
    if stage == "stage3":
        c.checkpoint.init_from = str(tmp_path)
    paper = parse(c)
    assert (paper.total_steps, paper.data.handling, paper.data.num_epochs) == (paper_steps, "paper", 0)
    c.profile = "rstar2_official"
    run = parse(c)
    assert run.total_steps == _script_number("trainer.total_training_steps") == 200
    assert run.data.num_epochs == _script_number("trainer.total_epochs") == 15
    assert run.rl.max_response_len == _script_number("data.max_response_length")
    assert run.rl.max_prompt_len == _script_number("data.max_prompt_length")
    assert run.data.handling == "official"
    c.total_steps = 250
    assert parse(c, explicit={"total_steps"}).total_steps == 250


def test_the_profile_evaluates_the_benchmark_rows_as_written(tmp_path):
    """configs/eval.py with the profile reads the benchmark files as the official evaluation does
    (examples/aime_eval.sh on data_preprocess/aime2024_rstar2_agent_loop.py's output: the problem as
    written); without it, stripped as before."""
    import eval as eval_preset

    from rstarjax.recipes.config import parse
    from rstarjax.recipes.evaluate import load_benchmarks

    path = tmp_path / "aime24.jsonl"
    path.write_text(json.dumps({"id": 0, "problem": "Find $x$.\n", "answer": " 7", "solution": "-"}) + "\n")
    e = eval_preset.get_config()
    e.model.random_init, e.model.preset = True, "tiny"
    e.eval.paths = str(path)
    assert parse(e).data.handling == "paper"
    e.profile = "rstar2_official"
    handling = parse(e).data.handling
    assert handling == "official"
    [(name, records)] = load_benchmarks([str(path)], handling=handling).items()
    assert (name, records[0]["problem"], records[0]["answer"]) == ("aime24", "Find $x$.\n", " 7")
    assert load_benchmarks([str(path)])["aime24"][0]["problem"] == "Find $x$."


class _DataConfig(dict):
    """What create_rl_sampler reads of verl's data config (legacy_data.yaml: no seed, no sampler class)."""

    sampler = None
    shuffle = True


def test_official_handling_reads_the_rows_in_the_official_loaders_order():
    """verl's create_rl_sampler (tests/fixtures/rstar2_official/create_rl_sampler.py, verbatim) under
    a torch DataLoader with the official loader's batch size and drop_last=True (StatefulDataLoader
    iterates a given sampler the same way), over 3 epochs, against io.data.OfficialOrder without
    torch: the same rows in the same batches, each epoch's remainder left out; a process's batch is
    its strided share of the global one; a resumed iterator goes on where it stopped."""
    torch = pytest.importorskip("torch")
    from fixtures.rstar2_official.create_rl_sampler import create_rl_sampler

    from rstarjax.io.data import make_dataset

    n, batch, epochs = 53, 8, 3  # 6 batches an epoch, 5 rows left out of each
    sampler = create_rl_sampler(_DataConfig(), list(range(n)))
    loader = torch.utils.data.DataLoader(list(range(n)), batch_size=batch, sampler=sampler, drop_last=True,
                                         collate_fn=list)
    theirs = [b for _ in range(epochs) for b in loader]
    assert len(theirs) == epochs * (n // batch) and theirs[0] != theirs[n // batch]
    records = [{"problem": str(i), "answer": "0"} for i in range(n)]

    def ids(batches):
        return [[int(r["problem"]) for r in b] for b in batches]

    ours = make_dataset(records, batch, num_epochs=epochs, process_index=0, process_count=1, handling="official")
    assert ids(ours) == theirs
    for p in range(2):
        share = make_dataset(records, batch // 2, num_epochs=epochs, process_index=p, process_count=2,
                             handling="official")
        assert ids(share) == [b[p::2] for b in theirs]
    it = iter(ours)
    first = ids([next(it) for _ in range(7)])
    resumed = iter(make_dataset(records, batch, num_epochs=epochs, process_index=0, process_count=1,
                                handling="official"))
    resumed.set_state(it.get_state())
    assert first + ids(resumed) == theirs
    # data.shuffle=False: verl's SequentialSampler, the file order
    _DataConfig.shuffle = False
    try:
        sequential = list(torch.utils.data.DataLoader(list(range(n)), batch_size=batch, drop_last=True,
                                                      sampler=create_rl_sampler(_DataConfig(), list(range(n))),
                                                      collate_fn=list))
    finally:
        _DataConfig.shuffle = True
    assert ids(make_dataset(records, batch, num_epochs=1, shuffle=False, process_index=0, process_count=1,
                            handling="official")) == sequential
