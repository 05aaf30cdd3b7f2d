"""Tokenizer throughput: rstarjax (tiktoken) vs HF `tokenizers` loading our tokenizer.json
(the baseline), same corpus, same process, one thread each. Prints one JSON line;
``speedup_vs_hf`` is against the faster of HF's two ways (``encode_batch`` or one ``encode`` a
text), ``speedup_vs_hf_single`` against the second alone.

    python benchmarks/bench_tokenizer.py [--chars 2000000]
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rstarjax.models import chat_template as ct  # noqa: E402
from rstarjax.models.tokenizer import load_tokenizer  # noqa: E402


def corpus(max_chars: int) -> list[str]:
    import numpy

    texts, total = [], 0
    root = os.path.dirname(numpy.__file__)
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()[:20000]
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def best_of(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chars", type=int, default=2_000_000)
    args = ap.parse_args()
    t = time.perf_counter()
    tok = load_tokenizer()
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    hf = tok.to_hf_tokenizer()
    hf_build_s = time.perf_counter() - t
    texts = corpus(args.chars)
    n_chars = sum(map(len, texts))
    ours_s, ours = best_of(lambda: [tok.encode(x) for x in texts])
    hf_s, theirs = best_of(lambda: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)])
    hf_single_s, _ = best_of(lambda: [hf.encode(x, add_special_tokens=False).ids for x in texts])
    n_tokens = sum(map(len, ours))
    prompt_s, _ = best_of(lambda: [ct.encode_prompt(tok, "Compute 4222464 * 4055866.") for _ in range(1000)])
    turn_s, _ = best_of(lambda: [ct.encode_tool_response_turn(tok, "17125748173824") for _ in range(1000)])
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        tok.save_pretrained(d)
        save_s = time.perf_counter() - t
    print(json.dumps({
        "bench": "tokenizer", "chars": n_chars, "tokens": n_tokens, "identical": ours == theirs,
        "ours_tiktoken_mchars_per_s": round(n_chars / ours_s / 1e6, 2),
        "baseline_hf_tokenizers_batch_mchars_per_s": round(n_chars / hf_s / 1e6, 2),
        "baseline_hf_tokenizers_single_mchars_per_s": round(n_chars / hf_single_s / 1e6, 2),
        "speedup_vs_hf": round(min(hf_s, hf_single_s) / ours_s, 2),
        "speedup_vs_hf_single": round(hf_single_s / ours_s, 2),
        "encode_prompt_us": round(prompt_s / 1000 * 1e6, 1),
        "encode_tool_response_turn_us": round(turn_s / 1000 * 1e6, 1),
        "load_tokenizer_s": round(load_s, 2), "hf_build_s": round(hf_build_s, 2),
        "save_pretrained_s": round(save_s, 2),
    }))


if __name__ == "__main__":
    main()
