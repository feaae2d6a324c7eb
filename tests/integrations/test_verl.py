"""Tests for klpo.integrations.verl against verl (peer: skipped without verl; run with 0.7.1,
0.8.0 and 0.9.1, docs/frameworks.md's version matrix).

Oracles: verl's own call sites, run unchanged (``ray_trainer.apply_kl_penalty`` for the reward,
``workers.utils.losses.ppo_loss`` for the loss, both reducing or subtracting with verl's code);
verl's ``ppo_loss`` with the KL loss switched off, plus klpo's assembly
(``beta · reduce(kl_loss(...))``) by hand; per-token estimates written out in float64; and
verl's own estimator names, which the ``klpo:`` names must reproduce where they mean the same.

Run in a side environment with verl (never klpo's default install)::

    python3 -m venv venv-verl && venv-verl/bin/pip install torch==2.13.0 verl==0.9.1 pytest
    PYTHONPATH=src venv-verl/bin/python -m pytest tests/integrations/test_verl.py
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Without verl (these run everywhere, CI included).


def test_import_without_verl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)  # `import verl` now raises ImportError
    monkeypatch.delitem(sys.modules, "klpo.integrations.verl", raising=False)
    with pytest.raises(ImportError, match=r"pip install verl==0\.9\.1"):
        importlib.import_module("klpo.integrations.verl")


def test_import_klpo_and_the_doctor_never_import_verl():
    src = str(Path(importlib.import_module("klpo").__file__).parents[1])
    code = (
        "import sys, klpo, klpo.integrations, klpo.kl, klpo.losses, klpo.doctor\n"
        "print(sorted(m for m in ('verl', 'ray') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# With verl 0.9.1.

HAVE_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(
    not HAVE_VERL, reason="peer test: needs verl==0.9.1 in a side environment"
)

if HAVE_VERL:
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    from verl.workers.config import ActorConfig
    from verl.workers.utils import losses as verl_losses

    import klpo.integrations.verl as kv

from klpo import kl, losses  # noqa: E402
from klpo.reduce import reduce  # noqa: E402

B, P, R = 4, 2, 5
RESP_LEN = torch.tensor([5, 2, 4, 3])
COEF = 0.1


@pytest.fixture
def _installed():
    kv.install()
    yield
    kv.uninstall()


def _batch(seed: int, spread: float = 1.0):
    """A padded verl batch and flat model log-probs (``[total_nnz]``, as verl's engines give)."""
    g = torch.Generator().manual_seed(seed)
    am = torch.cat(
        [torch.ones(B, P, dtype=torch.long), (torch.arange(R)[None] < RESP_LEN[:, None]).long()], 1
    )
    mask = am[:, P:].bool()
    nnz = int((P + RESP_LEN).sum())
    flat = (-spread * torch.rand(nnz, generator=g)).requires_grad_(True)
    old = -spread * torch.rand(B, R, generator=g)
    ref = -spread * torch.rand(B, R, generator=g)
    adv = torch.randn(B, R, generator=g)
    data = TensorDict(
        {
            "prompts": torch.ones(B, P, dtype=torch.long),
            "responses": torch.ones(B, R, dtype=torch.long),
            "attention_mask": am,
            "response_mask": mask.long(),
            "old_log_probs": old,
            "advantages": adv,
            "ref_log_prob": ref,
        },
        batch_size=[B],
    )
    tu.assign_non_tensor(
        data,
        dp_size=1,
        batch_num_tokens=int(mask.sum()),
        global_batch_size=B,
        pad_mode=DatasetPadMode.NO_PADDING,
    )
    return flat, data, mask, old, ref


def _padded(flat, mask):
    """The response log-probs [B, R] out of the flat tensor, by index arithmetic (not verl's code):
    sequence b starts at sum of earlier lengths; its response token j is predicted at P - 1 + j."""
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), (P + RESP_LEN)[:-1]]), 0)
    idx = (starts[:, None] + P - 1 + torch.arange(R)[None]).clamp_max(flat.numel() - 1)
    return torch.where(mask, flat[idx], 0.0)


def _config(kl_type: str, *, use_kl: bool = True, agg: str = "token-mean") -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=2,
        ppo_mini_batch_size=4,
        rollout_n=1,
        use_kl_loss=use_kl,
        kl_loss_type=kl_type,
        kl_loss_coef=COEF,
        loss_agg_mode=agg,
    )


def _loss_and_grad(config, flat, data):
    flat = flat.detach().clone().requires_grad_(True)
    loss, metrics = verl_losses.ppo_loss(config, {"log_probs": flat, "entropy": None}, data)
    (grad,) = torch.autograd.grad(loss, flat)
    return loss.detach(), grad, metrics


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
def test_install_rebinds_every_call_site_and_uninstall_restores():
    from verl.workers import engine_workers

    assert kv.installed()
    assert core_algos.kl_penalty is kv.kl_penalty
    assert verl_losses.kl_penalty is kv.kl_penalty
    assert verl_losses.ppo_loss is kv.ppo_loss and engine_workers.ppo_loss is kv.ppo_loss
    kv.uninstall()
    assert not kv.installed() and engine_workers.ppo_loss is not kv.ppo_loss
    kv.install()


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
@pytest.mark.parametrize("name", ["k1+", "k2", "k3", "k3+", "k3_is", "abs+", "kl_ref_theta"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kl_loss_is_klpos_assembly_value_and_gradient(name, agg):
    """verl's ppo_loss with kl_loss_type=klpo:NAME == verl's policy loss (KL off) +
    coef · reduce(klpo.losses.kl_loss(NAME, logp, ref, logp_old=old)), off-policy (old ≠ logp)."""
    flat, data, mask, old, ref = _batch(seed=1)
    loss, grad, metrics = _loss_and_grad(_config("klpo:" + name, agg=agg), flat, data)
    base, base_grad, _ = _loss_and_grad(_config("low_var_kl", use_kl=False, agg=agg), flat, data)

    leaf = flat.detach().clone().requires_grad_(True)
    term = losses.kl_loss(name, _padded(leaf, mask), ref, logp_old=old)
    want = COEF * reduce(term, mask, agg)
    (want_grad,) = torch.autograd.grad(want, leaf)
    torch.testing.assert_close(loss - base, want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad - base_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert float(metrics["kl_loss"].values[0]) == pytest.approx(float(want) / COEF, rel=1e-5)


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
def test_kl_loss_off_policy_weight_by_hand():
    """klpo:k2, token-mean: the added loss is coef · sum_t w_t d_t²/2 / N with the detached
    w = exp(logp - logp_old), written out in float64; its gradient coef · w d / N per token."""
    flat, data, mask, old, ref = _batch(seed=2)
    loss, grad, _ = _loss_and_grad(_config("klpo:k2"), flat, data)
    base, base_grad, _ = _loss_and_grad(_config("k2", use_kl=False), flat, data)
    lp = _padded(flat.detach(), mask).to(F64)
    d = lp - ref.to(F64)
    w = torch.exp(lp - old.to(F64))
    n = mask.sum()
    want = COEF * torch.where(mask, w * d * d / 2, 0.0).sum() / n
    assert float(loss - base) == pytest.approx(float(want), rel=1e-5)
    per_token = torch.where(mask, COEF * w * d / n, 0.0)
    leaf = flat.detach().clone().requires_grad_(True)
    (scatter,) = torch.autograd.grad((_padded(leaf, mask) * per_token.float()).sum(), leaf)
    torch.testing.assert_close(grad - base_grad, scatter, rtol=1e-5, atol=1e-7)


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
def test_without_klpo_the_weight_is_missing_and_verls_names_are_untouched():
    """verl's own low_var_kl equals klpo:low_var_kl only on-policy: klpo weights the term."""
    flat, data, mask, _old, _ref = _batch(seed=3)
    verl_own, verl_grad, _ = _loss_and_grad(_config("low_var_kl"), flat, data)
    ours, ours_grad, _ = _loss_and_grad(_config("klpo:low_var_kl"), flat, data)
    assert not torch.allclose(verl_grad, ours_grad)
    # On-policy (old = logp): the weight is 1 and the two agree, value and gradient.
    data["old_log_probs"] = _padded(flat.detach(), mask)
    verl_own, verl_grad, _ = _loss_and_grad(_config("low_var_kl"), flat, data)
    ours, ours_grad, _ = _loss_and_grad(_config("klpo:low_var_kl"), flat, data)
    torch.testing.assert_close(ours, verl_own, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-5, atol=1e-7)


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
def test_straight_through_matches_verls_plus_names_on_policy():
    flat, data, mask, _old, _ref = _batch(seed=4, spread=0.5)  # |d| < 1: no clamp binds
    data["old_log_probs"] = _padded(flat.detach(), mask)
    # verl before 0.8 hands "k3+" itself to kl_penalty_forward, which knows only "k3": its own
    # "+" names raise there (klpo's are not verl's code and work in every version).
    broken = _verl_version() < (0, 8)
    for verl_name, ours in (("k3+", "k3+"), ("k1+", "k1+"), ("mse", "k2"), ("abs+", "abs+")):
        if broken and verl_name.endswith("+"):
            with pytest.raises(NotImplementedError):
                _loss_and_grad(_config(verl_name), flat, data)
            b, gb, _ = _loss_and_grad(_config("klpo:" + ours), flat, data)
            assert torch.isfinite(b) and torch.isfinite(gb).all()
            continue
        a, ga, _ = _loss_and_grad(_config(verl_name), flat, data)
        b, gb, _ = _loss_and_grad(_config("klpo:" + ours), flat, data)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-7)


def _verl_version() -> tuple[int, int]:
    import verl

    return tuple(int(p) for p in verl.__version__.split(".")[:2])


def _proto(old, ref, mask, scores):
    return DataProto.from_dict(
        tensors={
            "response_mask": mask.long(),
            "token_level_scores": scores,
            "old_log_probs": old,
            "ref_log_prob": ref,
        }
    )


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
@pytest.mark.parametrize("name", ["k1", "k3", "k3_is", "k2", "kl_ref_theta"])
def test_kl_reward_is_klpos_estimate(name):
    """apply_kl_penalty(kl_penalty="klpo:NAME"): rewards - beta · estimate(old, ref) per token."""
    _, _, mask, old, ref = _batch(seed=5)
    scores = torch.where(mask, torch.randn(B, R, generator=torch.Generator().manual_seed(9)), 0.0)
    ctrl = core_algos.FixedKLController(kl_coef=0.05)
    out, _ = apply_kl_penalty(_proto(old, ref, mask, scores), ctrl, kl_penalty="klpo:" + name)
    est = kl.estimate(name, old, ref, logp_old=old)
    want = scores - 0.05 * torch.where(mask, est, 0.0)
    torch.testing.assert_close(out.batch["token_level_rewards"], want)
    if name in ("k1", "k3"):  # written out: k1 = d, k3 = exp(-d) + d - 1, in float64
        d = old.to(F64) - ref.to(F64)
        hand = d if name == "k1" else torch.exp(-d) + d - 1
        torch.testing.assert_close(est.to(F64), hand, rtol=1e-6, atol=1e-7)


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
def test_kl_reward_klpo_k1_equals_verls_kl():
    _, _, mask, old, ref = _batch(seed=6)
    scores = torch.zeros(B, R)
    a, _ = apply_kl_penalty(_proto(old, ref, mask, scores), core_algos.FixedKLController(0.1), "kl")
    b, _ = apply_kl_penalty(
        _proto(old, ref, mask, scores), core_algos.FixedKLController(0.1), "klpo:k1"
    )
    torch.testing.assert_close(b.batch["token_level_rewards"], a.batch["token_level_rewards"])


@needs_verl
@pytest.mark.peer
@pytest.mark.usefixtures("_installed")
def test_bad_names_say_what_is_available():
    with pytest.raises(ValueError, match=r"klpo:full .* not available in verl"):
        kv.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "klpo:full")
    with pytest.raises(ValueError, match=r"klpo:k3\+"):
        kv.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "klpo:k4")
    # verl's own names still reach verl (and verl's `full` still raises verl's error).
    with pytest.raises(NotImplementedError):
        kv.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "full")
