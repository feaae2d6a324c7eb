"""The trainer: GRPO, PPO, RLOO and REINFORCE++ on Hugging Face causal LMs, a recipe over rooms
that import downward only (docs/architecture.md); `klpo train` is :func:`klpo.train.loop.train`."""
