"""The optimizer step with its non-finite guard: a branch (``rl/trainer.py``
``guarded_update``, ``lax.cond``) against the elementwise select it replaced, both around
the trainer's AdamW with gradient clipping (``rl/optim.py``) on the same float32 parameters.

    python benchmarks/optimizer_guard.py [--params-m 100] [--arrays 4] [--repeats 3]

Prints ONE JSON line: the median step of each (``--repeats`` alternating rounds of 5 timed
steps each), their ranges and the ratio; and whether the two give the same parameters and
moments (they must: only how the choice is made differs).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rstarjax.rl.optim import adamw
from rstarjax.rl.trainer import guarded_update


def make_steps(optimizer):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def branch(params, opt_state, grads):  # the train step's own
        return guarded_update(optimizer, params, opt_state, grads, 0.0)[:2]

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def select(params, opt_state, grads):  # the guard before: one more pass over both trees
        updates, new_state = optimizer.update(grads, opt_state, params)
        finite = jnp.isfinite(optax.global_norm(grads) + optax.global_norm(updates))
        new = (optax.apply_updates(params, updates), new_state)
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (params, opt_state))

    return {"branch": branch, "select": select}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=float, default=100.0, help="float32 parameters, millions")
    ap.add_argument("--arrays", type=int, default=4, help="split over this many arrays")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    args = ap.parse_args(argv)
    size = max(1, int(args.params_m * 1e6 / args.arrays))
    params = {f"w{i}": jnp.full((size,), 0.1, jnp.float32) for i in range(args.arrays)}
    grads = {k: jnp.full_like(v, 1e-3) for k, v in params.items()}
    optimizer = adamw(1e-4, weight_decay=0.01, grad_clip_norm=1.0)
    steps = make_steps(optimizer)
    times = {name: [] for name in steps}
    finals = {}
    for _ in range(args.repeats):
        for name, fn in steps.items():
            p = jax.tree.map(jnp.copy, params)
            s = optimizer.init(p)
            p, s = fn(p, s, grads)  # compiled here, untimed
            jax.block_until_ready((p, s))
            rounds = []
            for _ in range(args.steps):
                t = time.perf_counter()
                p, s = fn(p, s, grads)
                jax.block_until_ready((p, s))
                rounds.append(time.perf_counter() - t)
            times[name].append(statistics.median(rounds))
            finals[name] = [np.asarray(x) for x in jax.tree.leaves((p, s))]
    same = all(np.array_equal(a, b) for a, b in zip(finals["branch"], finals["select"]))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    line = {"bench": "optimizer_guard", "device": jax.devices()[0].device_kind,
            "params_m": args.params_m, "repeats": args.repeats,
            "branch_step_ms": round(1e3 * med["branch"], 2),
            "branch_step_ms_range": [round(1e3 * min(times["branch"]), 2), round(1e3 * max(times["branch"]), 2)],
            "select_step_ms": round(1e3 * med["select"], 2),
            "select_step_ms_range": [round(1e3 * min(times["select"]), 2), round(1e3 * max(times["select"]), 2)],
            "speedup_vs_select": round(med["select"] / med["branch"], 3),
            "same_params_and_moments": same}
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
