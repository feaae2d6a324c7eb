"""``klpo train``: the config from files and ``--set`` (a resume's saved one by default), printed
or checked or run, and the trainer's errors as exit codes."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from klpo.cli.common import exits, needs


def train(
    config: list[Path] = typer.Option(
        [],
        "--config",
        "-c",
        metavar="FILE",
        help="YAML config (see configs/ and docs/config.md); built-in defaults if omitted. "
        "Repeatable: the files merge in order, section by section, a later one winning "
        "(e.g. -c configs/grpo-lora.yaml -c my-data.yaml).",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override a config key, e.g. --set kl.beta=0.02 or --set optim.lr=1e-6 "
        "(repeatable; the value is YAML).",
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        metavar="RUN_DIR",
        help="Continue the run in this directory from its last checkpoint.",
    ),
    allow_config_change: bool = typer.Option(
        False,
        "--allow-config-change",
        help="With --resume: continue even though the config or the number of processes "
        "changed (recorded in the run's config-changes.jsonl).",
    ),
    print_config: bool = typer.Option(
        False,
        "--print-config",
        help="Print the resolved config (the defaults, then each --config, then --set) as YAML, "
        "each value a file or --set gave followed by a comment naming it, and exit.",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Run every check a run makes before it loads a model or writes a file (config, run "
        "directory, model and tokenizer files, prompts, reward functions), then exit: 0 when "
        "the run would start.",
    ),
) -> None:
    """Train a policy with GRPO, PPO, RLOO or REINFORCE++ (the project's main job), or distil
    a teacher into it on-policy (the teacher section; docs/distillation.md).

    The config has the sections model, data, rewards, gold_reward, rollout, algo, kl, teacher,
    optim, run and dist: every key, its default and meaning is in docs/config.md, and --print-config
    shows them all as this run would use them. A run writes into run.out_dir (default
    runs/train; a new run never reuses a directory that holds another run: give each its own
    with --set run.out_dir=DIR, as `make run` does, or continue one with --resume).

    Under torchrun (`torchrun --nproc_per_node 2 -m klpo train ...`) it runs data-parallel;
    with `--set dist.strategy=fsdp` the models are sharded (docs/real-models.md). Ctrl-C or
    SIGTERM stops it after the current step with a checkpoint. A model or dataset id is
    fetched from the Hugging Face Hub as transformers and datasets fetch it; HF_HUB_OFFLINE=1
    keeps to the local cache.
    """
    needs("train", "klpo train")
    layered = _train_config(config, overrides, resume, allow_config_change)
    if print_config:
        from klpo.train.config_files import annotated_yaml

        typer.echo(annotated_yaml(layered), nl=False)
        return
    if layered.layers and os.environ.get("RANK", "0") == "0":  # the run's first line
        typer.echo(f"config: {layered.order()} (--print-config says which gave each key)", err=True)
    _train_or_check(layered.config, resume is not None, allow_config_change, check)


def _train_config(
    config: list[Path], overrides: list[str], resume: Path | None, allow_config_change: bool
):
    """The config of ``klpo train``'s options (a resume's saved one by default), with each
    key's source (:class:`klpo.train.config_files.Layered`), or exit 2."""
    from klpo.train.config import ConfigError
    from klpo.train.config_files import load_configs
    from klpo.train.preflight import empty_config_warning

    with exits(2, ConfigError):
        if resume is not None:
            saved = resume / "config.yaml"
            if not saved.is_file():
                raise ConfigError(f"--resume {resume}: no config.yaml there, so no run to resume")
            _resume_in_place(resume, overrides)
            layered = load_configs(config or [saved], [*overrides, f"run.out_dir={resume}"])
        else:
            layered = load_configs(config, overrides)
    if allow_config_change and resume is None:
        typer.echo("error: --allow-config-change only applies with --resume DIR", err=True)
        raise typer.Exit(2)
    for path in config:
        empty = empty_config_warning(path)
        if empty and len(config) > 1:  # the other files still count
            empty = f"config file {str(path)!r} is empty: it changes nothing"
        if empty:
            typer.echo(f"warning: {empty}", err=True)
    return layered


def _resume_in_place(resume: Path, overrides: list[str]) -> None:
    """``--resume DIR`` continues DIR where it is: a ``--set run.out_dir=OTHER`` naming another
    directory is refused (it would be ignored, and DIR's checkpoints pruned), with the way to
    branch the run into OTHER."""
    from klpo.train.config import ConfigError

    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() != "run.out_dir":
            continue
        other = Path(value.strip().strip("'\""))
        if other.resolve() != resume.resolve():
            raise ConfigError(
                f"--resume {resume} continues that run in place, so run.out_dir={other} cannot "
                f"apply: drop the --set to continue {resume}; to branch the run into {other}, "
                f"copy it first (cp -r {resume} {other}) and resume the copy (klpo train "
                f"--resume {other})"
            )


def _train_or_check(cfg, resume: bool, allow_config_change: bool, check: bool) -> None:
    """Run the training (or with ``check`` only its checks), its errors as exit codes."""
    from klpo.train.config import ConfigError
    from klpo.train.loop import TrainingDiverged, check_run
    from klpo.train.loop import train as run_training
    from klpo.train.rewards.functions import RewardError
    from klpo.train.runtime.dist import PeerFailed
    from klpo.train.runtime.stop import Interrupted

    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    who = f"rank {rank}: " if rank is not None else ""
    log = lambda msg: typer.echo(msg, err=True)  # noqa: E731
    try:
        if check:
            check_run(cfg, resume=resume, log=log, allow_config_change=allow_config_change)
            typer.echo(
                f"check passed: {cfg.algo.name} for {cfg.run.steps} steps into "
                f"{cfg.run.out_dir} would start",
                err=True,
            )
            return
        run_training(cfg, resume=resume, log=log, allow_config_change=allow_config_change)
    except Interrupted as err:
        typer.echo(f"{who}{err}", err=True)
        raise typer.Exit(err.exit_code) from None
    except TrainingDiverged as err:
        typer.echo(f"{who}diverged: {err}", err=True)
        raise typer.Exit(3) from None
    except PeerFailed as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    except (ConfigError, RewardError, OSError, ValueError) as err:
        typer.echo(f"{who}error: {err}", err=True)
        raise typer.Exit(1) from None
