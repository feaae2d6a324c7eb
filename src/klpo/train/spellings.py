"""TRL's and verl's names for klpo's config keys and estimators, for "did you mean" in config errors.

:mod:`klpo.train.config` reads these tables when a key or an estimator is unknown; the full
correspondence, with what each option does in each framework, is docs/frameworks.md.
"""

from __future__ import annotations

__all__ = ["FOREIGN_ESTIMATORS", "FOREIGN_KEYS"]

FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    # TRL's GRPOConfig / TrainingArguments names
    "num_generations": ("rollout.group_size", "TRL"),
    "learning_rate": ("optim.lr", "TRL"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL"),
    "max_prompt_length": ("data.max_prompt_tokens", "TRL and verl"),
    "max_steps": ("run.steps", "TRL"),
    "output_dir": ("run.out_dir", "TRL"),
    "save_steps": ("run.save_every", "TRL"),
    "eval_steps": ("run.eval_every", "TRL"),
    "max_grad_norm": ("optim.grad_clip", "TRL"),
    "num_iterations": ("algo.epochs", "TRL"),
    "epsilon": ("algo.clip_low", "TRL"),
    "epsilon_high": ("algo.clip_high", "TRL"),
    "loss_type": ("algo.loss_reduction", "TRL"),
    "lr_scheduler_type": ("optim.lr_scheduler", "TRL"),
    # verl's names
    "n": ("rollout.group_size", "verl (actor_rollout_ref.rollout.n)"),
    "response_length": ("rollout.max_new_tokens", "verl"),
    "max_response_length": ("rollout.max_new_tokens", "verl"),
    "total_training_steps": ("run.steps", "verl"),
    "kl_coef": ("kl.beta", "verl"),
    "kl_loss_coef": ("kl.beta", "verl"),
    "kl_loss_type": ("kl.estimator", "verl"),
    "kl_penalty": ("kl.estimator", "verl"),
    "use_kl_loss": ("kl.placement", "verl"),
    "use_kl_in_reward": ("kl.placement", "verl"),
    "clip_ratio": ("algo.clip_low", "verl"),  # both ends in verl: algo.clip_low and clip_high
    "clip_ratio_low": ("algo.clip_low", "verl"),
    "clip_ratio_high": ("algo.clip_high", "verl"),
    "loss_agg_mode": ("algo.loss_reduction", "verl"),
    "ppo_epochs": ("algo.epochs", "verl"),
    "save_freq": ("run.save_every", "verl"),
    "test_freq": ("run.eval_every", "verl"),
}
"""TRL's and verl's names for klpo's keys (docs/frameworks.md has the full table): an unknown key
of one of these names gets "did you mean" with klpo's, saying whose name it is."""

FOREIGN_ESTIMATORS: dict[str, tuple[str, str]] = {
    "kl": ("k1", "verl's 'kl' is k1"),
    "mse": ("k2", "verl's 'mse' is k2"),
    "kl+": ("k1+", "verl's 'kl+' is k1+"),
    "mse+": ("k2+", "verl's 'mse+' is k2+"),
    "low_var_kl+": (
        "k3+",
        "verl's 'low_var_kl+' is k3+ with its value clamped to [-10, 10]: the same k2 gradient",
    ),
}
"""verl's ``kl_penalty`` / ``kl_loss_type`` spellings klpo names otherwise."""
