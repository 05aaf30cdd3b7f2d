"""Evaluation (rStar2-Agent §5.1, Table 4): k samples per problem, pass@1 averaged over k,
maj@k, pass@k and mean response length, per dataset.

The metric functions are pure (numbers in, numbers out). ``evaluate_records`` turns sampled
trajectories into per-problem records and a per-dataset table; ``run_eval`` drives the real
rollout loop (rl/agent_loop.py) over benchmark files (the AIME 2024/2025 and MATH-500 jsonl /
parquet layouts that ``io.data.load_problems`` reads) and writes ``eval_table.md``,
``eval_results.json`` and ``eval_samples.jsonl`` (one line per problem with its trajectories).
"""
from __future__ import annotations

import collections
import dataclasses
import fractions
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from rstarjax.env.verify import MAX_ANSWER_CHARS, extract_final_answer, normalize_integer
from rstarjax.io import data as data_lib
from rstarjax.io import files
from rstarjax.io.data import DataError, load_problems
from rstarjax.models.chat_template import CHAT_FORMATS, chat_format, encode_prompt, jinja_chat_template
from rstarjax.recipes import build, preemption
from rstarjax.recipes.config import RunConfig
from rstarjax.rl.trajectory import FinishReason, RolloutFn, Trajectory, group_indices, trajectories_of

log = logging.getLogger(__name__)


# ---- metrics (pure) --------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):
    1 - C(n - c, k) / C(n, k), computed as a stable product."""
    if not (0 <= c <= n) or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n} c={c} k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_1(correct: Sequence[bool]) -> float:
    """pass@1 averaged over the k samples of one problem (the paper's "average pass@1")."""
    if len(correct) == 0:
        raise ValueError("no samples")
    return float(np.mean(np.asarray(correct, np.float64)))


# white space between two digits: "1 2" is no 12 to the verifier (thousands groups, "1 000", are
# read by normalize_integer first)
_DIGIT_GAP = re.compile(r"(?<=\d)\s+(?=\d)", re.ASCII)
# a decimal number ("12.0", "-.5") or a fraction of two integers ("\frac{1}{2}", "\dfrac12", "3/4")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)", re.ASCII)
_FRACTION = re.compile(r"([+-]?)\\[dt]?frac(?:\{([+-]?\d+)\}|(\d))(?:\{([+-]?\d+)\}|(\d))|([+-]?\d+)/([+-]?\d+)",
                       re.ASCII)


def _rational(answer: str) -> fractions.Fraction | None:
    """The exact value of an answer written as a decimal or a fraction of integers, else None."""
    s = answer.strip().strip("$")
    if _DIGIT_GAP.search(s):  # "1 2": two numbers
        return None
    s = "".join(s.split())
    if _DECIMAL.fullmatch(s):
        return fractions.Fraction(s)
    m = _FRACTION.fullmatch(s)
    if not m:
        return None
    sign, num, num1, den, den1, plain_num, plain_den = m.groups()
    top, bottom = int(num or num1 or plain_num), int(den or den1 or plain_den)
    if bottom == 0:
        return None
    return fractions.Fraction(-top if sign == "-" else top, bottom)


def answer_key(answer: str | None) -> str | None:
    """Vote key of an extracted answer: integers canonically ("1,000" == "1 000" == "1000"),
    decimals and integer fractions by their exact value ("12.0" == "12", "0.5" == "\\frac{1}{2}"
    == "1/2"), else the text with white space removed, except between two digits ("1 2" votes
    apart from "12"). None (no answer) never votes. An answer longer than the verifier reads
    (``MAX_ANSWER_CHARS``; it scores 0) votes by its text: it is no number to parse, and Python
    refuses integers of over 4,300 digits."""
    if answer is None or not answer.strip():
        return None
    if len(answer) > MAX_ANSWER_CHARS:
        return "".join(answer.split())
    as_int = normalize_integer(answer)
    if as_int is not None:
        return str(as_int)
    value = _rational(answer)
    if value is not None:
        return str(value)
    return "".join(_DIGIT_GAP.sub("\u2423", answer).split())


def majority_vote(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """maj@k: is the most frequent answer among the samples correct?

    ``answers[i]`` is the answer the verifier judged for sample i (None: no answer, or a sample
    that was not verified), ``correct[i]`` its verdict. Ties go to the answer that reached the
    top count first (sample order), so the result is deterministic. A problem where no sample
    produced an answer scores 0. The winning answer is correct when the verifier accepted it in
    any of its samples (the samples of one vote key write one value; none of them is judged by
    another sample's fate)."""
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
    counts: collections.Counter = collections.Counter()
    best, best_count = None, 0
    for a in answers:
        key = answer_key(a)
        if key is None:
            continue
        counts[key] += 1
        if counts[key] > best_count:
            best, best_count = key, counts[key]
    if best is None:
        return False
    return any(bool(c) for a, c in zip(answers, correct) if answer_key(a) == best)


@dataclasses.dataclass
class ProblemResult:
    uid: str
    dataset: str
    problem: str
    gold: str
    answers: list[str | None]
    correct: list[bool]
    response_lengths: list[int]  # tokens of model + tool text per sample
    samples: list[dict] = dataclasses.field(default_factory=list)  # per-sample details for the JSONL
    # per sample: ended by a failure of the environment (a dead sandbox, a verifier that never
    # answered), so never scored; empty: none did
    infra_errors: list[bool] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def scored(self) -> list[int]:
        """The samples the environment scored: an infrastructure failure is not the model's."""
        return [i for i in range(len(self.correct)) if not (self.infra_errors and self.infra_errors[i])]


def dataset_metrics(results: Sequence[ProblemResult], k: int) -> dict[str, float]:
    """Table 4 figures over one dataset: pass@1 (mean over k), maj@k, pass@k, mean length.

    Samples that an infrastructure failure ended are no sample of the model: each problem is
    scored on its other samples (pass@k on n of them with k capped at n), a problem left with
    none is left out, and both are counted (``infra_errors`` samples, ``problems_unscored``) so
    a figure never hides them; every problem unscored is an error."""
    if not results:
        raise ValueError("no problems")
    for r in results:
        if len(r.correct) < k:
            raise ValueError(f"problem {r.uid} has {len(r.correct)} samples, fewer than k={k}")
    scored = [(r, r.scored) for r in results]
    scored = [(r, idx) for r, idx in scored if idx]
    if not scored:
        raise RuntimeError(f"every sample of all {len(results)} problems ended in an infrastructure failure "
                           "(the code pool or the verifier): nothing to score")

    def pick(values, idx):
        return [values[i] for i in idx]

    return {
        "num_problems": len(scored),
        "k": k,
        "pass@1": float(np.mean([mean_pass_at_1(pick(r.correct, i)) for r, i in scored])),
        f"maj@{k}": float(np.mean([majority_vote(pick(r.answers, i), pick(r.correct, i)) for r, i in scored])),
        f"pass@{k}": float(np.mean([pass_at_k(len(i), sum(pick(r.correct, i)), min(k, len(i))) for r, i in scored])),
        "mean_response_length": float(np.mean([np.mean(pick(r.response_lengths, i)) for r, i in scored])),
        "infra_errors": sum(len(r.correct) - len(r.scored) for r in results),
        "problems_unscored": len(results) - len(scored),
    }


def problem_result(record: Mapping[str, str], trajectories: Sequence[Trajectory], dataset: str,
                   outside_answer_block: bool = False) -> ProblemResult:
    """One problem's samples -> ProblemResult (reward > 0 is "correct", as in training). Each
    sample's answer is read from the text its verifier judged (the model's own, not a program's
    output; none for a sample cut at its length, which scores 0 unverified), as the reward reads it
    (``outside_answer_block``: the text's last box where it has no <answer> block, as
    ``reward.mode=boxed`` and the official reward do)."""
    failed = [t.finish == FinishReason.ERROR for t in trajectories]
    answers = [extract_final_answer(t.graded_text, outside_answer_block) if t.graded_text is not None and not bad
               else None for t, bad in zip(trajectories, failed)]
    samples = [
        {
            "response": t.response_text,
            "answer": a,
            "reward": float(t.reward),
            "response_length": int(len(t.response_ids)),
            "model_tokens": t.num_model_tokens,
            "turns": t.turns,
            "tool_calls": t.tool_calls,
            "tool_errors": t.tool_errors.total,
            "finish": getattr(t.finish, "value", str(t.finish)),
            "error": t.error,
        }
        for t, a in zip(trajectories, answers)
    ]
    return ProblemResult(
        uid=str(record.get("uid", "")),
        dataset=dataset,
        problem=record["problem"],
        gold=str(record["answer"]),
        answers=answers,
        correct=[t.reward > 0 for t in trajectories],
        response_lengths=[int(len(t.response_ids)) for t in trajectories],
        samples=samples,
        infra_errors=failed if any(failed) else [],
    )


def format_table(per_dataset: Mapping[str, Mapping[str, float]], k: int) -> str:
    """A Markdown table with one row per dataset (percentages, as the paper's tables)."""
    cols = ["pass@1", f"maj@{k}", f"pass@{k}"]
    lines = ["| dataset | problems | " + " | ".join(cols) + " | mean length |",
             "|---|---:|" + "---:|" * len(cols) + "---:|"]
    for name, m in per_dataset.items():
        vals = " | ".join(f"{100 * m[c]:.1f}" for c in cols)
        lines.append(f"| {name} | {m['num_problems']} | {vals} | {m['mean_response_length']:.0f} |")
    failed = {name: m for name, m in per_dataset.items() if m.get("infra_errors")}
    for name, m in failed.items():  # said under the table, where the figures are read
        lines.append(f"\n{name}: {m['infra_errors']} samples ended in an infrastructure failure and were not "
                     f"scored ({m['problems_unscored']} problems left with none, not counted)")
    return "\n".join(lines) + "\n"


# ---- driver ------------------------------------------------------------------------------------
def evaluate_records(datasets: Mapping[str, Sequence[Mapping[str, str]]],
                     sample: Callable[[Sequence[Mapping[str, str]], int], Sequence[Sequence[Trajectory]]], k: int,
                     out_dir: str | None = None, reward_mode: str = "answer", chat_format_used: str | None = None,
                     ) -> dict[str, dict[str, float]]:
    """Sample k trajectories per problem of every dataset (``sample(records, k)``: for each record
    its k trajectories, rewards computed; ``per_problem`` makes one of a ``RolloutFn``), score them
    and (optionally) write ``eval_samples.jsonl``, ``eval_results.json`` and ``eval_table.md`` into
    ``out_dir``. ``chat_format_used``: the prompts' format, kept with each dataset's figures (a
    score is only comparable with one asked in the same format)."""
    per_dataset: dict[str, dict[str, float]] = {}
    all_results: list[ProblemResult] = []
    for name, records in datasets.items():
        groups = sample(records, k)
        if len(groups) != len(records):
            raise RuntimeError(f"rollouts returned {len(groups)} groups for {len(records)} problems")
        results = [problem_result(rec, trajs, name, outside_answer_block=reward_mode != "answer")
                   for rec, trajs in zip(records, groups)]
        per_dataset[name] = dataset_metrics(results, k)
        if chat_format_used:
            per_dataset[name]["chat_format"] = chat_format_used
        all_results.extend(results)
        log.info("eval %s: %s", name, per_dataset[name])
        if per_dataset[name]["infra_errors"]:
            log.warning("eval %s: %d samples ended in an infrastructure failure and were not scored "
                        "(eval_samples.jsonl names each error)", name, per_dataset[name]["infra_errors"])
    if out_dir:
        # each file whole or not at all: a kill mid-write left it cut short for whoever reads it next
        files.write_jsonl_atomic(os.path.join(out_dir, "eval_samples.jsonl"), [r.to_json() for r in all_results],
                                 ensure_ascii=False)
        files.write_json_atomic(os.path.join(out_dir, "eval_results.json"), per_dataset)
        files.write_atomic(os.path.join(out_dir, "eval_table.md"), format_table(per_dataset, k))
    return per_dataset


def dataset_names(paths: Sequence[str]) -> list[str]:
    """Each file's stem, or, where two files share one (HF downloads are often all
    ``test.parquet``), as many trailing path parts as tell them apart: ``aime24/test``."""
    parts = [os.path.splitext(os.path.normpath(os.path.abspath(p)))[0].split(os.sep) for p in paths]
    names = []
    for mine in parts:
        depth = 1
        while depth < len(mine) and sum(p[-depth:] == mine[-depth:] for p in parts) > 1:
            depth += 1
        names.append("/".join(mine[-depth:]))
    return names


def load_benchmarks(paths: Sequence[str], names: Sequence[str] | None = None,
                    limit: int = 0, handling: str = "paper") -> dict[str, list[dict[str, str]]]:
    """Benchmark files -> {dataset name: records}. Answers are kept as written (MATH-500 has
    non-integer answers; math-verify compares them). Name defaults to the file's stem.
    ``handling``: ``data.handling`` ("official": problems as written too, repeats kept).

    Every row is kept, so a benchmark is scored over all its problems as published; the rows
    whose gold answer the verifier cannot use as a mathematical object (``io.data.
    why_unverifiable``: an empty ``\\boxed{}``, text math-verify matches only character for
    character, a comparison that would time out) are counted and named in one warning line,
    since their samples score 0 unless written exactly as the gold."""
    if isinstance(paths, str):
        paths = [p for p in paths.split(",") if p]
    if not paths:
        raise ValueError("eval needs at least one benchmark file (--config.eval.paths=a.jsonl,b.parquet)")
    names = list(names) if names else dataset_names(paths)
    if len(names) != len(paths):
        raise ValueError(f"{len(names)} dataset names for {len(paths)} files")
    if len(set(names)) != len(names):  # one result would overwrite the other's
        raise DataError(f"two benchmarks are named alike in {names}: give each its own name")
    out = {}
    for name, path in zip(names, paths):
        if not os.path.exists(path):
            raise FileNotFoundError(f"benchmark file {path!r} does not exist")
        records, _ = load_problems(path, integer_only=False, handling=handling)
        records = records[:limit] if limit else records
        hard = [(rec, why) for rec in records if (why := data_lib.why_unverifiable(rec["answer"]))]
        if hard:
            named = "; ".join(f"{rec.get('uid', '')} [{why}]" for rec, why in hard[:5])
            log.warning("benchmark %s: %d of %d rows have a gold answer the verifier cannot use as a mathematical "
                        "object (their samples score 0 unless written exactly as the gold): %s%s", name, len(hard),
                        len(records), named, f"; and {len(hard) - 5} more" if len(hard) > 5 else "")
        out[name] = records
    return out


def without_long_prompts(datasets: Mapping[str, list[dict]], tokenizer, chat: str, max_prompt_len: int
                         ) -> dict[str, list[dict]]:
    """Each benchmark without the problems whose prompt (as the rollouts encode it) is longer
    than ``max_prompt_len`` tokens, skipped and counted in a warning line naming their rows, before
    any model is built (one of them failed the whole evaluation after the model and the code
    pool were up); a benchmark left with none is a ``DataError``. The results' ``num_problems``
    says how many were scored."""
    fmt = chat_format(chat)
    out = {}
    for name, records in datasets.items():
        report = data_lib.DataReport(total=len(records), kept=len(records))
        out[name] = data_lib.drop_long_prompts(records, report, lambda p: len(encode_prompt(tokenizer, p, fmt)),
                                               max_prompt_len, "--config.eval.max_prompt_len")
    return out


def hf_dir_chat_format(hf_path: str) -> str | None:
    """The chat format whose template a HF directory's ``tokenizer_config.json`` holds (what
    ``save_hf`` writes for the format the model was trained with), or None: no such file, or a
    template of none of ``CHAT_FORMATS`` (a plain HF model's own)."""
    try:
        with open(os.path.join(hf_path, "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return next((name for name, fmt in CHAT_FORMATS.items() if template == jinja_chat_template(fmt)), None)


def recorded_chat_format(hf_path: str, checkpoint_meta: Mapping | None) -> tuple[str | None, str]:
    """``(format, where it is recorded)`` of the evaluated policy: with a checkpoint
    (``checkpoint.init_from``), its meta's ``chat_format`` (None for one older than the record);
    else the chat template of the HF directory ``hf_path``."""
    if checkpoint_meta is not None:
        return checkpoint_meta.get("chat_format"), "the checkpoint's meta"
    return (hf_dir_chat_format(hf_path) if hf_path else None), f"{hf_path}/tokenizer_config.json"


def choose_chat_format(given: str, recorded: str | None, where: str) -> tuple[str, str | None]:
    """``(format, a warning line or None)``: the one ``eval.chat_format`` names (``given``), else
    the model's ``recorded`` one, else "rstar2". Naming another than the recorded one is allowed
    (comparing formats is a real experiment) but warned about: it scores the model on prompts it
    was not trained on."""
    if not given:
        return recorded or "rstar2", None
    if recorded and recorded != given:
        return given, (f"--config.eval.chat_format={given} differs from the format the model was trained with "
                       f"({recorded}, recorded in {where}): its scores are of prompts it never saw in training")
    return given, None


def per_problem(rollout_fn: RolloutFn, seed: int = 0):
    """``(records, k) -> k trajectories per record`` from a ``RolloutFn`` (whose trajectories
    carry ``group_id`` = record index)."""

    def sample(records, k):
        trajs = trajectories_of(rollout_fn(list(records), k, seed, 0))
        groups = [[trajs[i] for i in idx] for idx in group_indices([t.group_id for t in trajs], len(records)).values()]
        short = [i for i, g in enumerate(groups) if len(g) != k]
        if short:
            raise RuntimeError(f"rollouts returned the wrong number of samples for problems {short[:5]}")
        return groups

    return sample


def run_eval(run: RunConfig, workdir: str) -> dict[str, dict[str, float]]:
    """``mode=eval``: ``eval.k`` samples per problem of every benchmark file in ``eval.paths``
    through the agent loop, with the evaluation's sampling and budgets (§5.1: T=0.6, 30K tokens,
    30 turns); writes eval_table.md, eval_results.json, eval_samples.jsonl. The policy is
    ``model.hf_path``'s, or with ``checkpoint.init_from`` (a run's WORKDIR/checkpoints) that
    checkpoint's newest, on the architecture and tokenizer of ``model.hf_path``. Prompts are in
    the chat format the policy records (``recorded_chat_format``) unless ``eval.chat_format``
    names one (``choose_chat_format``)."""
    e = run.eval
    datasets = load_benchmarks(e.path_list, list(e.names) if e.names else None, e.limit, run.data.handling)
    init_from = run.checkpoint.init_from
    checkpoint_meta = None
    if init_from:  # a run's checkpoint, checked before the model is built (a missing one: one line)
        _, checkpoint_meta = build.init_from_checkpoint(init_from)
    recorded, where = recorded_chat_format(run.model.hf_path, checkpoint_meta)
    chat, warning = choose_chat_format(e.chat_format, recorded, where)
    if warning:
        log.warning(warning)
    elif recorded and not e.chat_format:
        print(f"rstarjax: eval prompts in chat_format {chat}, recorded in {where} "
              "(--config.eval.chat_format overrides it)", flush=True)
    mesh = build.mesh(run.mesh)
    tokenizer = build.tokenizer(run.model)
    datasets = without_long_prompts(datasets, tokenizer, chat, e.max_prompt_len)
    # with init_from its weights replace the built ones (LoRA: the adapters' base is read)
    model = build.policy(run.model, mesh, run.seed, read_weights=not init_from or run.model.lora_rank > 0,
                         **build.vocabulary_of(tokenizer))
    if init_from:  # evaluate the checkpoint's policy, never silently the base model it was built from
        model, step = build.restore_policy(model, init_from, mesh)
        print(f"rstarjax: evaluating the policy of step {step} of {init_from}", flush=True)
    t0 = time.time()
    # SIGTERM / SIGINT abandon the rollouts and end the run in one line (preemption.Interrupted:
    # main exits at once, with 128 + the signal), not in an abort of threads inside device calls
    with preemption.SignalGuard(run.checkpoint.preemption_grace_s,
                                stopping="abandoning the evaluation (it writes no partial results) and exiting") as guard:
        executor = build.executor(run.rl.num_tool_workers, run.env.allow_unconfined)
        try:
            rollouts = build.rollouts(model, tokenizer, executor, run.eval_agent(), e.sampling(), e.max_prompt_len,
                                      chat, run.serving, num_slots=e.num_slots)
            with guard.rollouts():
                out = evaluate_records(datasets, per_problem(rollouts, run.seed), e.k, workdir, run.reward.mode,
                                       chat_format_used=chat)
        except preemption.StepAbandoned:
            raise preemption.Interrupted(guard.request.signum, 0, False, False,
                                         done="abandoned the evaluation in progress; it writes its results once "
                                              "every problem is done, so none were written") from None
        finally:
            executor.close(drain_timeout=0.0 if guard.request is not None else None)
    log.info("eval finished in %.0f s", time.time() - t0)
    print(format_table(out, e.k), flush=True)
    return out
