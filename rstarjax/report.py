"""Training curves as PNG files: ``python -m rstarjax.report WORKDIR [--compare WORKDIR2 ...]``.

Reads every ``metrics.jsonl`` under WORKDIR (RL: ``logs/metrics.jsonl``; SFT and the demo's
stages: ``sft/logs``, ``rl/logs``) and draws what rStar2-Agent plots: reward / accuracy, response
length, the tool-error ratio within positively rewarded trajectories before and after RoC
(Fig. 4), the truncation (clip) ratio (Fig. 8), and the SFT loss and learning rate. Output goes
to ``WORKDIR/plots/*.png``. ``--compare`` overlays several runs (e.g. GRPO-RoC vs plain GRPO on
the demo, same seed and steps) in ``WORKDIR/plots/compare_*.png`` and prints the mean
positive-trajectory tool-error ratio of each run as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

from rstarjax.io.metrics_log import read_metrics

# Each panel: (file stem, title, [(metric key, label)]). Missing keys are skipped.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", "Reward / accuracy", (
        ("rollout_all/reward_mean", "reward (all 2G rollouts)"),
        ("rollout/reward_mean", "reward (trained G)"),
        ("rollout_all/accuracy", "accuracy (all)"))),
    ("response_length", "Response length (tokens)", (
        ("rollout_all/response_length_mean", "mean (all)"),
        ("rollout/response_length_mean", "mean (trained)"),
        ("rollout/model_tokens_mean", "model tokens (trained)"))),
    ("tool_error_positive", "Tool-error ratio in positive trajectories (Fig. 4)", (
        ("roc/tool_error_ratio_positive_before", "before RoC (all 2G)"),
        ("roc/tool_error_ratio_positive_after", "after RoC (trained G)"),
        ("rollout/tool_error_ratio_positive", "trained G"))),
    ("truncation", "Truncation (clip) ratio", (
        ("rollout_all/truncation_ratio", "all rollouts"),
        ("rollout/truncation_ratio", "trained"))),
    ("tool_calls", "Tool calls per trajectory", (
        ("rollout/tool_calls_mean", "calls"),
        ("rollout/turns_mean", "turns"))),
    ("sft_loss", "SFT loss (assistant tokens)", (("sft/loss", "loss"),)),
    ("learning_rate", "Learning rate", (("sft/lr", "SFT"), ("train/lr", "RL"))),
)


def find_metrics_files(workdir: str) -> list[str]:
    """Every metrics.jsonl under ``workdir`` (sorted, so plots are stable)."""
    out = []
    for root, _, files in os.walk(workdir):
        if "metrics.jsonl" in files:
            out.append(os.path.join(root, "metrics.jsonl"))
    return sorted(out)


def curve(records: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, finite numbers only, the last record per step winning (a
    resumed run rewrites the steps after its checkpoint)."""
    by_step: dict[int, float] = {}
    for r in records:
        v, step = r.get(key), r.get("step")
        if _finite_number(v) and _finite_number(step):  # (a record without a usable step: no point)
            by_step[int(step)] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_labels(workdirs: Sequence[str], labels: Sequence[str] | None = None) -> list[str]:
    """One label per run: the given ones (as many as runs), else each directory's name, with the
    path from the runs' common parent where two share a name (``a/run``, ``b/run``)."""
    if labels:
        if len(labels) != len(workdirs):
            raise ValueError(f"{len(labels)} labels for {len(workdirs)} runs: give one label a run")
        if len(set(labels)) != len(labels):
            raise ValueError(f"two runs are labelled alike in {list(labels)}: one would hide the other")
        return list(labels)
    paths = [os.path.normpath(os.path.abspath(w)) for w in workdirs]
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    parent = os.path.commonpath(paths)
    return [os.path.relpath(p, os.path.dirname(parent)) if p == parent else os.path.relpath(p, parent)
            for p in paths]


def plot_lines(path: str, title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
               xlabel: str = "step", title_size: float | None = None) -> None:
    """One PNG at ``path``: a line per (label, xs, ys) of ``series``."""
    # lazily: matplotlib takes seconds to import and only drawing needs it (not runs that merely
    # import the report, such as the demo before its last step)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set_title(title, fontsize=title_size)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render(workdir: str, out_dir: str | None = None) -> list[str]:
    """Draw every panel with data; returns the PNG paths written."""
    files = find_metrics_files(workdir)
    if not files:
        raise FileNotFoundError(f"no metrics.jsonl under {workdir}")
    out_dir = out_dir or os.path.join(workdir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    runs = {os.path.relpath(os.path.dirname(f), workdir): read_metrics(f) for f in files}
    written = []
    for stem, title, keys in PANELS:
        series = []
        for run, records in runs.items():
            for key, label in keys:
                xs, ys = curve(records, key)
                if xs:
                    series.append((label if len(runs) == 1 else f"{label} [{run}]", xs, ys))
        if series:
            path = os.path.join(out_dir, f"{stem}.png")
            plot_lines(path, title, series)
            written.append(path)
    if not written:  # a run that logged no step yet (or none of the panels' keys): say so, not a silent exit 0
        raise ValueError(f"nothing to plot: {', '.join(files)} hold{'s' if len(files) == 1 else ''} no step "
                         "with a metric the panels draw (a run that has not finished a step yet)")
    return written


def compare(workdirs: Sequence[str], out_dir: str, labels: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Overlay runs (e.g. GRPO-RoC vs GRPO): reward and the tool-error ratio in positive
    trajectories; returns per-run means of the trained batch's figures."""
    labels = run_labels(workdirs, labels)
    os.makedirs(out_dir, exist_ok=True)
    runs = {}
    for label, w in zip(labels, workdirs):
        files = find_metrics_files(w)
        records = [r for f in files for r in read_metrics(f) if "rollout/reward_mean" in r]
        if not records:
            raise FileNotFoundError(f"no RL metrics under {w}")
        runs[label] = records
    summary = {}
    for label, records in runs.items():
        def mean(key):
            _, ys = curve(records, key)
            return float(sum(ys) / len(ys)) if ys else float("nan")
        summary[label] = {
            "tool_error_ratio_positive": mean("rollout/tool_error_ratio_positive"),
            "tool_error_ratio_positive_all_rollouts": mean("roc/tool_error_ratio_positive_before"),
            "reward_mean": mean("rollout_all/reward_mean"),
            "steps": len(curve(records, "rollout/reward_mean")[0]),
        }
    for stem, key, title in (("compare_tool_error_positive", "rollout/tool_error_ratio_positive",
                              "Tool-error ratio in trained positive trajectories"),
                             ("compare_reward", "rollout_all/reward_mean", "Reward (all rollouts)")):
        plot_lines(os.path.join(out_dir, f"{stem}.png"), title,
              [(label, *curve(records, key)) for label, records in runs.items()])
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rstarjax.report", description=__doc__.split("\n")[0])
    p.add_argument("workdir")
    p.add_argument("--compare", nargs="*", default=None, help="more run directories to overlay with WORKDIR")
    p.add_argument("--labels", nargs="*", default=None)
    p.add_argument("--out", default=None, help="output folder (default WORKDIR/plots)")
    args = p.parse_args(argv)
    try:
        if args.compare:
            out = args.out or os.path.join(args.workdir, "plots")
            summary = compare([args.workdir, *args.compare], out, args.labels)
            print(json.dumps({run: {k: (v if _finite_number(v) else None) for k, v in figures.items()}
                              for run, figures in summary.items()}, allow_nan=False))  # strict JSON: no NaN
        else:
            for path in render(args.workdir, args.out):
                print(path)
    except (FileNotFoundError, ValueError) as e:
        print(f"report failed: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
