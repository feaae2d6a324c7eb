"""Each prompt once per group: the shared-prefix forward against the plain one, in float64."""

from __future__ import annotations

import pytest
import torch

from klpo import logprobs
from klpo.train.models.backbone import Backbone, Critic
from klpo.train.models.load import default_reference_path, load_causal_lm, load_tokenizer
from klpo.train.rollout.samplers import Decoding, completion_hidden, generate, shared_groups

PROMPTS = ["12+7=", "3+45=", "99+99=", "1+2="]  # different token lengths: left padding is exercised


@pytest.fixture(scope="module")
def setup():
    path = str(default_reference_path())
    torch.manual_seed(0)
    model = load_causal_lm(path).double()
    tok = load_tokenizer(path)
    rollout = generate(model, tok, PROMPTS, ["0"] * 4, Decoding(group_size=3, max_new_tokens=4))
    return model, rollout


def _fused_logp(backbone: Backbone, rollout, share: bool) -> torch.Tensor:
    h = completion_hidden(backbone, rollout, share_prompt=share)
    head = backbone.head()
    return logprobs.fused(h, head.weight, rollout.completion_ids, bias=head.bias).logp


def test_rows_of_whole_groups_are_shared(setup):
    _, rollout = setup
    assert rollout.prompt_mask.sum(-1).unique().numel() > 1  # prompts of several lengths
    assert shared_groups(rollout) == 3
    assert shared_groups(rollout.select(list(range(6)))) == 3  # two whole groups
    assert shared_groups(rollout.select([0, 1, 3, 4, 6, 7])) == 1  # groups broken: unshared
    assert shared_groups(rollout.select([0, 1])) == 1  # fewer rows than a group


def test_shared_prompt_equals_unshared_values_and_gradients(setup):
    model, rollout = setup
    backbone = Backbone(model)
    mask = rollout.mask.double()
    grads = []
    values = []
    for share in (False, True):
        model.zero_grad()
        logp = _fused_logp(backbone, rollout, share)
        # a loss that weights every token differently, so each row's gradient matters
        weights = torch.linspace(-1.0, 2.0, logp.numel(), dtype=torch.float64).view_as(logp)
        ((logp * weights * mask).sum()).backward()
        values.append(logp.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(values[1], values[0], rtol=1e-12, atol=1e-12)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    # Tolerance: transformers' Llama computes RMSNorm (and RoPE) in float32 even for a float64
    # model, and the shared path sums the G completions' gradients before that float32 backward
    # instead of after it; what is left is float32 rounding (~1e-7 of each tensor's scale).
    for name, g in grads[0].items():
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_tolerance_catches_a_lost_prompt_gradient(setup, monkeypatch):
    """Teeth: if the shared keys/values were detached, the embeddings' gradient would be far off."""
    from transformers.cache_utils import DynamicLayer

    model, rollout = setup
    backbone = Backbone(model)
    repeat = DynamicLayer.batch_repeat_interleave

    def detached(self, repeats):
        repeat(self, repeats)
        self.keys, self.values = self.keys.detach(), self.values.detach()

    grads = []
    for share in (False, True):
        if share:
            monkeypatch.setattr(DynamicLayer, "batch_repeat_interleave", detached)
        model.zero_grad()
        (_fused_logp(backbone, rollout, share) * rollout.mask).sum().backward()
        grads.append(model.model.embed_tokens.weight.grad.clone())
    scale = grads[0].abs().max().item()
    assert (grads[1] - grads[0]).abs().max().item() > 1e-2 * scale


def test_shared_prompt_hidden_states_match_in_critic(setup):
    model, rollout = setup
    critic = Critic(model)
    ids, att = rollout.input_ids, rollout.attention_mask
    from klpo.train.rollout.samplers import position_ids

    plain = critic(ids, att, position_ids(att))
    shared = critic(ids, att, position_ids(att), prefix=rollout.prompt_ids.shape[1], group=3)
    torch.testing.assert_close(shared, plain, rtol=1e-12, atol=1e-12)
