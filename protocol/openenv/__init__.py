"""OpenEnv, as Kiln speaks it: the environment server's wire protocol (env.py) and the rollout
record — how episodes are played, written, verified offline and replayed live (rollout.py).
Here, below both, because the CLI (`kiln openenv rollout`) and the evaluator worker (runs the
daemon owns, `/v1/openenv/runs`) play the same episodes into the same record."""
