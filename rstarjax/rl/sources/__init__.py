"""Where an RL step's rollouts come from: one ``RolloutSource`` per rollout mode (``base``),
each in its own file (``synchronous``, ``partial``, ``asynchronous``), over either transport
(in-process engines, ``agent_loop.ColocatedRollouts``; rollout processes, ``remote.RemoteRollouts``).
``recipes.sources.make_source`` picks one from the config; the stage loop (``recipes.rl``) asks
only the protocol."""
from rstarjax.rl.sources.base import PausableRollouts, RolloutSource, StagedRollouts, StepRound

__all__ = ["PausableRollouts", "RolloutSource", "StagedRollouts", "StepRound"]
