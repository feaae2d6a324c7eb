"""The measurement itself: sample, sketch each group's gradients, compare with the exact KLs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpo.measure.errors import MeasureError
from klpo.measure.intervals import gradient_rows
from klpo.measure.memory import (
    OVERHEAD,
    _gb,
    available_bytes,
    memory_estimate,
    page_in,
    peak_rss,
    resident_bytes,
)
from klpo.measure.models import _load_pair, same_weights
from klpo.measure.objectives import ESTIMATORS, _value_stats, objective_names
from klpo.measure.prompts import _prompt_codec, read_prompts, render_prompts
from klpo.measure.sketch import (
    _LAYER,
    SKETCH,
    Sketch,
    Subset,
    choose_subset,
    group_vectors,
    prompt_caches,
    prompt_free,
    rounding_floor,
)


def _say(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


def measure(
    model: str,
    reference: str,
    data: str,
    *,
    layer: str | None = None,
    sketch: int = SKETCH,
    prompts: int = 8,
    samples: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    chat: bool = False,
    system_prompt: str | None = None,
    highlight: list[tuple[str, str]] | None = None,
    say: Any = _say,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Sample on the user's prompts and measure every estimator against the exact KL (module doc).

    ``say`` gets the lines printed before the work (the parameters measured, the memory
    estimate); the progress bar (:class:`klpo.train.runtime.progress.Progress`) goes to stderr.

    Raises:
        MeasureError: bad options, unloadable models, different vocabularies, or a memory
            estimate beyond the memory available (with the options that lower it).
    """
    _check_options(prompts, samples, max_new_tokens, sketch)
    texts = read_prompts(data, prompts)
    if not chat:  # a conversation needs --chat: said before any model loads
        render_prompts(None, texts, chat=False)
    free = available_bytes()
    policy, ref, tok = _load_pair(model, reference, free)
    rendered = render_prompts(tok, texts, chat=chat, system_prompt=system_prompt)
    codec = _prompt_codec(tok, policy, rendered, data, chat=chat)  # (bad prompts refused first)
    if same_weights(policy, ref):  # every KL, value and gradient is exactly 0: said, not measured
        return _identical(model, reference, data, seed, chat)
    subset = choose_subset(policy, layer)
    sk = Sketch(subset.modules, sketch, seed)
    run = _Run(policy, ref, tok, rendered, codec, subset, sk, samples, max_new_tokens)
    page_in(policy, ref)  # (before the estimate reads the process's resident memory)
    est = _memory_plan(run, free, sketch, chat, say)
    rollout, vectors, cat, sizes = _sample_and_sketch(run, seed, show_progress)
    mask = rollout.mask
    values = {n: cat[f"value:{n}"] for n in ESTIMATORS}
    peak = peak_rss()
    return {
        **_about(model, reference, data, seed, chat),
        "sequences": int(mask.shape[0]),
        "groups": samples,
        "tokens": int(mask.sum()),
        "exact": _exact_means(cat, mask),
        "values": _value_stats(values, cat["exact"], cat["exact_rev"], mask),
        "gradients": {
            "subset": subset.description,
            "modules": subset.names,
            "parameters": subset.numel,
            "sketch": sketch,
            "dim": sk.dim,
            "rows": gradient_rows(vectors, run.rows),
        },
        "memory": {
            "estimate": est,
            "measured": {
                "weights": run.weights,
                "store": vectors.nbytes + sizes.get("group_vectors", 0),
                "logits": sizes.get("logits", 0),
                "peak_rss": peak,
            },
        },
        "highlight": [list(h) for h in (highlight or [])],
    }


def _about(model: str, reference: str, data: str, seed: int, chat: bool) -> dict[str, Any]:
    """What a measurement is of: its models, data, seed and whether the prompts are chat."""
    return {"model": model, "reference": reference, "data": data, "seed": seed, "chat": chat}


def _identical(model: str, reference: str, data: str, seed: int, chat: bool) -> dict[str, Any]:
    """The result for a pair with the same weights (:func:`~klpo.measure.models.same_weights`):
    pi_theta = pi_ref at every prefix, so every exact KL is 0, every estimator's value is 0 at
    every token (log pi_theta(y) = log pi_ref(y)) and every gradient is 0: nothing to measure."""
    return {
        **_about(model, reference, data, seed, chat),
        "identical": True,
        "exact": {
            "token_mean_kl_theta_ref": 0.0,
            "token_mean_kl_ref_theta": 0.0,
            "sequence_mean_kl_theta_ref": 0.0,
        },
    }


def _exact_means(cat: dict[str, Tensor], mask: Tensor) -> dict[str, float]:
    """The exact KLs of the sample: per token both ways, and per sequence."""
    return {
        "token_mean_kl_theta_ref": float(cat["exact"][mask].mean()),
        "token_mean_kl_ref_theta": float(cat["exact_rev"][mask].mean()),
        "sequence_mean_kl_theta_ref": float(torch.where(mask, cat["exact"], 0.0).sum(-1).mean()),
    }


def _check_options(prompts: int, samples: int, max_new_tokens: int, sketch: int) -> None:
    for flag, value, least in (
        ("--prompts", prompts, 1),
        ("--samples", samples, 3),
        ("--max-new-tokens", max_new_tokens, 1),
        ("--sketch", sketch, 0),
    ):
        if value < least:
            why = " (the intervals need three groups of completions)" if flag == "--samples" else ""
            raise MeasureError(f"{flag} must be at least {least}, got {value}{why}")


@dataclass
class _Run:
    """What one measurement samples and sketches."""

    policy: Any
    ref: Any
    tok: Any
    rendered: list[str]
    codec: Any
    subset: Subset
    sketch: Sketch
    samples: int
    max_new_tokens: int

    @property
    def n_prompts(self) -> int:
        return len(self.rendered)

    @property
    def rows(self) -> int:
        return self.n_prompts * self.samples

    @property
    def weights(self) -> int:
        return sum(
            p.numel() * p.element_size() for m in (self.policy, self.ref) for p in m.parameters()
        )

    @property
    def depth(self) -> int:
        """Decoder layers from the first measured one to the output (the backward's depth)."""
        names = [n for n, _ in self.policy.named_modules()]
        first = min(names.index(n) for n in self.subset.names)
        layers = [int(x.group(2)) for n in names if (x := _LAYER.match(n))]
        at = _LAYER.match(names[first])
        return (max(layers) - int(at.group(2)) + 1) if (layers and at) else len(layers) or 1


def _memory_plan(run: _Run, free: int | None, sketch: int, chat: bool, say: Any) -> dict[str, Any]:
    """The memory estimate, said with what is measured; refused beyond what is available."""
    sk = run.sketch
    prompt_tokens = int(run.codec.encode(run.rendered)["input_ids"].shape[1])
    est = memory_estimate(
        run.policy.config,
        weights=run.weights,
        rows=run.rows,
        group_rows=run.n_prompts,
        prompt_tokens=prompt_tokens,
        new_tokens=run.max_new_tokens,
        subset=run.subset,
        depth=run.depth,
        dim=sk.dim,
        groups=run.samples,
    )
    sketched = f"sketched to {sk.dim:,} numbers (--sketch {sketch})" if sketch else "exact"
    say(
        f"measuring gradients on {run.subset.description}: {run.subset.numel:,} parameters, "
        f"{sketched}; {run.rows} completions ({run.n_prompts} prompts × {run.samples}) of up to "
        f"{run.max_new_tokens} tokens" + (", chat template" if chat else "")
    )
    resident = resident_bytes()
    more = est["total"] - est["weights"]  # the parts summed, and OVERHEAD (memory_estimate)
    if resident is not None:
        est["resident"], est["peak"] = resident, resident + more
    avail = f"; {_gb(free)} available" if free is not None else ""
    now = f"{_gb(resident)} now, with both models loaded" if resident else "the process"
    say(
        f"memory: about {_gb(est.get('peak', est['total']))} at the peak: {now} (weights "
        f"{_gb(est['weights'])}), then sampling +{_gb(est['sampling'])}, one group "
        f"+{_gb(est['pass'])}, gradients +{_gb(est['store'])} and the rest "
        f"+{_gb(OVERHEAD)} (an upper bound: the allocator keeps what sampling frees){avail}"
    )
    if free is not None and more > free:
        raise MeasureError(
            f"the measurement needs about {_gb(more)} more and {_gb(free)} is available; lower "
            "it with fewer --prompts, --samples or --max-new-tokens, a smaller --sketch, or "
            "fewer parameters (--layer)"
        )
    return est


def _sample_and_sketch(
    run: _Run, seed: int, show_progress: bool
) -> tuple[Any, Tensor, dict[str, Tensor], dict[str, int]]:
    """Sample the completions, then sketch every objective's gradient group by group:
    ``(rollout, vectors [O, groups, D], per-token arrays in the rollout's row order, sizes)``."""
    from klpo.train.rollout.samplers import Decoding, generate
    from klpo.train.runtime.progress import Progress

    samples, n_prompts = run.samples, run.n_prompts
    vectors = torch.zeros(len(objective_names()), samples, run.sketch.dim, dtype=torch.float64)
    arrays: dict[str, list[Tensor]] = {}
    sizes: dict[str, int] = {}
    with Progress("doctor --model", samples + 1, show=show_progress) as bar:
        bar.update(0, part="sampling")
        torch.manual_seed(seed)
        rollout = generate(
            run.policy,
            run.tok,
            run.rendered,
            [""] * n_prompts,
            Decoding(group_size=samples, max_new_tokens=run.max_new_tokens),
            codec=run.codec,
        )
        if int(rollout.mask.sum()) == 0:
            raise MeasureError("the sampled completions hold no tokens; raise --max-new-tokens")
        bar.advance(part="gradients")
        # Each group holds every prompt once, in order: the prompts' caches serve every group,
        # where the measured layers see no prompt position (the default's do not).
        first_rows = torch.arange(n_prompts) * samples
        prefix = _prefix(run, rollout, first_rows)
        order = []
        for k in range(samples):  # group k: the k-th completion of every prompt (iid groups)
            idx = first_rows + k
            vec, arr, sizes = group_vectors(
                run.policy, run.ref, rollout, idx, run.subset, run.sketch, prefix
            )
            sizes["group_vectors"] = vec.nbytes
            vectors[:, k] = vec.sum(1)
            for key, v in arr.items():
                arrays.setdefault(key, []).append(v)
            order.append(idx)
            bar.advance()
    perm = torch.argsort(torch.cat(order))
    cat = {k: torch.cat(v)[perm] for k, v in arrays.items()}
    return rollout, rounding_floor(vectors), cat, sizes


def _prefix(run: _Run, rollout: Any, first_rows: Tensor) -> tuple[Any, Any] | None:
    """Both models' prompt caches, where the measured layers see no prompt position."""
    if not prompt_free(run.policy, rollout, run.subset):
        return None
    caches = (
        prompt_caches(run.policy, rollout, first_rows),
        prompt_caches(run.ref, rollout, first_rows),
    )
    return caches if all(x is not None for x in caches) else None
