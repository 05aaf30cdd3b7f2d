"""rstarjax.rl: the algorithm: trajectories, the agent loop, RoC, advantages, the batch, losses,
the trainer core and one RL step (docs/design.md)."""
