"""The trainer: GRPO and PPO on Hugging Face causal LMs, assembled from the library's functions."""
