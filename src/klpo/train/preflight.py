"""Checks that run before a training run loads a model or writes a file.

Every check here either passes, or raises :class:`~klpo.train.config.ConfigError` with one
paragraph that names the key, file, line or value and says how to fix it; the CLI prints it and
exits non-zero. A run that would fail late (a prompt too long on line 9,000, an output directory
that cannot be written, a resume onto a changed config) fails here instead, before the minutes of
loading, and before anything already on disk is touched.

What each function guards:

- :func:`klpo.train.resume.plan_run_dir` (the resume plan, a module of its own): the rule of
  output directories (:mod:`klpo.train.outdir`: a fresh run only into a new or empty directory,
  never over another run or anyone's files), a resume onto a changed config or world size
  (refused unless the change is allowed and recorded), the newest complete checkpoint when later
  ones are truncated;
- :func:`config_warnings`: settings that are accepted but ignored or adjusted;
- :func:`check_model_sources`: a model directory that is missing, not a model, has truncated
  weights or no tokenizer; a model id not in the local cache while the Hub is offline, or that
  the Hub does not answer for;
- :func:`check_tokenizers_and_prompts`: a reference (or critic) that tokenizes differently from
  the policy (:func:`check_same_tokenizer`); a bad ``rollout.stop``; chat prompts the template
  cannot render; and every prompt, as the policy will see it, against ``data.max_prompt_tokens``
  and the model's positions and for a doubled BOS, naming ``file:line`` (:func:`check_prompts`).

:func:`preflight` runs them in order, with the checks of the models' configs against each other
(:func:`check_models`) between the last two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from klpo.train.algorithms import ALGORITHMS
from klpo.train.config import ConfigError, TrainConfig
from klpo.train.data.load import load_examples
from klpo.train.data.sources import Example, render_chat
from klpo.train.lr_schedule import check_lr_schedule
from klpo.train.models import gguf
from klpo.train.models.describe import config_lines
from klpo.train.models.fsdp import is_sharded_checkpoint
from klpo.train.models.load import (
    load_tokenizer,
    model_source_problem,
    quiet_transformers,
    resolve_model_path,
)
from klpo.train.models.tokens import Codec, check_single_bos, run_codec
from klpo.train.outdir import check_writable_dir as check_writable_dir  # (it lived here)
from klpo.train.resume import RunPlan, plan_run_dir
from klpo.train.rewards.functions import ANSWER_PROBLEMS
from klpo.train.rewards.gold import eval_reward
from klpo.train.rollout.engines import check_engine
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.dist import Dist

# ---------------------------------------------------------------------------------------------
# Settings that are accepted but ignored or adjusted.


def config_warnings(cfg: TrainConfig, world: int = 1) -> list[str]:
    """One line per setting that has no effect, or is adjusted, in this config."""
    out = []
    k, d, a, r = cfg.kl, cfg.data, cfg.algo, cfg.rollout
    defaults = TrainConfig()
    if k.placement == "none" and k.beta != 0:
        out.append(f"kl.beta={k.beta:g} is ignored: kl.placement is none (no KL term anywhere)")
    if k.placement == "none" and k.controller != "fixed":
        out.append(f"kl.controller={k.controller} is ignored: kl.placement is none")
    if d.source == "builtin":
        ignored = [
            f"data.{key}"
            for key in ("path", "eval_path", "eval_split", "prompt_field", "answer_field")
            if getattr(d, key) != getattr(defaults.data, key)
        ]
        if ignored:
            out.append(
                f"{', '.join(ignored)} ignored: data.source is builtin (the arithmetic task); "
                "set data.source=jsonl or datasets to read your data"
            )
    if d.source == "jsonl" and d.eval_split is not None:
        out.append("data.eval_split is ignored: data.source is jsonl (use data.eval_path)")
    if d.source == "datasets" and d.eval_path is not None:
        out.append("data.eval_path is ignored: data.source is datasets (use data.eval_split)")
    n_seq = r.prompts_per_step * r.group_size // max(1, world)
    if a.minibatches > n_seq:
        out.append(
            f"algo.minibatches={a.minibatches} is more than the {n_seq} sequences each process "
            f"has per step; it acts as {n_seq} (one sequence per optimizer step)"
        )
    size = -(-n_seq // min(a.minibatches, n_seq))
    if a.micro_batch > size:
        out.append(
            f"algo.micro_batch={a.micro_batch} is more than a minibatch ({size} sequences); "
            "each minibatch is one micro-batch"
        )
    g = r.group_size
    shared = r.share_prompt and not cfg.model.gradient_checkpointing and a.packing == "off"
    if shared and g > 1 and a.micro_batch % g:
        acts = max(g, a.micro_batch - a.micro_batch % g)
        out.append(
            f"algo.micro_batch={a.micro_batch} acts as {acts}: with rollout.share_prompt a "
            f"micro-batch holds whole groups of rollout.group_size={g} (each prompt computed "
            "once, as the scoring passes compute it, so that step 1 stays exact); set "
            "rollout.share_prompt=false for smaller passes"
        )
    if not ALGORITHMS[a.name].critic:
        critic_only = [
            key
            for key in ("vf_coef", "value_clip", "lam")
            if getattr(a, key) != getattr(defaults.algo, key)
        ]
        if cfg.model.critic is not None:
            critic_only.insert(0, "model.critic")
        if critic_only:
            names = [n.upper() for n, spec in ALGORITHMS.items() if spec.critic]
            have = " and ".join(names) + (" has" if len(names) == 1 else " have")
            out.append(
                f"{', '.join(critic_only)} ignored: only {have} a critic (algo.name is {a.name})"
            )
    return out


def bf16_warning(cfg: TrainConfig, *, cuda: bool | None = None) -> str | None:
    """A line when ``model.dtype: bfloat16`` trains on a CPU without bf16 units: there every
    autocast matmul is emulated: a SmolLM2-135M LoRA step took 9x as long as in float32 (28x with
    gradient checkpointing; docs/real-models.md, "Precision"). None on a GPU, with bf16 units, or
    where the CPU's flags cannot be read."""
    import torch

    from klpo.gemm import cpu_has_bf16_units, cpu_model_and_flags

    if cfg.model.dtype != "bfloat16":
        return None
    if cuda if cuda is not None else torch.cuda.is_available():
        return None
    if cpu_has_bf16_units() is not False:
        return None
    model, _ = cpu_model_and_flags()
    return (
        f"model.dtype=bfloat16 on a CPU without bf16 units ({model}: no avx512_bf16 or "
        "amx_bf16): its matmuls are emulated, and a SmolLM2-135M LoRA step took 9x as long as in "
        "float32 (28x with gradient checkpointing; docs/real-models.md); set model.dtype=float32 "
        "unless the memory matters more"
    )


def empty_config_warning(path: str | Path | None) -> str | None:
    """A line when the YAML file ``path`` holds nothing, so every value is the default."""
    if path is None:
        return None
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # load_config reports these
    if data is None or data == {}:
        return f"config file {str(path)!r} is empty: every setting is the built-in default"
    return None


# ---------------------------------------------------------------------------------------------
# Data against the model.


def check_answers(cfg: TrainConfig, train: list[Example], heldout: list[Example]) -> None:
    """Every example's answer can be scored by the built-in rewards that read it
    (:data:`klpo.train.rewards.functions.ANSWER_PROBLEMS`): the training examples by
    ``rewards`` and ``gold_reward``, the held-out ones by the reward held-out accuracy uses.
    Raises ConfigError naming the first bad example (``file:line``), the reward and how many
    others fail too."""
    trained = [t.name for t in cfg.rewards] + ([cfg.gold_reward] if cfg.gold_reward else [])
    for examples, names in ((train, trained), (heldout, [eval_reward(cfg)])):
        lacking = [e for e in examples if e.answer is None]
        needs = [n for n in dict.fromkeys(names) if reads_answers(n)]
        if lacking and needs:
            e, more = lacking[0], len(lacking) - 1
            held = " (held-out accuracy is scored with it)" if examples is heldout else ""
            if _is_null(e, cfg.data.answer_field):  # str(None) would be the answer text "None"
                raise ConfigError(
                    f"{e.where or 'an example'}: field {cfg.data.answer_field!r} is null"
                    f"{f'; {more} more lack an answer' if more else ''}, and the reward "
                    f"{needs[0]!r} reads each example's answer{held}; give the example its "
                    "answer (a string or a number), or drop it"
                )
            raise ConfigError(
                f"{e.where or 'an example'}: missing field {cfg.data.answer_field!r} (fields "
                f"present: {', '.join(map(str, e.columns))}){f'; {more} more lack it' if more else ''}"
                f", and the reward {needs[0]!r} reads each example's answer{held}; set "
                "data.answer_field to the field that holds it (a dotted path such as "
                "reward_model.ground_truth reaches into a nested record), or use rewards that "
                "read the data's columns by name (TRL's form, docs/rewards.md)"
            )
        for name in dict.fromkeys(n for n in names if n in ANSWER_PROBLEMS):
            problem = ANSWER_PROBLEMS[name]
            bad = [(e, why) for e in examples if (why := problem(e.answer)) is not None]
            if not bad:
                continue
            (e, why), more = bad[0], len(bad) - 1
            others = f" ({more} more examples have the same problem)" if more else ""
            raise ConfigError(
                f"{e.where or 'an example'}: {why} by the reward {name!r}{others}; give every "
                f"example a real answer ({cfg.data.answer_field!r}), or drop these examples"
            )


def _is_null(example: Example, name: str) -> bool:
    """Whether the data row holds field ``name`` with a null value (not: lacks it)."""
    from klpo.train.data.sources import field_value

    try:
        return field_value(example.columns, name) is None
    except KeyError:
        return False


def reads_answers(name: str) -> bool:
    """Whether the reward ``name`` reads each example's answer: a built-in that scores against
    it, or any function of klpo's three-list form (``fn(prompts, completions, answers)``); a
    TRL-form function reads the data's columns by name instead, and ``model`` none."""
    from klpo.train.rewards import functions as rewards

    if name == "model" or name == "format":
        return False
    if name in rewards.BUILTIN:
        return True
    try:
        (r,) = rewards.resolve_rewards([name])
        return rewards.reward_form(r.fn, name) == "klpo"
    except ValueError:  # an unknown name is check_rewards_and_trackers' error
        return False


def check_prompts(
    examples: list,
    codec: Codec,
    *,
    max_prompt_tokens: int,
    max_positions: int | None,
    max_new_tokens: int,
    what: str = "prompt",
) -> tuple[int, str] | None:
    """Every prompt, tokenized as the policy will see it (``codec``: the run's rule for special
    tokens), begins with at most one BOS (:func:`klpo.train.models.tokens.check_single_bos`)
    and fits ``data.max_prompt_tokens`` and, with its completion, the model.

    Raises ConfigError naming the first prompt that does not (``file:line`` for JSONL,
    ``name[i]`` for datasets, the index for the built-in task) and how many others fail too.
    Returns the longest prompt's length in tokens and where it is (None without examples).
    """
    if not examples:
        return None
    ids = codec.ids([e.prompt for e in examples])
    for i, row in enumerate(ids):
        where = getattr(examples[i], "where", "") or f"{what} {i}"
        check_single_bos(codec, row, where, examples[i].prompt)
    lengths = [len(row) for row in ids]
    limit, key = max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"
    if max_positions is not None and max_positions - max_new_tokens < limit:
        limit = max_positions - max_new_tokens
        key = f"the model's {max_positions} positions less rollout.max_new_tokens={max_new_tokens}"
    bad = [i for i, n in enumerate(lengths) if n > limit]
    if not bad:
        i = max(range(len(lengths)), key=lengths.__getitem__)
        return lengths[i], getattr(examples[i], "where", "") or f"{what} {i}"
    i = bad[0]
    where = getattr(examples[i], "where", "") or f"{what} {i}"
    more = f" ({len(bad) - 1} more prompts are too long too)" if len(bad) > 1 else ""
    fix = (
        "raise data.max_prompt_tokens, or shorten or drop these prompts"
        if key.startswith("data.")
        else "lower rollout.max_new_tokens, or shorten or drop these prompts (the model "
        "cannot attend further)"
    )
    raise ConfigError(
        f"{where}: the prompt is {lengths[i]} tokens long, more than {key} allows "
        f"({limit}){more}: {examples[i].prompt[:60]!r}; {fix}"
    )


def check_same_tokenizer(policy_tok: Any, policy: str, other_tok: Any, other: str, role: str):
    """Raise ConfigError if ``other_tok`` maps any token to another id than ``policy_tok``.

    The KL to the reference compares the two models' probabilities token id by token id; with
    different vocabularies the ids name different strings and the KL is meaningless, even when
    the sizes agree.
    """
    a, b = policy_tok.get_vocab(), other_tok.get_vocab()
    if a == b:
        return
    differ = sorted(
        (t for t in set(a) | set(b) if a.get(t) != b.get(t)), key=lambda t: a.get(t, -1)
    )
    token = differ[0]
    if role == "model":  # teacher.model
        raise ConfigError(
            f"teacher.model {other!r} has another tokenizer than model.policy {policy!r}: "
            f"{len(a)} and {len(b)} tokens, and token {token!r} has id {a.get(token)} in the "
            f"student's but {b.get(token)} in the teacher's ({len(differ)} tokens differ). The "
            "teacher term compares the two models token id by token id, so the teacher must "
            "share the student's tokenizer; distilling across tokenizers would need the two "
            "vocabularies aligned (GOLD-style, TRL's GOLDTrainer), which klpo does not do. Give "
            "a teacher of the student's family"
        )
    raise ConfigError(
        f"model.{role} {other!r} has another tokenizer than model.policy {policy!r}: "
        f"{len(a)} and {len(b)} tokens, and token {token!r} has id {a.get(token)} in the policy's "
        f"but {b.get(token)} in the {role}'s ({len(differ)} tokens differ). The KL "
        f"compares the models id by id, so they must share the tokenizer; give a {role} trained "
        "with the policy's tokenizer"
    )


def model_keys(cfg: TrainConfig, policy: str, reference: str, critic: str | None) -> dict:
    """``{config key: resolved name}`` of the run's models (a default named by its source)."""
    keys = {"model.policy": policy}
    keys["model.reference" if cfg.model.reference else "model.policy"] = reference
    if critic is not None:
        keys["model.critic" if cfg.model.critic else "model.reference"] = critic
    if cfg.teacher is not None:
        keys["teacher.model"] = resolve_model_path(cfg.teacher.model)
    return keys


def check_model_sources(
    cfg: TrainConfig, *, policy: str, reference: str, critic: str | None
) -> None:
    """Every model is a complete local directory (the policy's with a tokenizer) or a model id
    that can be had (:func:`klpo.train.models.load.model_source_problem`)."""
    for key, name in model_keys(cfg, policy, reference, critic).items():
        problem = model_source_problem(name, key, tokenizer=key == "model.policy")
        if problem:
            raise ConfigError(problem)


def check_tokenizers_and_prompts(
    cfg: TrainConfig,
    train: list,
    heldout: list,
    *,
    policy: str,
    reference: str,
    critic: str | None,
) -> tuple[Codec, list, list]:
    """The reference's and critic's tokenizers equal the policy's (where they have one); the
    run's codec (``data.chat``, the stop set with ``rollout.stop``); the prompts rendered as the
    policy sees them (``data.chat``); each of those begins with one BOS at most and fits
    (:func:`check_prompts`). Run after the models' configs agree on the vocabulary size and
    positions.

    Args:
        cfg: the run's config.
        train, heldout: the examples (:class:`klpo.train.data.sources.Example`).
        policy, reference, critic: resolved model directories or ids (critic None unless PPO).

    Returns:
        ``(codec, train, heldout)``: the codec and the examples with their prompts rendered.
    """
    from transformers import AutoConfig

    tokenizer = load_tokenizer(policy, "model.policy")
    for key, name in model_keys(cfg, policy, reference, critic).items():
        if name != policy and model_source_problem(name, key, tokenizer=True) is None:
            other = load_tokenizer(name, key)
            check_same_tokenizer(tokenizer, policy, other, name, key.split(".")[-1])
    codec = run_codec(cfg, tokenizer, policy)
    d = cfg.data
    try:
        train, heldout = (
            render_chat(x, tokenizer, chat=d.chat, system_prompt=d.system_prompt,
                        template_kwargs=d.chat_template_kwargs)
            for x in (train, heldout)
        )  # fmt: skip
    except ValueError as err:
        raise ConfigError(str(err)) from None
    config = AutoConfig.from_pretrained(policy)
    positions = getattr(config, "max_position_embeddings", None)
    for examples, what in ((train, "training prompt"), (heldout, "held-out prompt")):
        longest = check_prompts(
            examples,
            codec,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            max_positions=positions,
            max_new_tokens=cfg.rollout.max_new_tokens,
            what=what,
        )
        if examples is train and longest is not None:
            check_token_budget(cfg, *longest)

    return codec, train, heldout


def check_token_budget(cfg: TrainConfig, longest: int, where: str) -> None:
    """``algo.micro_batch_tokens`` holds at least one sequence of the longest training prompt
    (``longest`` tokens, at ``where``) and ``rollout.max_new_tokens`` completion tokens: a
    sequence is never split across passes, so a smaller budget would be exceeded, silently
    (:func:`klpo.train.step.microbatch.rows_per_micro_batch`)."""
    budget, new = cfg.algo.micro_batch_tokens, cfg.rollout.max_new_tokens
    if budget and budget < longest + new:
        raise ConfigError(
            f"algo.micro_batch_tokens={budget} is smaller than one sequence: the longest "
            f"training prompt ({where}, {longest} tokens) and rollout.max_new_tokens={new} make "
            f"rows of up to {longest + new} tokens, and a sequence is never split across "
            f"passes, so a pass would hold more than the budget. Set algo.micro_batch_tokens to "
            f"at least {longest + new}, or 0 (no token budget)"
        )


def check_fsdp_device(cfg: TrainConfig, dist: Dist) -> None:
    """Refuse ``dist.strategy=fsdp`` on CPU with a torch whose CPU streams cannot record events:
    FSDP2's all-gather records one on its stream, which fails inside the first forward on CPU
    with torch 2.6, klpo's floor (CPU streams gained it in pytorch/pytorch#145935;
    docs/install.md). Checked by the feature, not the version; CUDA streams always had it."""
    import torch

    sharded_cpu = dist.enabled and cfg.dist.strategy == "fsdp" and dist.device.type == "cpu"
    if sharded_cpu and not hasattr(torch.cpu.Stream, "record_event"):
        raise ConfigError(
            f"dist.strategy=fsdp on CPU needs a torch whose CPU streams record events (FSDP2's "
            f"all-gather does; they gained it after torch 2.6), and this is torch "
            f"{torch.__version__}: install a newer torch in this environment, or set "
            "dist.strategy=ddp"
        )


def preflight(
    cfg: TrainConfig, dist: Dist, *, resume: bool, log=print, allow_config_change: bool = False
) -> tuple[RunPlan, tuple[list[Example], list[Example]]]:
    """Check the config against the launch, the run directory, the models and the data; returns
    where the run starts (:func:`plan_run_dir`) and the (train, held-out) examples, their prompts
    rendered as the policy sees them (``data.chat``). Reads only small files (model configs,
    tokenizers, checkpoint headers) and the data; raises :class:`ConfigError` naming the key,
    file or line and the fix. Its last lines say how prompts are tokenized and print the stop
    set by token and id."""
    ro = cfg.rollout
    if ro.prompts_per_step % dist.world:
        raise ConfigError(
            f"rollout.prompts_per_step={ro.prompts_per_step} must be divisible by the number of "
            f"processes ({dist.world}): each process samples whole groups of an equal share"
        )
    if ro.dynamic_sampling and dist.world > 1:
        raise ConfigError(
            f"rollout.dynamic_sampling runs in one process only (each of the {dist.world} "
            "processes would keep a different number of groups, and the ranks' shares would no "
            "longer be equal); launch one process, or set rollout.dynamic_sampling=false"
        )
    start = ckpt_io.latest_checkpoint(cfg.run.out_dir) if resume else None
    sharded_run = dist.enabled and cfg.dist.strategy == "fsdp"
    if start is not None and is_sharded_checkpoint(start) and not sharded_run:
        raise ConfigError(
            f"{start} holds sharded weights (dist.strategy=fsdp); resume it under torchrun "
            "with dist.strategy=fsdp, or klpo export it to a plain model"
        )
    if cfg.dist.strategy == "fsdp" and not dist.enabled:
        raise ConfigError(
            "dist.strategy=fsdp shards the models over torchrun's processes, but this run is "
            "one process, so nothing would be sharded; launch it with torchrun --nproc_per_node "
            "N -m klpo train (N >= 2), or set dist.strategy=ddp for one process"
        )
    check_fsdp_device(cfg, dist)
    schedule_warnings = check_lr_schedule(cfg)  # its kwargs, and whether any step trains
    check_eval_cache(cfg.run.eval_cache)
    plan = plan_run_dir(
        cfg, resume=resume, world=dist.world, allow_config_change=allow_config_change
    )
    train_set, heldout = load_examples(cfg)
    check_rewards_and_trackers(cfg, train_set + heldout)
    check_answers(cfg, train_set, heldout)
    resolve_gguf_sources(cfg, log)
    policy = resolve_model_path(cfg.model.policy)
    reference = resolve_model_path(cfg.model.reference or cfg.model.policy)
    critic = resolve_model_path(cfg.model.critic or reference)
    names = dict(
        policy=policy,
        reference=reference,
        critic=critic if ALGORITHMS[cfg.algo.name].critic else None,
    )
    check_model_sources(cfg, **names)
    real_notes = real_model_defaults(cfg, _model_config("model.policy", cfg.model.policy))
    check_models(cfg)
    check_engine(cfg, dist.world)
    codec, train_set, heldout = check_tokenizers_and_prompts(cfg, train_set, heldout, **names)
    log(f"run directory: {cfg.run.out_dir}")
    for line in config_lines(cfg):  # what it trains and how (klpo.train.models.describe)
        log(line)
    few = few_prompts_note(cfg, train_set)
    for line in [*real_notes, *plan.notes, *([few] if few else [])]:
        log(f"note: {line}")
    bf16 = bf16_warning(cfg)
    for line in [*config_warnings(cfg, dist.world), *schedule_warnings, *([bf16] if bf16 else [])]:
        log(f"warning: {line}")
    for line in codec.describe(train_set[0].prompt if train_set else None):
        log(line)
    return plan, (train_set, heldout)


def few_prompts_note(cfg: TrainConfig, train_set: list[Example]) -> str | None:
    """The start line's note where the training set holds fewer distinct prompts than one step
    samples (``rollout.prompts_per_step``), or one prompt at all: every step then trains copies
    of the same prompts (the stream cycles over the data, :class:`PromptStream`), which a
    one-row file gives without a word otherwise. None where the data has enough."""
    distinct = len({e.prompt for e in train_set})
    p, g = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    if not train_set or (distinct >= p and distinct > 1):
        return None
    shown = train_set[0].prompt.strip().replace("\n", " ")
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    what = f"one distinct prompt ({shown!r})" if distinct == 1 else f"{distinct} distinct prompts"
    rows = f"{len(train_set)} row" + ("s" if len(train_set) != 1 else "")
    return (
        f"the training data holds {what} in {rows}, and each step samples "
        f"rollout.prompts_per_step={p} prompts ({g} completions each): every step trains copies "
        f"of {'it' if distinct == 1 else 'them'}. If that is not meant, give more rows "
        "(data.path) or fewer rollout.prompts_per_step"
    )


def check_eval_cache(path: str | None) -> None:
    """``run.eval_cache`` names a directory (made on first use), not a file."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"run.eval_cache={path!r} is a file, not a directory: the cache keeps one file per "
            "evaluation in it; give a directory (made if missing), e.g. run.eval_cache=runs/eval-cache"
        )
    parent = next((q for q in p.parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(
            f"run.eval_cache={path!r}: {parent} is a file, so no directory can be made under it; "
            "give a directory path"
        )


REAL_MODEL_PARAMETERS = 10_000_000
"""A policy with at least this many parameters is a real model (the shipped one has 1M)."""

REAL_MODEL_LR = {"full": 1e-5, "lora": 3e-4}
"""``optim.lr`` for a real model, measured (docs/real-models.md): 1e-5 for a full fine-tune, 3e-4
for LoRA adapters (1e-3 collapsed SmolLM2's held-out accuracy to 0 in 24 steps)."""

REAL_MODEL_MAX_NEW_TOKENS = 64
"""``rollout.max_new_tokens`` for a real model: room for a sentence (the built-in toy's 4 cut every
answer of a model that writes one)."""


def count_parameters(config: Any) -> int | None:
    """The parameters of the causal LM ``config`` describes (shared tensors once), counted on the
    meta device: no memory, no weights read; None where transformers cannot build it."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an architecture transformers cannot build without its weights' code
        return None
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())


def real_model_defaults(cfg: TrainConfig, config: Any) -> list[str]:
    """Give a real policy (:data:`REAL_MODEL_PARAMETERS` or more) the real model's defaults for
    the keys the config leaves at the built-in toy's: ``optim.lr`` (:data:`REAL_MODEL_LR`) and
    ``rollout.max_new_tokens`` (:data:`REAL_MODEL_MAX_NEW_TOKENS`). A key the config gives (a
    file, ``--set``, a resumed run's saved config) is kept. Returns the notes that say so."""
    if cfg.model.policy == "builtin" or config is None:
        return []
    n = count_parameters(config)
    if n is None or n < REAL_MODEL_PARAMETERS:
        return []
    notes = []
    if "lr" not in cfg.optim.model_fields_set:
        kind = "lora" if cfg.model.lora is not None else "full"
        lr = REAL_MODEL_LR[kind]
        toy = cfg.optim.lr
        cfg.optim.lr = lr
        what = "LoRA adapters" if kind == "lora" else "a full fine-tune"
        notes.append(
            f"optim.lr {lr:g} for a real model ({n / 1e6:.0f}M parameters; {what}), not the "
            f"built-in toy's {toy:g}, which moved SmolLM2-135M 0.92 nats per token in one full "
            "step (docs/real-models.md); set optim.lr to choose"
        )
    positions = getattr(config, "max_position_embeddings", None) or 4 * REAL_MODEL_MAX_NEW_TOKENS
    new = min(REAL_MODEL_MAX_NEW_TOKENS, max(1, positions // 4))  # room for the prompt
    if "max_new_tokens" not in cfg.rollout.model_fields_set and new > cfg.rollout.max_new_tokens:
        toy = cfg.rollout.max_new_tokens
        cfg.rollout.max_new_tokens = new
        notes.append(
            f"rollout.max_new_tokens {new} for a real model, not the built-in toy's {toy}; "
            "set it to choose"
        )
    return notes


def resolve_gguf_sources(cfg: TrainConfig, log=print) -> None:
    """Every model key that names a ``.gguf`` file (``model.policy``, ``model.reference``,
    ``model.critic``, a reward model's ``path``) resolved to its float32 image in klpo's cache
    (:func:`klpo.train.models.gguf.resolve_gguf`: made once, here, before any check reads a
    tokenizer or a model config), with one line each saying the weights are a float image of a
    quantised file. Later resolves of the same file in this process are instant."""
    keys = {"model.policy": cfg.model.policy, "model.reference": cfg.model.reference}
    if ALGORITHMS[cfg.algo.name].critic:
        keys["model.critic"] = cfg.model.critic
    if cfg.teacher is not None:
        keys["teacher.model"] = cfg.teacher.model
    for i, term in enumerate(cfg.rewards):
        if term.name == "model":
            keys[f"rewards[{i}].path"] = term.path
    seen: set[str] = set()
    for key, name in keys.items():
        if not name or not gguf.is_gguf_path(name):
            continue
        try:
            image = gguf.resolve_gguf(name, key=key, log=log)
        except gguf.GGUFError as err:
            raise ConfigError(f"{key}: {err}") from None
        if image.sha256 not in seen:
            log(image.describe(key))
            seen.add(image.sha256)


def check_rewards_and_trackers(cfg: TrainConfig, examples: list[Example]) -> None:
    """Every reward function of ``rewards`` imports and takes one of the two forms, a TRL-form
    one finds each argument it requires among the data's columns
    (:func:`klpo.train.rewards.functions.missing_keywords`), and every tracker of
    ``run.report_to`` is installed."""
    from klpo.train.rewards import functions as rewards
    from klpo.train.runtime.trackers import check_trackers

    columns = list(dict.fromkeys(k for e in examples for k in e.columns))
    for i, term in enumerate(cfg.rewards):
        if term.name == "model":
            continue
        try:
            (r,) = rewards.resolve_rewards([term.name])
        except ValueError as err:
            raise ConfigError(f"rewards[{i}]: {err}") from None
        clash = [c for c in columns if c in rewards.KEYWORDS and c not in ("completion_ids",)]
        if clash and rewards.reward_form(r.fn, term.name) == "trl":
            e = next(e for e in examples if clash[0] in e.columns)
            raise ConfigError(
                f"{e.where or 'the data'}: the data has a column {clash[0]!r}, the name of an "
                f"argument the trainer gives every TRL-form reward function such as rewards[{i}] "
                f"{term.name!r} ({', '.join(rewards.KEYWORDS)}); rename that column"
            )
        missing = rewards.missing_keywords(r.fn, [*columns, *rewards.KEYWORDS])
        if missing:
            raise ConfigError(
                f"rewards[{i}] {term.name!r} requires the argument {missing[0]!r}, which is "
                f"neither a column of the data ({', '.join(columns)}) nor one of "
                f"{', '.join(rewards.KEYWORDS)}; add the column, or give it a default"
            )
    try:
        check_trackers(cfg.run.report_to)
    except ImportError as err:
        raise ConfigError(str(err)) from None


def _model_config(key: str, name: str):
    from transformers import AutoConfig

    quiet_transformers()
    path = resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{key}={name!r}: no model config could be read ({err}). Give a local directory "
            "written by save_pretrained, or builtin for the shipped arithmetic model."
        ) from None


# The models that must share the policy's vocabulary, checked in this order: (key, what
# compares them with the policy, the fix).
_SAME_VOCABULARY = (
    (
        "teacher.model",
        "the teacher term",
        "the teacher must share the student's tokenizer (distilling across tokenizers would need "
        "the vocabularies aligned, GOLD-style, which klpo does not do)",
    ),
    (
        "model.reference",
        "the KL",
        "the reference must share the policy's tokenizer (leave model.reference unset to use the "
        "policy's starting point)",
    ),
)


def check_models(cfg: TrainConfig) -> None:
    """The models against each other and the config, from their config files alone: the policy
    and the reference share a vocabulary (the KL compares them token by token), and a
    completion fits in every model's positions."""
    mc = cfg.model
    configs = {"model.policy": (mc.policy, _model_config("model.policy", mc.policy))}
    ref = mc.reference or mc.policy
    configs["model.reference"] = (ref, _model_config("model.reference", ref))
    if ALGORITHMS[cfg.algo.name].critic:
        critic = mc.critic or ref
        configs["model.critic"] = (critic, _model_config("model.critic", critic))
    if cfg.teacher is not None:
        configs["teacher.model"] = (
            cfg.teacher.model,
            _model_config("teacher.model", cfg.teacher.model),
        )
    p_name, p_cfg = configs["model.policy"]
    p_vocab = getattr(p_cfg, "vocab_size", None)
    for key, what, fix in _SAME_VOCABULARY:
        if key not in configs:
            continue
        name, other = configs[key]
        vocab = getattr(other, "vocab_size", None)
        if vocab is not None and p_vocab is not None and vocab != p_vocab:
            raise ConfigError(
                f"{key}={name!r} has a vocabulary of {vocab} tokens but model.policy={p_name!r} "
                f"has {p_vocab}: {what} compares the two token by token, so {fix}"
            )
    new = cfg.rollout.max_new_tokens
    for key, (name, c) in configs.items():
        positions = getattr(c, "max_position_embeddings", None)
        if positions is not None and new >= positions:
            raise ConfigError(
                f"rollout.max_new_tokens={new} leaves no room for a prompt in {key}={name!r}, "
                f"which has {positions} positions (max_position_embeddings); lower "
                "rollout.max_new_tokens"
            )
