"""megarl: the RL framework (controller, workers, algorithms, rollout, data, rewards, cli)."""
