"""klpo.train.optimizers: AdamW over the policy's trainable parameters and the critic's, with the
``optim.*`` settings, fused where torch's fused kernel applies.

Oracle: the first AdamW step by hand. With m_1 = (1 - b1) g and v_1 = (1 - b2) g², the bias
corrections give m̂ = g and v̂ = g², so p_1 = p_0 (1 - lr·wd) - lr·g / (|g| + eps).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from klpo.train.config import build_config
from klpo.train.optimizers import _fusable, make_optimizers


def _models(critic: bool) -> SimpleNamespace:
    torch.manual_seed(0)
    policy = torch.nn.Linear(3, 2)
    policy.bias.requires_grad_(False)  # frozen: not the optimizer's
    return SimpleNamespace(policy=policy, critic_core=torch.nn.Linear(3, 1) if critic else None)


def test_the_policys_trainable_parameters_and_the_critics_with_their_settings():
    cfg = build_config(
        overrides=[
            "optim.lr=0.01",
            "optim.critic_lr=0.05",
            "optim.weight_decay=0.1",
            "optim.betas=[0.8, 0.99]",
            "run.steps=4",
        ]
    )
    m = _models(critic=True)
    opt = make_optimizers(cfg, m)
    (group,) = opt.policy.param_groups
    assert [id(p) for p in group["params"]] == [id(m.policy.weight)]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.01, (0.8, 0.99), 0.1)
    assert group["fused"] is True  # plain float tensors on the CPU
    (cgroup,) = opt.critic.param_groups
    assert cgroup["lr"] == 0.05 and len(cgroup["params"]) == 2
    assert opt.lr_scheduler is not None
    assert make_optimizers(build_config(overrides=["optim.lr=0.01"]), _models(False)).critic is None
    # The critic's learning rate defaults to the policy's.
    no_critic_lr = make_optimizers(build_config(overrides=["optim.lr=0.02"]), _models(True))
    assert no_critic_lr.critic.param_groups[0]["lr"] == 0.02


def test_the_first_step_is_adamw_by_hand():
    lr, wd, eps = 0.01, 0.1, 1e-8
    cfg = build_config(overrides=[f"optim.lr={lr}", f"optim.weight_decay={wd}", "run.steps=4"])
    m = _models(critic=False)
    opt = make_optimizers(cfg, m)
    p0 = m.policy.weight.detach().clone().double()
    g = torch.tensor([[0.5, -2.0, 1e-3], [3.0, 0.0, -0.25]])
    m.policy.weight.grad = g.clone()
    opt.policy.step()
    want = p0 * (1 - lr * wd) - lr * g.double() / (g.double().abs() + eps)
    assert m.policy.weight.detach().double() == pytest.approx(want, abs=1e-6)
    # A zero gradient moves the weight by the decay alone.
    assert m.policy.weight[1, 1].item() == pytest.approx(p0[1, 1].item() * (1 - lr * wd), abs=1e-7)


def test_fused_only_where_the_kernel_applies():
    assert _fusable([torch.nn.Parameter(torch.zeros(2))]) is True
    assert _fusable([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]) is True
    meta = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert _fusable([meta]) is None  # not a CPU or CUDA device: torch's default
