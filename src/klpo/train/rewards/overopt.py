r"""The over-optimisation task: train on a proxy reward, watch the gold reward.

``data.source: builtin-overopt`` poses the built-in arithmetic problems (:mod:`klpo.train.data.task`)
and, unless the config says otherwise, trains on the proxy reward ``overopt_proxy`` while logging
the gold reward, exact correctness (``exact_match``), every step
(:func:`klpo.train.rewards.gold.gold_metrics`):

- ``reward/proxy``: the mean of the trained-on total reward of the step's completions;
- ``reward/gold``: the mean of the gold reward of the same completions.

The proxy (:func:`overopt_proxy`) is a grader with two flaws met in practice: it accepts a
completion that *starts with* the answer (a lenient prefix check, so ``"8517"`` passes for
``85``), and it pays a bonus for length (the length bias of learned reward models, Singhal et al.
2023, arXiv:2310.03716). Both are learnable by the policy: writing past the answer instead of
stopping raises the proxy and zeroes the gold reward. Without a KL term, proxy reward keeps
rising while gold reward rises and then falls, the over-optimisation curve of Gao et al. 2023
(arXiv:2210.10760); the KL to the reference, which stops right after its answers, is what holds
the policy where the proxy is still right. A learned proxy works the same way: give
``rewards: [{name: model, path: DIR}]`` (``klpo make-reward-model DIR``). See docs/overopt.md.
"""

from __future__ import annotations

__all__ = ["LENGTH_BONUS", "LENGTH_CAP", "overopt_proxy"]

LENGTH_BONUS = 0.5  # the most the length bonus pays, in units of a right answer
LENGTH_CAP = 8  # characters at which the bonus is full


def overopt_proxy(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    r"""The over-optimisation task's flawed proxy reward.

        proxy(c, a) = 1[strip(c) starts with strip(a)] + LENGTH_BONUS · min(|strip(c)|, LENGTH_CAP) / LENGTH_CAP

    e.g. for answer ``"85"``: ``"85"`` → 1 + 0.5·2/8 = 1.125; ``"8517"`` → 1 + 0.5·4/8 = 1.25
    (gold: 0); ``"84"`` → 0.125; ``""`` → 0.
    """
    out = []
    for c, a in zip(completions, answers, strict=True):
        c, a = c.strip(), a.strip()
        out.append(float(c.startswith(a)) + LENGTH_BONUS * min(len(c), LENGTH_CAP) / LENGTH_CAP)
    return out
