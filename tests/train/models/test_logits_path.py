"""The trainer's log-probs are the model's own: the head's transform, the load-time check, the
fallback ``model.logits_path: model``."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from klpo import losses, reduce
from klpo.heads import Head, LogitTransform
from klpo.train.config import ConfigError, build_config
from klpo.train.models.backbone import OWN_LOGITS, token_outputs
from klpo.train.models.build import build_models, unwrap
from klpo.train.rollout.samplers import completion_hidden, position_ids
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import Tally
from klpo.train.step.kl_term import kl_term
from klpo.train.step.update import MicroBatch, micro_step


class TemperedConfig(LlamaConfig):
    model_type = "klpo_tempered"


class TemperedForCausalLM(LlamaForCausalLM):
    """A Llama that bends its logits after the head in a way of its own (no config field names
    it): ``x = 2 tanh(z / 2) + z / 2``, monotone, so it samples and trains like any model."""

    config_class = TemperedConfig

    @functools.wraps(LlamaForCausalLM.forward)  # its signature: the cache's keyword
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2.0 * torch.tanh(out.logits / 2.0) + 0.5 * out.logits
        return out


AutoConfig.register("klpo_tempered", TemperedConfig, exist_ok=True)
AutoModelForCausalLM.register(TemperedConfig, TemperedForCausalLM, exist_ok=True)


def _widen(path, factor: float) -> None:
    """Scale the saved model's output head, so its logits spread over nats (a transform shows)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def tempered(tmp_path_factory):
    from klpo.train.tools.make_reference import build_tokenizer

    path = tmp_path_factory.mktemp("tempered") / "model"
    tok = build_tokenizer()
    config = TemperedConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    TemperedForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    _widen(path, 40.0)
    return path


def _cfg(quick, model, out, **extra):
    return build_config(overrides=quick(model, out, **{"kl.beta": 0.5, **extra}))


def test_a_made_up_transform_is_refused_at_load(tempered, quick, tmp_path):
    for dtype in ("float32", "bfloat16"):  # the check runs on the float32 master weights
        cfg = _cfg(quick, tempered, tmp_path / dtype, **{"model.dtype": dtype})
        with pytest.raises(ConfigError) as err:
            build_models(cfg, Dist(), None)
        text = str(err.value)
        assert text.startswith(
            f"model.policy {str(tempered)!r}: TemperedForCausalLM (klpo_tempered)"
        )
        assert "nats" in text and "model.logits_path: model" in text
        assert "after the output head" in text  # the diagnosis: where the model differs


def _one_step(scored_rollout, cfg, seed: int = 0):
    """Fresh models (the policy moved off the reference), 4 groups of 4 completions, scored, one
    micro-step on all rows: (models, rollout, scored, the policy's gradients, its outputs)."""
    sr = scored_rollout(cfg, beta=0.5, seed=seed)
    dist, m, rollout, s = sr.dist, sr.models, sr.rollout, sr.scored
    rows = torch.arange(len(rollout.prompts))
    n = reduce.normaliser(rollout.mask, "token-mean")
    m.policy.zero_grad()
    micro_step(
        cfg,
        m,
        MicroBatch.of(cfg, s, rows, n),
        kl_term(cfg, beta=0.5, beta_old=1.0),
        dist,
        sync=True,
        tally=Tally(),
    )
    grads = {k: p.grad.clone() for k, p in m.policy.named_parameters()}
    return m, rollout, s, grads


def _naive(m, rollout, s):
    """The same loss from the models' own logits, log_softmax in float64: (gradients, log pi_old,
    log pi_ref, exact KL)."""
    m.policy.zero_grad()
    att = rollout.attention_mask
    pos = position_ids(att)
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    cols = slice(p - 1, p - 1 + c)
    logits = m.policy(input_ids=rollout.input_ids, attention_mask=att, position_ids=pos).logits
    ref_model = unwrap(m.reference).model
    with torch.no_grad():
        ref = ref_model(input_ids=rollout.input_ids, attention_mask=att, position_ids=pos).logits
    logq = torch.log_softmax(logits[:, cols].double(), -1)
    logq_ref = torch.log_softmax(ref[:, cols].double(), -1)
    logp = logq.gather(-1, rollout.completion_ids[..., None])[..., 0]
    logp_ref = logq_ref.gather(-1, rollout.completion_ids[..., None])[..., 0]
    kl_tok = (logq.exp() * (logq - logq_ref)).sum(-1)
    pg = losses.ppo_clip(logp, logp.detach(), s.adv)
    mask = rollout.mask
    (
        reduce.reduce(pg, mask, "token-mean") + 0.5 * reduce.reduce(kl_tok, mask, "token-mean")
    ).backward()
    grads = {k: p.grad.clone() for k, p in m.policy.named_parameters()}
    return grads, logp.detach(), logp_ref, kl_tok.detach()


def _assert_grads_close(got, want):
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=k)
    assert any(g.abs().max() > 0 for g in got.values())


def test_the_fallback_gives_the_models_own_numbers(tempered, quick, tmp_path, scored_rollout):
    """model.logits_path: model on the made-up transform: pi_old, pi_ref, the exact KL and the
    update's gradient are those of the model's own logits (a naive float64 assembly)."""
    cfg = _cfg(quick, tempered, tmp_path / "run", **{"model.logits_path": "model"})
    m, rollout, s, grads = _one_step(scored_rollout, cfg)
    assert unwrap(m.backbone).head() is OWN_LOGITS
    want, logp, logp_ref, kl_tok = _naive(m, rollout, s)
    mask = rollout.mask
    torch.testing.assert_close(s.old.logp[mask].double(), logp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.logp_ref[mask].double(), logp_ref[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.old.kl[mask].double(), kl_tok[mask], rtol=1e-4, atol=1e-6)
    _assert_grads_close(grads, want)


def test_the_fallback_equals_the_fused_path_on_a_plain_model(
    tiny_model, quick, tmp_path, scored_rollout
):
    """A plain Llama: the model's own logits and the fused head give one step's log-probs,
    entropy, exact KL and gradients alike (float32 rounding)."""
    runs = {}
    for path in ("fused", "model"):
        cfg = _cfg(quick, tiny_model, tmp_path / path, **{"model.logits_path": path})
        _, rollout, s, grads = _one_step(scored_rollout, cfg)
        runs[path] = (rollout, s, grads)
    (r_f, s_f, g_f), (r_m, s_m, g_m) = runs["fused"], runs["model"]
    assert torch.equal(r_f.completion_ids, r_m.completion_ids)  # the same draws
    mask = r_f.mask
    for name in ("logp", "entropy", "kl"):
        torch.testing.assert_close(
            getattr(s_m.old, name)[mask], getattr(s_f.old, name)[mask], rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(s_m.logp_ref[mask], s_f.logp_ref[mask], rtol=1e-5, atol=1e-6)
    _assert_grads_close(g_m, g_f)


def test_a_soft_capped_model_trains_on_its_own_log_probs(
    arch_model, quick, tmp_path, scored_rollout
):
    """Gemma 2 with a soft cap that bites: the load-time check passes, the trainer's pi_old,
    pi_ref, exact KL and gradient are the model's own; the plain head would be nats off."""
    path = arch_model(tmp_path / "gemma2", "gemma2", final_logit_softcapping=2.0)
    _widen(path, 30.0)
    cfg = _cfg(quick, path, tmp_path / "run")
    m, rollout, s, grads = _one_step(scored_rollout, cfg)
    head = unwrap(m.backbone).head()
    assert head.transform == LogitTransform(1.0, 2.0)
    want, logp, logp_ref, kl_tok = _naive(m, rollout, s)
    mask = rollout.mask
    torch.testing.assert_close(s.old.logp[mask].double(), logp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.logp_ref[mask].double(), logp_ref[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.old.kl[mask].double(), kl_tok[mask], rtol=1e-4, atol=1e-6)
    _assert_grads_close(grads, want)
    # teeth: the same hidden states through the head without its cap
    with torch.no_grad():
        hidden = completion_hidden(unwrap(m.backbone), rollout)
        uncapped = Head(head.weight, head.bias, None)
        plain = token_outputs(hidden, uncapped, rollout.completion_ids, temperature=1.0).logp
    assert (plain[mask].double() - logp[mask]).abs().max() > 0.5
