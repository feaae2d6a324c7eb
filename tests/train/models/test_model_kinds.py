"""Kinds of models the trainer meets: sliding-window caches (shared, exact), caches that hold
recurrent state (the shared paths off, with a notice), mixture-of-experts policies (the router's
load-balancing loss, ``algo.router_aux_loss_coef``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from klpo import reduce
from klpo.train.config import ConfigError, build_config
from klpo.train.models.backbone import Backbone
from klpo.train.models.build import build_models, unwrap
from klpo.train.models.cache import cache_support, notice
from klpo.train.rollout.samplers import Decoding, generate, position_ids
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import Tally
from klpo.train.step.kl_term import kl_term
from klpo.train.step.update import MicroBatch, micro_step

SIZES = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64,
)  # fmt: skip


def _model(model_type: str, dtype: torch.dtype = torch.float64, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SIZES, **fields})
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _groups(prompt: int = 8, tail: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``[6, prompt + tail]`` ids of two prompts with three completions each (the second prompt
    left-padded by 2, one completion right-padded by 1) and their mask."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 64, (2, prompt), generator=gen).repeat_interleave(3, 0)
    ids = torch.cat([prompts, torch.randint(3, 64, (6, tail), generator=gen)], 1)
    mask = torch.ones_like(ids)
    mask[3:, :2] = 0
    mask[4, -1] = 0
    return ids, mask


def _features_and_grads(backbone: Backbone, ids, mask, shared: bool):
    backbone.model.zero_grad()
    kw = dict(prefix=8, group=3) if shared else {}
    h = backbone(ids, mask, position_ids(mask), **kw)
    real = mask.bool()
    weights = torch.linspace(-1.0, 2.0, h[real].numel(), dtype=h.dtype).view_as(h[real])
    (h[real] * weights).sum().backward()
    grads = {k: p.grad.clone() for k, p in backbone.model.named_parameters() if p.grad is not None}
    return h[real].detach(), grads


def test_a_sliding_window_cache_is_shared_exactly():
    """Gemma 2 with a 4-token window on alternate layers (a prompt of 8, left-padded): the shared
    prompt's hidden states and gradients are the unshared forward's, and the window bites.
    float32: transformers' Gemma 2 in float64 turns left padding into NaN (its eager attention
    over a fully masked padding row)."""
    model = _model("gemma2", torch.float32, sliding_window=4)
    support = cache_support(model)
    assert support.shared and "DynamicSlidingWindowLayer" in support.layers
    ids, mask = _groups()
    backbone = Backbone(model)
    h0, g0 = _features_and_grads(backbone, ids, mask, shared=False)
    h1, g1 = _features_and_grads(backbone, ids, mask, shared=True)
    assert torch.isfinite(h0).all()
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 5
    for k, g in g0.items():  # float32 rounding of each tensor's sum over rows
        torch.testing.assert_close(g1[k], g, rtol=0, atol=1e-5 * float(g.abs().max()), msg=k)
    # teeth: without the window the same weights give other hidden states
    wide = _model("gemma2", torch.float32, sliding_window=64)
    wide.load_state_dict(model.state_dict())
    h_wide, _ = _features_and_grads(Backbone(wide), ids, mask, shared=False)
    assert (h_wide - h0).abs().max() > 1e-2


@pytest.fixture(scope="module")
def recurrent():
    """A tiny Mamba: a cache of recurrent and convolution state."""
    return _model("mamba", state_size=8, expand=2, conv_kernel=4, time_step_rank=4)


def test_a_recurrent_cache_turns_the_shared_paths_off(recurrent):
    support = cache_support(recurrent)
    assert not support.shared and "recurrent state" in support.reason
    line = notice(recurrent, "model.policy", share_prompt=True, lean=True)
    assert line.startswith("Note: rollout.share_prompt and rollout.sampler: lean off for ")
    assert "model.policy, MambaForCausalLM (mamba)" in line and "generate" in line
    assert notice(recurrent, "model.policy", share_prompt=False, lean=False) is None
    only = notice(recurrent, "model.reference", share_prompt=True, lean=False)
    assert "rollout.sampler" not in only and "every row is computed whole" in only
    # the Backbone runs every row whole: equal to the unshared forward (a repeated recurrent
    # state would differ)
    ids, mask = _groups()
    ones = torch.ones_like(mask)  # Mamba reads no attention mask
    backbone = Backbone(recurrent)
    h0, _ = _features_and_grads(backbone, ids, ones, shared=False)
    h1, _ = _features_and_grads(backbone, ids, ones, shared=True)
    torch.testing.assert_close(h1, h0, rtol=1e-12, atol=1e-12)


def test_the_lean_sampler_hands_a_recurrent_model_to_generate(recurrent):
    from klpo.train.rollout.samplers import sample_lean

    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"rollout\.sampler: generate"):
        sample_lean(
            recurrent, ids, torch.ones_like(ids), Decoding(group_size=2, max_new_tokens=3),
            eos_token_id=0, pad_token_id=0,
        )  # fmt: skip

    class Tok:  # what generate asks of a tokenizer
        padding_side = "left"
        pad_token_id = eos_token_id = bos_token_id = 0

        def __call__(self, texts, **_):
            rows = torch.stack([ids[int(t)] for t in texts])
            return {"input_ids": rows, "attention_mask": torch.ones_like(rows)}

        def __len__(self):  # the vocabulary's size (the stop set checks its ids against it)
            return 64

        def batch_decode(self, rows, **_):
            return [" ".join(map(str, torch.as_tensor(r).tolist())) for r in rows]

    torch.manual_seed(0)
    decoding = Decoding(group_size=2, max_new_tokens=3, greedy=True)
    r = generate(recurrent, Tok(), ["0", "1"], ["", ""], decoding)
    want = recurrent.generate(
        input_ids=ids.repeat_interleave(2, 0), do_sample=False, max_new_tokens=3,
        eos_token_id=0, pad_token_id=0,
    )[:, 5:]  # fmt: skip
    assert torch.equal(r.completion_ids[:, : want.shape[1]], want)


def test_the_load_says_which_option_is_off_and_why(arch_model, quick, tmp_path):
    path = arch_model(tmp_path / "mamba", "mamba", state_size=8, time_step_rank=4)
    cfg = build_config(overrides=quick(path, tmp_path / "run", **{"kl.beta": 0.5}))
    m = build_models(cfg, Dist(), None)
    assert len(m.notes) == 2  # the policy (which samples) and the reference
    assert m.notes[0].startswith("Note: rollout.share_prompt and rollout.sampler: lean off for ")
    assert m.notes[1].startswith("Note: rollout.share_prompt off for model.reference")


# --------------------------------------------------------------------------------------------
# Mixture of experts.


def _moe_cfg(quick, path, out, **extra):
    return build_config(overrides=quick(path, out, **{"kl.beta": 0.5, **extra}))


@pytest.fixture
def mixtral(arch_model, tmp_path):
    return arch_model(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2)


def _step(scored_rollout, cfg):
    """One micro-step on 4 groups of 4 (fresh models, same draws): (models, rollout, metrics,
    the policy's gradients)."""
    sr = scored_rollout(cfg, beta=0.5, nudge=0.0)
    m, r, s = sr.models, sr.rollout, sr.scored
    m.policy.zero_grad()
    n = reduce.normaliser(r.mask, "token-mean")
    rows = torch.arange(len(r.prompts))
    metrics = micro_step(
        cfg,
        m,
        MicroBatch.of(cfg, s, rows, n),
        kl_term(cfg, beta=0.5, beta_old=1.0),
        Dist(),
        sync=True,
        tally=Tally(),
    )
    return m, r, metrics, {k: p.grad.clone() for k, p in m.policy.named_parameters()}


def test_the_router_loss_is_the_models_own_and_weighted(mixtral, quick, tmp_path, scored_rollout):
    """algo.router_aux_loss_coef: the logged loss is the model's own aux_loss on the rollout's
    tokens, and the gradient gains coef times its gradient."""
    coef = 0.3
    base = {"rollout.share_prompt": "false"}
    m0, r, met0, g0 = _step(scored_rollout, _moe_cfg(quick, mixtral, tmp_path / "off", **base))
    assert m0.router_aux_coef == 0.0 and "loss/router_aux" not in met0  # its config: off
    cfg = _moe_cfg(quick, mixtral, tmp_path / "on", **base, **{"algo.router_aux_loss_coef": coef})
    m1, r1, met1, g1 = _step(scored_rollout, cfg)
    assert torch.equal(r1.completion_ids, r.completion_ids)
    policy = unwrap(m1.backbone).model
    policy.zero_grad()
    att = r.attention_mask.long()
    own = policy(input_ids=r.input_ids, attention_mask=att, position_ids=position_ids(att),
                 output_router_logits=True).aux_loss  # fmt: skip
    own.backward()
    assert met1["loss/router_aux"] == pytest.approx(float(own.detach()), rel=1e-5)
    grad_aux = {k: p.grad for k, p in policy.named_parameters() if p.grad is not None}
    gates = [k for k in grad_aux if ".gate." in k or "router" in k]
    assert gates and all(float(grad_aux[k].abs().max()) > 0 for k in gates)
    for k, g in grad_aux.items():
        want = g0[k] + coef * g
        torch.testing.assert_close(g1[k], want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


def test_the_router_loss_is_refused_on_a_dense_model(tiny_model, quick, tmp_path):
    cfg = _moe_cfg(quick, tiny_model, tmp_path / "run", **{"algo.router_aux_loss_coef": 0.01})
    with pytest.raises(ConfigError, match=r"algo\.router_aux_loss_coef=0\.01 but model\.policy"):
        build_models(cfg, Dist(), None)


def test_the_router_loss_with_a_shared_prompt(mixtral, quick, tmp_path, scored_rollout):
    """With each prompt once per group the router sees the prompt's tokens once: the logged loss
    is load_balancing_loss_func over those tokens, and it reaches the router's weights."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = _moe_cfg(quick, mixtral, tmp_path / "run", **{"algo.router_aux_loss_coef": 0.3})
    m, r, metrics, grads = _step(scored_rollout, cfg)
    policy = unwrap(m.backbone).model
    att = r.attention_mask.long()
    p = r.prompt_ids.shape[1]
    with torch.no_grad():
        out = policy(input_ids=r.input_ids, attention_mask=att, position_ids=position_ids(att),
                     output_router_logits=True)  # fmt: skip
    first = att.clone().bool()
    first[:, :p] &= (torch.arange(len(r.prompts)) % r.group_size == 0)[:, None]  # once a group
    gates = tuple(g.reshape(-1, g.shape[-1])[first.reshape(-1)] for g in out.router_logits)
    text = policy.config
    want = load_balancing_loss_func(gates, text.num_local_experts, text.num_experts_per_tok, None)
    assert metrics["loss/router_aux"] == pytest.approx(float(want), rel=1e-5, abs=0)
    assert abs(float(want) - float(out.aux_loss)) > 1e-4  # the prompt counts once, not G times
    assert any(float(g.abs().max()) > 0 for k, g in grads.items() if ".gate." in k)


def test_a_cache_that_breaks_or_goes_wrong_when_repeated_is_not_shared(monkeypatch):
    """The probe of the shared paths: a repeat that mixes the rows (a wrong cache) and a forward
    that raises over a cache both turn the paths off, with the reason."""
    from transformers.cache_utils import DynamicLayer

    assert cache_support(_model("llama")).shared
    repeat = DynamicLayer.batch_repeat_interleave

    def lost(self, n):  # rows repeated, their values lost
        repeat(self, n)
        self.values = torch.zeros_like(self.values)

    monkeypatch.setattr(DynamicLayer, "batch_repeat_interleave", lost)
    model = _model("llama")  # a fresh model object: probed anew
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # logits over nats, as a trained model's
    support = cache_support(model)
    assert not support.shared and "gives other log-probs (off by" in support.reason
    monkeypatch.setattr(DynamicLayer, "batch_repeat_interleave", repeat)

    class Broken(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, **kw):
            if "past_key_values" in kw or "cache" in kw:
                raise RuntimeError("no cache here")
            return self.inner(**kw)

    support = cache_support(Broken(_model("llama")))
    assert not support.shared
    assert support.reason == "its forward over a repeated cache fails (RuntimeError: no cache here)"
