"""Rollouts in a process apart from the trainer's (``serving.placement='disaggregated'`` in a
2-process run; docs/training.md "Placement").

Process 0 trains on its devices; process 1 rolls out on all of its own, one serving slice,
with its own code pool (``recipes.rollout_process``). The trainer process drives it through
``RemoteRollouts``, a ``RolloutFn`` like the colocated one, so the RL loop (synchronous, or
with ``rl.max_staleness`` its rollout thread) is unchanged; the rollout process answers in
``serve_remote``. Rewards are computed where the rollouts run.

**Messages** (a round's prompts, its trajectories, "new weights follow", "stop") go through
the key-value store of the coordination service that ``jax.distributed`` starts, pickled, in
order, each direction under its own numbered keys (``Mailbox``). **Weights never do**: after
each update the trainer process casts its state into the slice's layout on its own devices
(``handoff.stage_in_layout``) and both processes run ``handoff.copy_to_receiver``, one
compiled program in which each trainer device sends its shard to the rollout device that holds
the same shard. The rollout process installs it between rounds, where the colocated loop does.

Every wait is bounded: a process that dies or stops answering leaves the other a
``TimeoutError`` naming what it waited for; a failing round comes back to the trainer as a
``RuntimeError`` with the rollout process's traceback.
"""
from __future__ import annotations

import logging
import pickle
import traceback

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rstarjax.serving.handoff import copy_to_receiver, mesh_of, pair_mesh, specs_of, stage_in_layout

log = logging.getLogger(__name__)

REQUESTS = "rstarjax/rollout_process/requests"  # trainer -> rollout process
REPLIES = "rstarjax/rollout_process/replies"  # rollout process -> trainer
CHUNK_BYTES = 4 << 20  # one key's value at most


def _client():
    from jax._src import distributed  # the coordination service's client (no public handle yet)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("rollouts in another process need jax.distributed (--config.distributed.*)")
    return client


class Mailbox:
    """One direction's messages, in order: ``send(kind, payload)`` here, ``receive`` there.
    A message's chunks are written before its header, so a reader never sees half of one."""

    def __init__(self, name: str, client=None):
        self.name = name
        self.client = client if client is not None else _client()
        self.sent = self.received = 0

    def send(self, kind: str, payload=None) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
        n, self.sent = self.sent, self.sent + 1
        for i, chunk in enumerate(chunks):
            self.client.key_value_set_bytes(f"{self.name}/{n}/{i}", chunk)
        self.client.key_value_set(f"{self.name}/{n}", str(len(chunks)))

    def receive(self, wait_s: float, what: str) -> tuple[str, object]:
        """The next message, waiting at most ``wait_s`` for it (``what``: for the error)."""
        n = self.received
        try:
            count = int(self.client.blocking_key_value_get(f"{self.name}/{n}", int(wait_s * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError(DEADLINE_EXCEEDED)
            if "DEADLINE" not in str(e).upper():
                raise
            raise TimeoutError(f"waited {wait_s:g} s for {what} ({self.name} #{n}): the other process "
                               "died or stopped answering") from None
        data = b"".join(self.client.blocking_key_value_get_bytes(f"{self.name}/{n}/{i}", 60_000)
                        for i in range(count))
        for key in [f"{self.name}/{n}/{i}" for i in range(count)] + [f"{self.name}/{n}"]:
            self.client.key_value_delete(key)
        self.received += 1
        return pickle.loads(data)


def _mesh_of(devices: list[int], shape: tuple, axes: tuple) -> Mesh:
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[i] for i in devices], dtype=object).reshape(shape), axes)


def _describe(mesh: Mesh) -> dict:
    return {"devices": [d.id for d in mesh.devices.flat], "shape": mesh.devices.shape, "axes": mesh.axis_names}


class RemoteRollouts:
    """The trainer process's ``RolloutFn`` (``trajectory.RolloutFn``): each call is one round in
    the rollout process; new weights go there with ``update_params``, or ``stage_params`` now
    and ``serve_staged`` between rounds (``rl.max_staleness``), as with colocated engines."""

    def __init__(self, wait_s: float, hello_wait_s: float = 900.0):
        """``wait_s``: the longest one round may take; ``hello_wait_s``: the rollout process's
        start (its model, engine and code pool)."""
        self.wait_s, self.hello_wait_s = float(wait_s), float(hello_wait_s)
        self.requests, self.replies = Mailbox(REQUESTS), Mailbox(REPLIES)
        self._layout = None
        self.closed = False

    @property
    def layout(self) -> dict:
        """What the rollout process serves (its first message, read when first needed: the
        trainer loads its model meanwhile)."""
        if self._layout is None:
            kind, layout = self.replies.receive(self.hello_wait_s, "the rollout process to start")
            if kind == "error":
                raise RuntimeError(f"the rollout process failed to start:\n{layout}")
            self._layout = layout
        return self._layout

    @property
    def slice(self) -> Mesh:
        """The rollout process's serving slice (its devices, in the global device list)."""
        return _mesh_of(**self.layout["mesh"])

    @property
    def serving_dtype(self) -> str:
        return self.layout["serving_dtype"]

    def __call__(self, records, n_per_prompt: int, seed: int, policy_version: int):
        self.requests.send("rollout", (list(records), int(n_per_prompt), int(seed), int(policy_version)))
        kind, out = self.replies.receive(self.wait_s, "a round of rollouts")
        if kind == "error":
            raise RuntimeError(f"the rollout process failed a round:\n{out}")
        return out

    def stage_params(self, model: nnx.Module):
        """The serving copy of ``model`` in the slice's layout, on this process's devices."""
        if not isinstance(model, nnx.Module):
            raise TypeError("RemoteRollouts takes a model (an nnx.Module), not a state")
        graphdef, state = nnx.split(model)
        return stage_in_layout(graphdef, state, self.layout["specs"], self.slice.size,
                               dtype=self.layout["dtype"], untie_head=self.layout["untie_head"])

    def serve_staged(self, staged) -> None:
        """Send ``stage_params``' copy to the rollout process (a collective with it)."""
        sender = jax.tree.leaves(staged)[0].sharding.mesh
        self.requests.send("weights", _describe(sender))
        copy_to_receiver(staged, pair_mesh(sender, self.slice))

    def update_params(self, model: nnx.Module) -> None:
        self.serve_staged(self.stage_params(model))

    def close(self) -> None:
        """Tell the rollout process to stop (once)."""
        if not self.closed:
            self.closed = True
            self.requests.send("stop")


def serve_remote(rollouts, wait_s: float) -> int:
    """The rollout process's loop: answer the trainer process's requests with ``rollouts`` (a
    ``ColocatedRollouts`` over this process's devices, one slice) until it says stop. Returns
    the rounds served. ``wait_s``: the longest to wait for the next request (an update, a
    checkpoint and an evaluation may come between two)."""
    requests, replies = Mailbox(REQUESTS), Mailbox(REPLIES)
    if len(rollouts.engines) != 1:
        replies.send("error", f"a rollout process serves one slice, this one has {len(rollouts.engines)}")
        raise ValueError(f"a rollout process serves one slice over its devices, not {len(rollouts.engines)}: "
                         "set --config.serving.tensor_parallel to 0 or to its device count")
    engine = rollouts.engines[0]
    slice_mesh = mesh_of(engine.layout.target)
    replies.send("hello", {
        "specs": specs_of(engine.layout.target),
        "dtype": engine.layout.dtype.name, "untie_head": engine.layout.untie_head,
        "serving_dtype": rollouts.serving_dtype, "mesh": _describe(slice_mesh)})
    rounds = 0
    while True:
        kind, payload = requests.receive(wait_s, "the trainer process's next request")
        if kind == "stop":
            return rounds
        if kind == "weights":  # between rounds: the next one samples the new policy
            engine.serve(copy_to_receiver(engine.params, pair_mesh(_mesh_of(**payload), slice_mesh)))
            continue
        try:
            out = rollouts(*payload)
        except Exception:  # the trainer raises it; this process stops too
            replies.send("error", traceback.format_exc())
            raise
        replies.send("round", out)
        rounds += 1
