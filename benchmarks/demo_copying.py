"""Where the demo's SFT policy miscopies: teacher-forced accuracy of every digit the policy must
copy from the question into its program, per task kind and operand (docs/demo.md).

    python benchmarks/demo_copying.py WORKDIR/sft/checkpoints WORKDIR/sft_traces.jsonl [--per-kind 48]

Prints one JSON line: {"<kind>/<operand index>": accuracy, ...} over the first ``--per-kind``
tool traces of each kind (the operand index counts the question's numbers, left to right; a
literal 1 is skipped: the counting program's range starts at 1 too). A digit counts as copied
when the policy's argmax at the position before it is that digit, given the true prefix.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "configs"))

import demo as demo_config  # noqa: E402  (configs/demo.py)
from rstarjax.io import checkpoint as ckpt_lib  # noqa: E402
from rstarjax.models.chat_template import chat_format, encode_conversation  # noqa: E402
from rstarjax.recipes import build, demo  # noqa: E402
from rstarjax.recipes.config import parse  # noqa: E402
from rstarjax.recipes.demo_tasks import kind_of  # noqa: E402


def load_policy(checkpoint: str):
    run = parse(demo_config.get_config())
    tokenizer = build.tokenizer(run.model)
    model = demo.demo_policy(run, tokenizer, build.mesh(run.mesh))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step, _ = ckpt_lib.read_checkpoint_meta(checkpoint)
    restored, _, _ = ckpt_lib.restore_params(checkpoint, ckpt_lib.abstract_like(params), step=step)
    return nnx.merge(graphdef, restored, rest), tokenizer, chat_format(run.sft.chat_format)


def copied_digits(ids: np.ndarray, predicted: np.ndarray, pieces: list[str], question: str,
                  code: str) -> dict[int, list[bool]]:
    """{operand index: [copied?] per digit} for the question's numbers found in the code."""
    ends = np.cumsum([len(p) for p in pieces])  # character end of every token
    text = "".join(pieces)
    code_text = json.dumps(code)[1:-1]  # as the tool call writes it
    start = text.find(code_text)
    out = {}
    for i, number in enumerate(re.findall(r"\d+", question)):
        found = re.search(rf"(?<!\d){number}(?!\d)", text[start:start + len(code_text)])
        if start < 0 or number == "1" or not found:
            continue
        first = start + found.start()
        tokens = [int(np.searchsorted(ends, first + k, side="right")) for k in range(len(number))]
        out[i] = [bool(predicted[t - 1] == ids[t]) for t in tokens]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("traces")
    ap.add_argument("--per-kind", type=int, default=48)
    args = ap.parse_args()
    model, tokenizer, fmt = load_policy(args.checkpoint)
    forward = jax.jit(lambda ids: model(ids))
    hits, seen = collections.defaultdict(list), collections.Counter()
    with open(args.traces) as f:
        for line in f:
            messages = json.loads(line)["messages"]
            calls = messages[1].get("tool_calls") if len(messages) > 1 else None
            kind = kind_of(messages[0]["content"])
            if not calls or seen[kind] >= args.per_kind:
                continue
            seen[kind] += 1
            ids = np.asarray(encode_conversation(tokenizer, messages, fmt=fmt).ids)
            predicted = np.asarray(forward(jnp.asarray(ids)[None]))[0].argmax(-1)
            pieces = [tokenizer.decode([int(t)]) for t in ids]
            code = calls[0]["function"]["arguments"]["code"]
            for operand, ok in copied_digits(ids, predicted, pieces, messages[0]["content"], code).items():
                hits[f"{kind}/{operand}"] += ok
    print(json.dumps({k: round(float(np.mean(v)), 4) for k, v in sorted(hits.items())}))


if __name__ == "__main__":
    main()
