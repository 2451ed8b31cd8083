"""The update: the training engine and its strategies, the typed rollout batch, the RL step, critic, LoRA, offload, the tiny model's pretraining."""
