"""SFT: loss vs HF transformers (PyTorch fp32, labels=-100 outside assistant turns), the
schedule vs transformers' get_cosine_schedule_with_warmup, packing, bad input, learning."""
import dataclasses
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstarjax.models import ModelConfig, Qwen3, load_tokenizer, save_hf
from rstarjax.models import chat_template as ct
from rstarjax.protocol import TOOL_NAME
from rstarjax.recipes import sft
from rstarjax.recipes.config import SFTConfig
from rstarjax.rl.optim import cosine_with_warmup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NUM_REGULAR = 1000


def _conversation(i):
    code = f"print({1234 + i} * {56 + i})"
    return [
        {"role": "user", "content": f"Compute {1234 + i} * {56 + i}."},
        {"role": "assistant", "content": "<reason>Use Python.</reason>",
         "tool_calls": [{"type": "function", "function": {"name": TOOL_NAME,
                                                          "arguments": {"code": code, "input": ""}}}]},
        {"role": "tool", "content": str((1234 + i) * (56 + i))},
        {"role": "assistant", "content": f"<answer>\\boxed{{{(1234 + i) * (56 + i)}}}</answer>"},
    ]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(NUM_REGULAR)


def _one_device_mesh():
    import jax
    from rstarjax.models.sharding import make_mesh
    return make_mesh(1, 1, 1, devices=jax.devices()[:1])


def _tiny_model(tok, seed=0):
    cfg = ModelConfig.preset("tiny", vocab_size=tok.vocab_size, dtype=jnp.float32,
                             bos_token_id=tok.endoftext_id, eos_token_id=tok.eos_id)
    return Qwen3(cfg, rngs=nnx.Rngs(seed))


def test_schedule_matches_transformers():
    total, peak = 50, 5e-6
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=int(0.04 * total),
                                                         num_training_steps=total)
    for step in range(total):
        ours = float(cosine_with_warmup(step, total, peak, 0.04))
        assert ours == pytest.approx(opt.param_groups[0]["lr"], rel=1e-5, abs=1e-12), step
        opt.step()
        sched.step()


def test_masked_packed_loss_matches_hf(tok, tmp_path):
    convs = [_conversation(i) for i in range(5)]
    model = _tiny_model(tok)
    save_hf(model, str(tmp_path), tokenizer=tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    examples, _ = sft.encode_examples(tok, convs, seq_len=512, fmt=ct.COMPACT)
    nll, count = 0.0, 0
    for ex in examples:
        ids = torch.tensor(ex.ids[None].astype(np.int64))
        labels = torch.where(torch.tensor(ex.mask[None]), ids, torch.full_like(ids, -100))
        with torch.no_grad():
            out = hf(input_ids=ids, labels=labels)
        n = int(ex.mask[1:].sum())  # HF shifts: the label at t is predicted from t-1
        nll += float(out.loss) * n
        count += n
    reference = nll / count

    cfg = SFTConfig(epochs=1, batch_size=5, learning_rate=1e-3, warmup_ratio=0.0, seq_len=512)
    plan = sft.plan_batches([len(e.ids) for e in examples], 5, 1, 512, seed=0)
    assert len(plan) == 1 and sum(len(r) for r in plan[0]) == 5
    assert any(len(r) > 1 for r in plan[0]), "the test must exercise packing"
    # 8 rows on the 8-device mesh of conftest: the loss is sharded over devices
    trainer = sft.SFTTrainer(model, cfg, total_steps=1, num_rows=8)
    arrays = sft.pack_rows(examples, plan[0], 8, 512, tok.pad_id)
    metrics = trainer.train_step(arrays)
    assert metrics["sft/loss"] == pytest.approx(reference, rel=1e-4)
    assert metrics["sft/tokens"] == count


def test_assistant_mask_covers_only_model_text(tok):
    ex, _ = sft.encode_examples(tok, [_conversation(3)], seq_len=512, fmt=ct.COMPACT)
    text = tok.decode(ex[0].ids[ex[0].mask])
    assert "<tool_call>" in text and "\\boxed{" in text and text.count("<|im_end|>") == 2
    assert "Compute" not in text  # the question
    assert "<tool_response>" not in text and "assistant" not in text  # tool turn, role headers


def test_pack_rows_layout(tok):
    ex = [sft.SFTExample(np.array([5, 6, 7], np.int32), np.array([0, 1, 1], bool)),
          sft.SFTExample(np.array([8, 9], np.int32), np.array([0, 1], bool))]
    a = sft.pack_rows(ex, [[0, 1]], num_rows=2, seq_len=6, pad_id=0)
    np.testing.assert_array_equal(a["tokens"], [[5, 6, 7, 8, 9, 0], [0] * 6])
    np.testing.assert_array_equal(a["positions"][0], [0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(a["segment_ids"][0], [1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(a["loss_mask"][0], [0, 1, 1, 0, 1, 0])
    with pytest.raises(ValueError):
        sft.pack_rows(ex, [[0, 1]], num_rows=1, seq_len=4, pad_id=0)
    with pytest.raises(ValueError):
        sft.pack_rows(ex, [[0], [1]], num_rows=1, seq_len=6, pad_id=0)


def test_plan_covers_every_example_each_epoch():
    lengths = [5, 9, 3, 7, 2, 8, 4]
    plan = sft.plan_batches(lengths, batch_size=3, epochs=2, seq_len=10, seed=1)
    assert len(plan) == 2 * 3  # ceil(7 / 3) steps per epoch
    for epoch in range(2):
        seen = sorted(i for step in plan[3 * epoch:3 * epoch + 3] for row in step for i in row)
        assert seen == list(range(7))
    for step in plan:
        for row in step:
            assert sum(lengths[i] for i in row) <= 10


def test_bad_input(tok, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(ValueError, match="no 'messages'"):
        sft.load_conversations(str(p))
    with pytest.raises(FileNotFoundError):
        sft.load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="conversation 2: the conversation has no assistant message"):
        sft.encode_examples(tok, [_conversation(0)] * 2 + [[{"role": "user", "content": "x"}]],
                            seq_len=400, fmt=ct.COMPACT)
    with pytest.raises(ValueError, match="no usable"):
        sft.encode_examples(tok, [_conversation(0)], seq_len=10, fmt=ct.COMPACT)
    with pytest.raises(ValueError, match="conversation 0"):
        sft.encode_examples(tok, [[{"role": "assistant", "content": "x"}]], seq_len=100)


@pytest.mark.parametrize("row, says", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "x"}]},
     "content must be a str"),
    ({"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "x"}]}, "role must be"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nx"}]}, "line break"),
    ({"messages": "[not json"}, "not JSON"),
    ({"messages": []}, "no 'messages' list"),
    # a conversation without an assistant turn was dropped with a warning that named no row
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}, "no assistant message"),
    # null / missing system content became an empty system prompt; 0 / [] assistant content an empty text
    ({"messages": [{"role": "system", "content": None}] + _conversation(1)}, r"message 0 \(system\): content must"),
    ({"messages": [{"role": "system"}] + _conversation(1)}, r"message 0 \(system\): content must"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 0, "tool_calls": _conversation(1)[1]["tool_calls"]}]},
     r"message 1 \(assistant\): assistant content must be a str"),
    # calls the format's parser never runs
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                   "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]},
     "tool call 'get_weather': this chat format's tool is"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                   "tool_calls": [{"function": {"name": TOOL_NAME, "arguments": "[1, 2]"}}]}]},
     "arguments must be a JSON object"),
    # a row's own tools are not rendered: its prompt would list the format's tool, not these
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
      "messages": _conversation(1)}, r"the row's own 'tools' \['get_weather'\] are not the chat format's")])
def test_a_bad_conversation_is_one_line_naming_its_row_before_the_model_is_read(tok, tmp_path, monkeypatch,
                                                                              row, says):
    """A conversation the template cannot render stops ``run_sft`` with a DataError (one line,
    exit 2, from ``rstarjax.main``) naming FILE:ROW, before the model is built."""
    from rstarjax.io.data import DataError
    from rstarjax.recipes import build
    p = tmp_path / "sft.jsonl"
    p.write_text(json.dumps({"messages": _conversation(0)}) + "\n\n" + json.dumps(row) + "\n")
    run = types.SimpleNamespace(sft=SFTConfig(data_path=str(p), chat_format="compact"), mesh=None, model=None,
                                checkpoint=None, seed=0)
    monkeypatch.setattr(build, "mesh", lambda cfg: None)
    monkeypatch.setattr(build, "tokenizer", lambda cfg: tok)
    monkeypatch.setattr(build, "policy", lambda *a, **k: pytest.fail("the model was read before the data was checked"))
    with pytest.raises(DataError, match=f"{p}:3: .*{says}"):
        sft.run_sft(run, str(tmp_path / "w"))


def test_a_row_with_tools_other_than_the_formats_is_refused_naming_it(tmp_path):
    """A row's own ``tools`` were ignored: the prompt listed the format's python tool while the
    row's get_weather calls were trained. Rows listing the format's own tool (or none: null, [],
    a JSON string of them, as parquet exports write) are read."""
    from rstarjax.io.data import DataError
    from rstarjax.protocol import OFFICIAL_TOOL_SCHEMA, TOOL_SCHEMA

    weather = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    other_description = {"type": "function", "function": dict(TOOL_SCHEMA["function"], description="runs code")}
    p = tmp_path / "sft.jsonl"
    for tools in (None, [], [TOOL_SCHEMA], [TOOL_SCHEMA["function"]], json.dumps([TOOL_SCHEMA]), "[]"):
        p.write_text(json.dumps({"tools": tools, "messages": _conversation(0)}) + "\n")
        assert sft.conversation_rows(str(p), ct.COMPACT)[1] == [f"{p}:1"], tools
    cases = [([weather], ct.RSTAR2, r"\['get_weather'\] are not the chat format's \['execute_python"),
             ([TOOL_SCHEMA, weather], ct.RSTAR2, "get_weather"),
             ([other_description], ct.RSTAR2, "(with other schemas)"),
             ([TOOL_SCHEMA], ct.RSTAR2_OFFICIAL, r"are not the chat format's \['python_code_with_standard_io'\]"),
             ("{not json", ct.RSTAR2, "'tools' is a string that is not JSON"),
             ({"name": "x"}, ct.RSTAR2, "'tools' must be a list")]
    for tools, fmt, says in cases:
        p.write_text(json.dumps({"messages": _conversation(0)}) + "\n" + json.dumps({"tools": tools, "messages": _conversation(1)}) + "\n")
        with pytest.raises(DataError, match=f"{p}:2: .*" + says):
            sft.conversation_rows(str(p), fmt)
    p.write_text(json.dumps({"tools": [OFFICIAL_TOOL_SCHEMA], "messages": _conversation(0)}) + "\n")
    assert len(sft.conversation_rows(str(p), ct.RSTAR2_OFFICIAL)[0]) == 1


def test_lines_that_are_not_json_are_named_with_the_parsers_message(tmp_path):
    """The first few bad lines, FILE:LINE each with why; before, only a count."""
    from rstarjax.io.data import DataError

    good = json.dumps({"messages": _conversation(0)})
    lines = [good] * 3 + ['{"messages": [{"role": "user"'] * 7 + [good]
    p = tmp_path / "sft.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        sft.conversation_rows(str(p))
    message = str(e.value)
    assert message.startswith(f"{p}: 7 line(s) are not valid JSON or not UTF-8: {p}:4 (bad_json: Expecting")
    assert all(f"{p}:{n} (bad_json" in message for n in range(4, 9)) and f"{p}:9 " not in message
    assert message.endswith("and 2 more") and "\n" not in message


def test_dropped_too_long_conversations_are_named(tok, caplog):
    """Conversations longer than seq_len are dropped by design; the warning and the stats (the
    run's summary) name the first few rows, not only a count."""
    import logging

    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    convs = [_conversation(i) for i in range(7)] + [short]
    where = [f"f.jsonl:{n}" for n in range(1, 9)]
    limit = len(sft.encode_examples(tok, [short], 10**6, ct.COMPACT)[0][0].ids)
    with caplog.at_level(logging.WARNING, logger="rstarjax.recipes.sft"):
        examples, stats = sft.encode_examples(tok, convs, limit, ct.COMPACT, where)
    assert len(examples) == 1 and stats["too_long"] == 7
    assert stats["too_long_rows"] == where[:5]
    assert ("dropped 7 of 8 conversations longer than --config.sft.seq_len="
            f"{limit} tokens: f.jsonl:1, f.jsonl:2, f.jsonl:3, f.jsonl:4, f.jsonl:5 and 2 more") in caplog.text


def test_turns_with_several_tool_calls_are_warned_in_the_paper_layout(tok, caplog):
    """The paper layout's engine stops at the first </tool_call>, so the rest of a two-call turn
    is trained but never sampled: counted and named in a warning (not refused). The official
    layout runs such turns as the official loop does: no warning there."""
    import logging

    def two_calls(i, name):
        msgs = _conversation(i)
        msgs[1] = dict(msgs[1], tool_calls=[{"function": {"name": name, "arguments": {"code": "print(1)", "input": ""}}}] * 2)
        return msgs[:2] + [msgs[2], msgs[2]] + msgs[3:]

    convs = [_conversation(0), two_calls(1, TOOL_NAME), two_calls(2, TOOL_NAME)]
    with caplog.at_level(logging.WARNING, logger="rstarjax.recipes.sft"):
        examples, stats = sft.encode_examples(tok, convs, 4096, ct.COMPACT, ["f:1", "f:2", "f:3"])
    assert len(examples) == 3 and stats["multi_call_turns"] == 2 and stats["multi_call_rows"] == ["f:2", "f:3"]
    assert "2 assistant turns hold several tool calls (f:2, f:3)" in caplog.text
    caplog.clear()
    official = [two_calls(1, "python_code_with_standard_io")]
    with caplog.at_level(logging.WARNING, logger="rstarjax.recipes.sft"):
        _, stats = sft.encode_examples(tok, official, 4096, ct.RSTAR2_OFFICIAL, ["f:1"])
    assert stats["multi_call_turns"] == 0 and "several tool calls" not in caplog.text


def test_the_sft_identity_tells_another_plan():
    """``sft_identity``: the encoded data, batch size, seed, seq_len and chat format; another
    epochs / max_steps is the same plan (extended or cut). ``check_same_plan`` names each field
    that differs in one line; a checkpoint without the record (older) resumes as before."""
    from rstarjax.validation import StageError

    examples = [sft.SFTExample(np.array([1, 2, 3], np.int32), np.array([0, 1, 1], bool))] * 3
    cfg = SFTConfig(batch_size=2, seq_len=512, epochs=1)
    now = sft.sft_identity(examples, cfg, ct.COMPACT)
    assert now["chat_format"] == "compact" and now["num_examples"] == 3
    longer = sft.sft_identity(examples, SFTConfig(batch_size=2, seq_len=512, epochs=5, max_steps=7), ct.COMPACT)
    assert longer == now
    sft.check_same_plan({"sft_identity": now}, longer, "/w/checkpoints", 3)
    sft.check_same_plan({"stage": "sft"}, now, "/w/checkpoints", 3)  # (older checkpoints)
    other_mask = [sft.SFTExample(np.array([1, 2, 3], np.int32), np.array([0, 0, 1], bool))] * 3
    assert sft.examples_digest(other_mask) != now["examples_digest"]
    then = sft.sft_identity(examples[:2], SFTConfig(batch_size=4, seq_len=256, seed=7), ct.RSTAR2)
    with pytest.raises(StageError) as e:
        sft.check_same_plan({"sft_identity": then}, now, "/w/checkpoints", 3)
    message = str(e.value)
    assert "\n" not in message and message.startswith("/w/checkpoints holds checkpoints (step 3) of an SFT run on another plan")
    for says in ("the data as encoded (2 conversations", "now 3", "--config.sft.batch_size=2 (it was 4)",
                 "--config.sft.seed=0 (it was 7)", "--config.sft.seq_len=512 (it was 256)",
                 "--config.sft.chat_format=compact (it was rstar2)", "new --workdir"):
        assert says in message, says


def test_an_sft_resume_on_other_data_or_settings_is_refused(tok, tmp_path, capsys, monkeypatch):
    """Every SFT checkpoint records the run's ``sft_identity``; resuming with other data or
    another batch size / seed is refused naming what differs (rstarjax.main: exit 2), while
    more steps resume, the schedule recomputed over the new total and said. Before, a resume on
    other data resumed silently at the same step of another plan."""
    from rstarjax import main
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.validation import StageError

    convs = [_conversation(i) for i in range(8)]
    ckpt_cfg = ckpt_lib.CheckpointConfig(every_steps=1, async_save=False)
    cfg = SFTConfig(epochs=1, batch_size=4, learning_rate=1e-3, warmup_ratio=0.0, seq_len=512, max_steps=1)

    def train(conversations, cfg):
        return sft.train_sft(_tiny_model(tok), tok, conversations, cfg, fmt=ct.COMPACT, workdir=str(tmp_path),
                             mesh=_one_device_mesh(), checkpoint_cfg=ckpt_cfg)

    train(convs, cfg)
    _, meta = ckpt_lib.read_checkpoint_meta(str(tmp_path / "checkpoints"))
    assert meta["sft_identity"] == sft.sft_identity(sft.encode_examples(tok, convs, 512, ct.COMPACT)[0], cfg,
                                                    ct.COMPACT)
    for conversations, changed, says in (
            ([_conversation(i) for i in range(8, 14)], {}, "the data as encoded (8 conversations"),
            (convs, {"batch_size": 2, "seed": 7}, "--config.sft.batch_size=2 (it was 4); --config.sft.seed=7 (it was 0)")):
        with pytest.raises(StageError, match=re.escape(says)):
            train(conversations, dataclasses.replace(cfg, **changed))
    capsys.readouterr()
    _, summary = train(convs, dataclasses.replace(cfg, epochs=2, max_steps=0))  # train longer: resumes
    assert summary["steps"] == 4
    out = capsys.readouterr().out
    assert "rstarjax: sft resumed from step 1 (" in out
    assert "the checkpoint's run was to reach step 1: the learning-rate schedule (warmup + cosine) is recomputed over 4 steps" in out
    monkeypatch.setattr(main, "run", lambda *a, **k: (_ for _ in ()).throw(StageError("another plan")))
    assert main.run_to_exit_status(None, str(tmp_path)) == 2


@pytest.mark.slow
def test_sft_learns_and_checkpoints(tok, tmp_path, capsys):
    """A few steps on 16 conversations cut the loss; the checkpoint restores the same params; each
    run says on start whether it is fresh or resumed, and from which checkpoint."""
    from rstarjax.io import checkpoint as ckpt_lib

    convs = [_conversation(i) for i in range(16)]
    cfg = SFTConfig(epochs=10, batch_size=16, learning_rate=1e-2, warmup_ratio=0.0, seq_len=512)
    trainer, summary = sft.train_sft(_tiny_model(tok), tok, convs, cfg, fmt=ct.COMPACT, workdir=str(tmp_path),
                                     mesh=_one_device_mesh(),
                                     checkpoint_cfg=ckpt_lib.CheckpointConfig(every_steps=3, async_save=False),
                                     meta={"note": "test"})
    assert summary["steps"] == 10
    assert summary["final_loss"] < 0.65 * summary["first_loss"]
    assert "rstarjax: sft fresh at step 0; training to step 10 on 16 conversations" in capsys.readouterr().out
    # resuming in a finished workdir runs no step and leaves the params as they were
    again, summary2 = sft.train_sft(_tiny_model(tok, seed=1), tok, convs, cfg, fmt=ct.COMPACT, workdir=str(tmp_path),
                                    mesh=_one_device_mesh(),
                                    checkpoint_cfg=ckpt_lib.CheckpointConfig(every_steps=3, async_save=False))
    assert f"rstarjax: sft resumed from step 10 ({tmp_path / 'checkpoints' / '10'})" in capsys.readouterr().out
    a = nnx.state(trainer.model(), nnx.Param)
    b = nnx.state(again.model(), nnx.Param)
    for x, y in zip(np.asarray(a["embed"][...]), np.asarray(b["embed"][...])):
        np.testing.assert_array_equal(x, y)


def test_a_resumed_sft_run_does_not_read_the_hf_weights(tmp_path, monkeypatch):
    """``run_sft`` in a workdir with a checkpoint builds the policy without reading the HF
    weights (the restore replaces every parameter); a fresh workdir reads them."""
    import sys

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import build
    from rstarjax.recipes.config import parse

    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import sft as sft_config

    asked = []

    class Stop(Exception):
        pass

    def policy(src, mesh, seed, read_weights=True, **kw):
        asked.append(read_weights)
        raise Stop

    monkeypatch.setattr(build, "policy", policy)
    monkeypatch.setattr(build, "tokenizer", lambda src: None)
    monkeypatch.setattr(build, "vocabulary_of", lambda tok: {})
    monkeypatch.setattr(sft, "conversation_rows", lambda path, fmt=None: ([], []))
    monkeypatch.setattr(sft, "encode_examples", lambda *a: ([], {}))
    c = sft_config.get_config()
    hf, data = tmp_path / "hf", tmp_path / "sft.jsonl"  # checked at start from headers; weights never read here
    tok = load_tokenizer(300)
    save_hf(Qwen3(ModelConfig.preset("tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), str(hf), tokenizer=tok)
    data.write_text('{"messages": []}\n')
    c.model.hf_path, c.sft.data_path = str(hf), str(data)
    run = parse(c, num_devices=jax.device_count())
    for workdir, saved in ((tmp_path / "fresh", False), (tmp_path / "resumed", True)):
        if saved:
            ckpt = ckpt_lib.Checkpointer(str(workdir / "checkpoints"),
                                         ckpt_lib.CheckpointConfig(async_save=False))
            ckpt.save(3, {"w": jax.numpy.zeros(2)}, {"stage": "sft"})
            ckpt.close()
        with pytest.raises(Stop):
            sft.run_sft(run, str(workdir))
    assert asked == [True, False]
    # LoRA: the checkpoints hold adapters, the frozen base is read from HF on a resume too
    c.model.lora_rank = 4
    with pytest.raises(Stop):
        sft.run_sft(parse(c, num_devices=jax.device_count()), str(tmp_path / "resumed"))
    assert asked == [True, False, True]


def test_a_lora_sft_resume_refuses_another_base_or_full_parameters(tok, tmp_path):
    """train_sft resuming a LoRA checkpoint: the base record's hash must be the one built now,
    and a full-parameter run must not resume adapters (or the other way round)."""
    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes.lora_base import BaseMismatch

    record = {"source": "model", "path": "/models/base", "hash": "aaaa"}
    workdir = tmp_path / "run"
    with ckpt_lib.Checkpointer(str(workdir / "checkpoints"), ckpt_lib.CheckpointConfig(async_save=False)) as c:
        c.save(1, {"w": jax.numpy.zeros(2)}, {"stage": "sft", "lora_base": record})
    cfg = SFTConfig(batch_size=2, seq_len=512, max_steps=2)
    convs = [_conversation(i) for i in range(4)]
    cases = [({"lora_base": dict(record, hash="bbbb")}, "hashes to bbbb"),
             ({}, "holds LoRA adapters but this run trains full parameters")]
    for meta, message in cases:
        with pytest.raises(BaseMismatch, match=message):
            sft.train_sft(_tiny_model(tok), tok, convs, cfg, fmt=ct.COMPACT, mesh=_one_device_mesh(), workdir=str(workdir),
                          checkpoint_cfg=ckpt_lib.CheckpointConfig(async_save=False), meta=meta)


def test_sigterm_saves_the_step_that_finished_and_stops(tok, tmp_path):
    """A SIGTERM during step 2 (sent from the metrics writer, in the process's main thread):
    step 2 finishes, is saved although no periodic save was due, and the run stops with
    ``Interrupted`` (rstarjax.main: exit 143); a rerun resumes from step 2."""
    import signal

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.recipes import preemption

    class SignalAtStep2:
        def write(self, step, metrics):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

        def flush(self):  # (at each save)
            pass

    convs = [_conversation(i) for i in range(8)]
    cfg = SFTConfig(epochs=6, batch_size=4, learning_rate=1e-3, warmup_ratio=0.0, seq_len=512)
    ckpt_cfg = ckpt_lib.CheckpointConfig(every_steps=100, async_save=False, preemption_grace_s=60.0)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(preemption.Interrupted) as e:
        sft.train_sft(_tiny_model(tok), tok, convs, cfg, fmt=ct.COMPACT, workdir=str(tmp_path),
                      mesh=_one_device_mesh(), checkpoint_cfg=ckpt_cfg, metrics_writer=SignalAtStep2())
    assert (e.value.exit_status, e.value.last_step, e.value.saved) == (143, 2, True)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the stage's alone
    assert sft.resume_step(str(tmp_path), ckpt_cfg) == 2


def test_a_metrics_log_on_a_full_disk_saves_the_step_it_could_not_log(tok, tmp_path):
    """The metrics log refuses step 2's record (a full disk): the run stops with that error, one
    line, and step 2, trained, is saved for the same command to resume from."""
    import errno

    from rstarjax.io import checkpoint as ckpt_lib
    from rstarjax.io.metrics_log import MetricsWriteError

    class FullAtStep2:
        def write(self, step, metrics):
            if step == 2:
                raise MetricsWriteError(f"the metrics log x could not be written: {os.strerror(errno.ENOSPC)}")

    convs = [_conversation(i) for i in range(8)]
    cfg = SFTConfig(epochs=6, batch_size=4, learning_rate=1e-3, warmup_ratio=0.0, seq_len=512)
    ckpt_cfg = ckpt_lib.CheckpointConfig(every_steps=100, async_save=False)
    with pytest.raises(MetricsWriteError) as e:
        sft.train_sft(_tiny_model(tok), tok, convs, cfg, fmt=ct.COMPACT, workdir=str(tmp_path),
                      mesh=_one_device_mesh(), checkpoint_cfg=ckpt_cfg, metrics_writer=FullAtStep2())
    assert e.value.__notes__ == [f"step 2 is saved in {tmp_path}: the same command resumes from it"]
    assert sft.resume_step(str(tmp_path), ckpt_cfg) == 2


def tiny_sft_run(tok, tmp_path, conversations: int):
    """``configs/sft.py`` parsed for a tiny float32 model saved under ``tmp_path/hf`` and
    ``conversations`` rows of SFT data: one epoch of batches of 4, no export, no TensorBoard."""
    import sys

    from rstarjax.recipes.config import parse

    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import sft as sft_config

    save_hf(_tiny_model(tok), str(tmp_path / "hf"), tokenizer=tok)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": _conversation(i)}) + "\n" for i in range(conversations)))
    c = sft_config.get_config()
    c.model.hf_path, c.sft.data_path, c.model.dtype = str(tmp_path / "hf"), str(data), "float32"
    c.sft.chat_format, c.sft.epochs, c.sft.batch_size, c.sft.seq_len = "compact", 1, 4, 512
    c.sft.micro_batch_size, c.sft.export_hf, c.logging.tensorboard = 0, False, False
    c.mesh.fsdp = -1
    return parse(c, num_devices=jax.device_count())


def test_a_rerun_of_a_finished_sft_run_says_so_and_keeps_its_summary(tok, tmp_path, capsys):
    """``run_sft`` again in a finished workdir trains nothing, says so, and leaves
    ``sft_summary.json`` as the run wrote it (it was overwritten with NaN losses and 0 s)."""
    run = tiny_sft_run(tok, tmp_path, conversations=8)
    workdir = tmp_path / "run"
    first = sft.run_sft(run, str(workdir))
    written = json.loads((workdir / "sft_summary.json").read_text())
    assert np.isfinite(written["final_loss"]) and written == json.loads(json.dumps(first))
    capsys.readouterr()
    again = sft.run_sft(run, str(workdir))
    assert f"rstarjax: sft in {workdir} is already at step 2 >= 2: nothing to train" in capsys.readouterr().out
    assert json.loads((workdir / "sft_summary.json").read_text()) == written == again


def test_a_diverging_sft_run_stops_in_one_line_naming_steps_and_flags(tok, tmp_path, capsys, monkeypatch):
    """At a learning rate that diverges (1e12: step 1's update is finite and huge, every gradient
    after it nan) each later update is skipped, and after ``sft.max_nonfinite_steps`` of them in
    a row the run stops naming the steps, the quantity and the flags. Before, it went on skipping
    every update to its last step, logging nan, and ended as if it had trained."""
    import dataclasses

    from rstarjax import main
    from rstarjax.io.metrics_log import read_metrics
    from rstarjax.rl.trainer import NonFiniteTraining

    run = tiny_sft_run(tok, tmp_path, conversations=24)  # 6 steps of 4
    run = dataclasses.replace(run, sft=dataclasses.replace(run.sft, learning_rate=1e12, max_nonfinite_steps=2))
    workdir = tmp_path / "run"
    with pytest.raises(NonFiniteTraining, match=r"steps 2-3: 2 updates in a row were not finite, the last with "
                                                r"grad_norm=nan.*still those of step 1.*lower sft\.learning_rate.*"
                                                r"allow more with sft\.max_nonfinite_steps"):
        sft.run_sft(run, str(workdir))
    recs = read_metrics(str(workdir / "logs" / "metrics.jsonl"))
    assert [(r["step"], r["sft/skipped_nonfinite"]) for r in recs] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    # rstarjax.main says it in one line, exit 1
    monkeypatch.setattr(main, "run", lambda *a, **k: (_ for _ in ()).throw(NonFiniteTraining("steps 2-3: lower sft.learning_rate")))
    assert main.run_to_exit_status(None, str(workdir)) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "rstarjax: steps 2-3: lower --config.sft.learning_rate"


def test_the_epoch_is_logged_with_max_steps_too(tok, tmp_path):
    """sft/epoch with sft.max_steps was nan at every step (TensorBoard's writer warned each
    time): 8 conversations in batches of 4 are 2 steps an epoch, so 3 steps are 0.5, 1, 1.5."""
    import dataclasses
    import math

    from rstarjax.io.metrics_log import read_metrics

    run = tiny_sft_run(tok, tmp_path, conversations=8)
    run = dataclasses.replace(run, sft=dataclasses.replace(run.sft, epochs=3, max_steps=3))
    sft.run_sft(run, str(tmp_path / "run"))
    recs = read_metrics(str(tmp_path / "run" / "logs" / "metrics.jsonl"))
    assert [r["sft/epoch"] for r in recs] == [0.5, 1.0, 1.5]
    assert all(math.isfinite(v) for r in recs for v in r.values() if isinstance(v, float))


def test_an_sft_resume_past_a_damaged_newest_checkpoint_logs_each_step_once(tok, tmp_path):
    """Checkpoints at steps 2, 4 and 6, the newest damaged: the resume restores step 4 and logs
    steps 5-8 after the log's 1-4 (the writer opened at the newest checkpoint on disk, 6, kept 5
    and 6 twice: [1, ..., 6, 5, 6, 7, 8]); the summary's first loss is the run's step 1's, not
    the resumed segment's first."""
    import dataclasses

    from test_checkpoint import damage

    from rstarjax.io.metrics_log import read_metrics

    run = tiny_sft_run(tok, tmp_path, conversations=32)  # 8 steps of 4
    run = dataclasses.replace(
        run, sft=dataclasses.replace(run.sft, max_steps=6),
        checkpoint=dataclasses.replace(run.checkpoint, every_steps=2, keep=5, async_save=False))
    workdir = tmp_path / "run"
    first = sft.run_sft(run, str(workdir))
    damage(str(workdir / "checkpoints" / "6"), "cut")
    again = sft.run_sft(dataclasses.replace(run, sft=dataclasses.replace(run.sft, max_steps=0)), str(workdir))
    recs = read_metrics(str(workdir / "logs" / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert again["start_step"] == 4 and again["first_loss"] == pytest.approx(first["first_loss"])
    assert again["first_loss"] == pytest.approx(recs[0]["sft/loss"])


def test_a_checkpointed_step_has_its_tensorboard_events_on_disk(tmp_path):
    """``MetricsWriter.flush`` (called at every save): TensorBoard buffers its events, and a
    resume purges only the steps after its checkpoint, so steps up to it that a SIGKILL left in
    the buffer were lost for good (SFT writes few scalars a step: none reached the disk)."""
    import struct

    from rstarjax.io.metrics_log import MetricsWriter

    def records():
        tb = tmp_path / "tb"
        [name] = [f for f in os.listdir(tb) if f.startswith("events")]
        data, n, i = (tb / name).read_bytes(), 0, 0
        while i + 12 <= len(data):  # TFRecord: length, its CRC, the event, its CRC
            i, n = i + 12 + struct.unpack("<Q", data[i:i + 8])[0] + 4, n + 1
        return n

    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"sft/loss": 2.0, "sft/lr": 1e-3})
    writer.write(2, {"sft/loss": 1.5})
    before = records()
    writer.flush()
    assert records() > before and records() >= 1
    writer.close()
