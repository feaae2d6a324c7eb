"""Tests for klpo.heads and klpo.logprobs.model_logprobs: a model's head, read and checked.

Oracle: the model's own forward, ``log_softmax(model(...).logits)`` in float64, on tiny models
built from each family's own config (``AutoConfig.for_model``), float64, with the head's weights
scaled so that the logits are tens of nats wide (a skipped transform shows). The tolerance of a
token's log-prob is the check's own derived bound (``klpo.heads.rounding_bound``: the model's rounding
of a logit and the fused head's, see its docstring); in float64 it is ~1e-12 against gaps of nats.
The entropy and the KL follow from the same bound ``ε`` on every ``log pi(v)`` (first order):
``|δH| ≤ ε (1 + H)`` and ``|δKL| ≤ ε (1 + sum_v pi |log pi - log pi_ref|) + ε_ref``.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from klpo import heads  # noqa: E402
from klpo.logprobs import LogitTransform, model_logprobs  # noqa: E402

SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=96,
    head_dim=8,
)


def tiny(model_type: str, dtype=torch.float64, seed: int = 0, widen: float = 20.0, **extra):
    """A two-layer model of ``model_type`` from its own config, its logits ~``widen`` nats wide."""
    transformers.utils.logging.set_verbosity_error()
    kwargs = {**SMALL, **extra}
    if model_type == "phi":
        kwargs.pop("head_dim")
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        ids = torch.arange(8)[None] + 3
        z = heads.last_hidden(model, ids) @ model.get_output_embeddings().weight.t()
        model.get_output_embeddings().weight.mul_(widen / float(z.std()))
    return model


def own_logprobs(model, ids, mask=None, temperature=1.0):
    """float64 log_softmax of the model's own logits / T at ids[:, 1:], and the log pi rows."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double() / temperature
    log_pi = torch.log_softmax(logits, -1)
    return log_pi.gather(-1, ids[:, 1:, None])[..., 0], log_pi


def token_tol(model, ids):
    """The check's bound on |δ log pi(v)| per position of ids[0, 1:] (see the module notes)."""
    head = heads.read_head(model)
    with torch.no_grad():
        hidden = heads.last_hidden(model, ids)[0, :-1]
        logits = model(input_ids=ids).logits[0, :-1]
    return heads.rounding_bound(hidden, head, logits)


# ---------------------------------------------------------------------------------------------
# read_head.


def test_read_head_reads_each_transform_as_the_forward_applies_it():
    cases = {
        "llama": None,
        "phi": None,  # a head with a bias
        "gemma2": LogitTransform(1.0, 30.0),  # final_logit_softcapping's default
        "cohere": LogitTransform(0.0625, None),  # logit_scale's default
        "granite": LogitTransform(0.125, None),  # logits_scaling = 8 divides
        "hyperclovax": LogitTransform(8.0, None),  # logits_scaling = 8 multiplies
    }
    for kind, want in cases.items():
        extra = {"logits_scaling": 8.0} if kind in ("granite", "hyperclovax") else {}
        model = tiny(kind, **extra)
        head = heads.read_head(model)
        emb = model.get_output_embeddings()
        assert head.weight is emb.weight and head.bias is emb.bias, kind
        assert head.transform == want, kind
    assert heads.read_head(tiny("phi")).bias is not None
    # Gemma 3's text model has no cap unless its config sets one; gemma3_text then caps.
    assert heads.read_head(tiny("gemma3_text")).transform is None
    capped = tiny("gemma3_text", final_logit_softcapping=20.0)
    assert heads.read_head(capped).transform == LogitTransform(1.0, 20.0)


def test_read_head_refuses_heads_with_layers_of_their_own():
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, is_decoder=True,
    )  # fmt: skip
    model = transformers.BertLMHeadModel(config)
    with pytest.raises(heads.UnsupportedHead) as err:
        heads.read_head(model)
    msg = str(err.value)
    assert "BertLMHeadModel (bert)" in msg and "layers of its own" in msg
    assert "model.logits_path: model" in msg
    # The refusal is right: the plain head's log-probs are far from the model's own.
    weight, bias = model.get_output_embeddings().weight, model.get_output_embeddings().bias
    with pytest.raises(heads.HeadMismatch, match="output head's input is not the backbone's"):
        heads.check_head(model, heads.Head(weight, bias, None))


class _DuckLM(nn.Module):
    """A causal LM by duck typing: a config, output embeddings and a backbone."""

    def __init__(self, config, hidden=8, vocab=12):
        super().__init__()
        self.config = config
        self.base_model = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_read_head_refuses_a_transform_field_without_a_recipe():
    model = _DuckLM(types.SimpleNamespace(model_type="made_up", final_logit_softcapping=30.0))
    with pytest.raises(heads.UnsupportedHead, match=r"final_logit_softcapping = 30\.0.*guess"):
        heads.read_head(model)
    plain = _DuckLM(types.SimpleNamespace(model_type="made_up", logit_scale=1.0))
    assert heads.read_head(plain).transform is None  # a scale of 1 changes nothing
    two_heads = _DuckLM(types.SimpleNamespace(model_type="made_up"))
    two_heads.get_output_embeddings = lambda: nn.ModuleList([nn.Linear(8, 12), nn.Linear(8, 12)])
    with pytest.raises(heads.UnsupportedHead, match="not one linear layer"):
        heads.read_head(two_heads)
    alone = _DuckLM(types.SimpleNamespace(model_type="made_up"))
    alone.base_model = alone
    with pytest.raises(heads.UnsupportedHead, match="has no backbone"):
        heads.backbone(alone)


# ---------------------------------------------------------------------------------------------
# check_head: the load-time check.


@pytest.mark.parametrize("kind", ["llama", "phi", "gemma2", "cohere", "granite"])
def test_check_head_passes_the_models_own_head(kind):
    model = tiny(kind, **({"logits_scaling": 8.0} if kind == "granite" else {}))
    flags = [m.training for m in model.train().modules()]
    check = heads.check_head(model)
    assert [m.training for m in model.modules()] == flags  # training flags restored
    assert check.gap <= check.tolerance < 1e-9  # float64
    assert check.tokens == 7 and check.dtype == torch.float64
    assert check.architecture.endswith(f"({kind})")


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_check_head_refuses_the_head_without_its_transform(kind):
    model = tiny(kind, **({"logits_scaling": 8.0} if kind == "granite" else {}))
    head = heads.read_head(model)
    with pytest.raises(heads.HeadMismatch) as err:
        heads.check_head(model, heads.Head(head.weight, head.bias, None))
    msg = str(err.value)
    gap = float(msg.split("by up to ")[1].split(" nats")[0])
    assert gap > 1.0  # nats: what the issue measured (4.9-30.8) is of this size
    assert "changes its logits after the output head" in msg and "model.logits_path" in msg


def test_a_made_up_logit_transform_is_refused_at_check_time():
    base = type(tiny("llama"))

    class Tempered(base):
        """Llama whose forward bends its logits some way of its own."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + 0.05 * out.logits.square().clamp(max=100.0)
            return out

    model = Tempered(tiny("llama").config).double()
    model.load_state_dict(tiny("llama").state_dict())
    assert heads.read_head(model).transform is None  # llama's recipe: none; only the check knows
    with pytest.raises(heads.HeadMismatch) as err:
        heads.check_head(model)
    msg = str(err.value)
    assert msg.startswith("Tempered (llama): klpo's log-probs from the last hidden states")
    assert "differ from the model's own by up to" in msg and "nats" in msg
    assert "changes its logits after the output head in a way klpo does not know" in msg
    assert "set `model.logits_path: model`" in msg
    with pytest.raises(heads.HeadMismatch):
        model_logprobs(model, torch.tensor([[3, 4, 5, 6]]))  # the public function checks too


def test_check_head_in_bf16_allows_rounding_and_still_sees_a_skipped_cap():
    model = tiny("gemma2", dtype=torch.bfloat16, widen=40.0)
    check = heads.check_head(model)
    assert check.gap <= check.tolerance and check.dtype == torch.bfloat16
    head = heads.read_head(model)
    with pytest.raises(heads.HeadMismatch, match="bfloat16 rounding explains"):
        heads.check_head(model, heads.Head(head.weight, None, None))


# ---------------------------------------------------------------------------------------------
# model_logprobs.


@pytest.mark.parametrize("kind", ["llama", "phi", "gemma2", "cohere"])
def test_model_logprobs_matches_the_models_own_logits(kind):
    model, reference = tiny(kind), tiny(kind, seed=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: the last positions of row 1 are 0 and get no gradient
    out = model_logprobs(model, ids, mask, temperature=0.8, with_entropy=True, reference=reference)
    want, log_pi = own_logprobs(model, ids, mask, temperature=0.8)
    _, log_pi_ref = own_logprobs(reference, ids, mask, temperature=0.8)
    pi = log_pi.exp()
    ent = -(pi * log_pi).sum(-1)
    kl = (pi * (log_pi - log_pi_ref)).sum(-1)
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    # ε: the check's bound at T = 1 covers T = 0.8 after dividing by it (every term scales 1/T).
    eps = torch.stack([token_tol(model, ids[i : i + 1]) for i in range(2)]) / 0.8
    eps_ref = torch.stack([token_tol(reference, ids[i : i + 1]) for i in range(2)]) / 0.8
    d = (pi * (log_pi - log_pi_ref).abs()).sum(-1)
    for got, ref, tol in (
        (out.logp, want, eps),
        (out.entropy, ent, eps * (1 + ent)),
        (out.kl, kl, eps * (1 + d) + eps_ref),
    ):
        assert got.dtype == torch.float64 and got.shape == (2, 8)
        assert bool(((got - ref).abs() <= tol)[keep].all()), float((got - ref)[keep].abs().max())
        assert bool((got[~keep] == 0).all())
    # large, so that a slip would show
    assert float(kl[keep].detach().mean()) > 0.1 and float(want.detach().min()) < -5


def test_model_logprobs_gradient_is_the_models_own():
    model = tiny("gemma2", widen=8.0)
    ids = torch.tensor([[3, 17, 42, 8, 90, 5]])
    params = [p for p in model.parameters() if p.requires_grad]
    out = model_logprobs(model, ids, with_entropy=True)
    got = torch.autograd.grad((out.logp - 0.1 * out.entropy).sum(), params)
    want_logp, log_pi = own_logprobs(model, ids)
    ent = -(log_pi.exp() * log_pi).sum(-1)
    want = torch.autograd.grad((want_logp - 0.1 * ent).sum(), params)
    for g, w in zip(got, want, strict=True):
        # float64 throughout: both are the same derivative, rounded differently
        assert float((g - w).norm()) <= 1e-10 * float(w.norm()) + 1e-12


def test_model_logprobs_checks_each_model_once(monkeypatch):
    model = tiny("llama")
    calls = []
    check = heads.check_head
    monkeypatch.setattr(heads, "check_head", lambda m: calls.append(m) or check(m))
    ids = torch.tensor([[3, 4, 5]])
    for _ in range(3):
        model_logprobs(model, ids)
    model_logprobs(model, ids, check=False)
    assert calls == [model]


def test_model_logprobs_through_a_peft_wrapper():
    peft = pytest.importorskip("peft")
    model = tiny("cohere")
    ids = torch.tensor([[3, 40, 5, 71, 9]])
    want = model_logprobs(model, ids).logp
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert heads.read_head(wrapped).transform == LogitTransform(0.0625, None)
    torch.testing.assert_close(model_logprobs(wrapped, ids).logp, want, rtol=0, atol=1e-12)


def test_model_logprobs_errors_name_the_problem():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\] with L ≥ 2"):
        model_logprobs(model, torch.tensor([[3]]))
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        model_logprobs(model, torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\)"):
        model_logprobs(model, torch.tensor([[3, 4, 5, 6]]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="length must be at least 2"):
        heads.check_head(model, length=1)
    assert math.isfinite(heads.check_head(model, length=2).gap)
