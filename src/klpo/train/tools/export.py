"""``klpo export RUN_DIR --out DIR [--merge]``: a run's latest policy as a plain model directory.

What the checkpoint holds decides what is read (:mod:`klpo.train.runtime.checkpoint`):

* a whole model (full fine-tuning, one process or DDP): copied through ``save_pretrained``;
* LoRA adapters (:mod:`klpo.train.models.lora`): with ``merge`` the adapters are folded into the base
  weights, ``W + (alpha / r) · B A``, and the result is a plain transformers model; without it the
  adapter directory is written (load it with ``peft`` over the base model). A run whose
  ``kl.reference_reset`` merged adapters into the base saved that base (``reference.safetensors``)
  and is exported over it; its adapters alone would not fit ``model.policy``, so such a run
  exports with ``merge`` only;
* FSDP shards (:mod:`klpo.train.models.fsdp`): read in one process by ``torch.distributed.checkpoint``
  into the base model's architecture.

The tokenizer is copied beside the weights, so ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` need nothing from klpo.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from klpo._io import atomic_dir
from klpo.train.config import ConfigError, load_config
from klpo.train.models import fsdp
from klpo.train.models.load import load_causal_lm, load_tokenizer, resolve_model_path
from klpo.train.models.lora import is_adapter_dir, load_adapters, load_base_weights
from klpo.train.outdir import claim_dir
from klpo.train.runtime import checkpoint as ckpt_io


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write the run's latest policy to ``out`` (a new or empty directory, written whole or not
    at all); returns ``out``. ``log`` gets a note when ``merge`` has nothing to merge.

    Raises:
        ConfigError: no run, or no checkpoint, in ``run_dir``; ``out`` is not a new or empty
            directory that can be written (:func:`klpo.train.outdir.claim_dir`); a LoRA run
            whose adapters were merged by ``kl.reference_reset``, without ``merge``.
        OSError: the model could not be written (a full disk); nothing is left at ``out``.
    """

    run_dir, out = Path(run_dir), Path(out)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} holds no run (no config.yaml); give a klpo train run_dir")
    ckpt = ckpt_io.latest_checkpoint(run_dir)
    if ckpt is None:
        raise ConfigError(f"{run_dir} has no checkpoint yet; export needs one (run.save_every)")
    claim_dir(out, "export")
    cfg = load_config(saved)
    base = resolve_model_path(cfg.model.policy)
    try:
        model, policy_dir = _read_policy(run_dir, ckpt, cfg, base, merge)
    except Exception:
        if not (ckpt / "policy").is_dir():  # pruned while it was read: said as that
            raise OSError(_vanished(run_dir, ckpt)) from None
        raise
    if merge and not is_adapter_dir(policy_dir) and log is not None:
        log(
            f"note: --merge did nothing: {run_dir} trained all the weights (no LoRA adapters), "
            "so its policy is written as it is"
        )
    tokenizer = load_tokenizer(base)
    try:
        with atomic_dir(out) as tmp:  # built beside out and renamed: never half a model
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    except (OSError, SafetensorError) as err:
        why = "No space left on device" if ckpt_io.disk_full(err) else str(err).splitlines()[0]
        raise OSError(
            f"could not write the model to {out}: {why}; nothing was left there"
        ) from None
    return out


def _vanished(run_dir: Path, ckpt: Path) -> str:
    return (
        f"the checkpoint {ckpt.name} of {run_dir} vanished while export read it: the run is "
        "still training and deleted it after a newer save (run.save_total_limit); run the "
        "export again (it takes the newest checkpoint), or export a run that has finished"
    )


def _read_policy(run_dir: Path, ckpt: Path, cfg, base: str, merge: bool):
    """``(the policy of checkpoint ckpt as a model, its policy directory)``; ``merge`` folds
    LoRA adapters into the weights."""
    policy_dir = ckpt / "policy"
    if is_adapter_dir(policy_dir):
        model = load_adapters(load_causal_lm(base), policy_dir, trainable=False)
        if (ckpt / ckpt_io.REFERENCE).is_file():  # kl.reference_reset: the merged base
            merges = ckpt_io.load_state(ckpt).get("reference_updates", 0)
            if merges and not merge:
                raise ConfigError(
                    f"{run_dir}: kl.reference_reset merged the adapters into the base weights "
                    f"{merges} time(s), so the latest adapters sit on a base that differs from "
                    f"model.policy ({cfg.model.policy}); export with --merge"
                )
            load_base_weights(model, ckpt_io.reference_tensors(ckpt), str(ckpt / ckpt_io.REFERENCE))
        if merge:
            model = model.merge_and_unload()
    elif fsdp.is_sharded_checkpoint(ckpt):
        model = load_causal_lm(base)
        fsdp.load_unsharded(model, policy_dir)
    else:
        model = load_causal_lm(str(policy_dir))
    return model, policy_dir
