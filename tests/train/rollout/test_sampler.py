"""The lean sampler: greedy equals ``generate``'s, and samples follow the exact next-token law."""

from __future__ import annotations

import pytest
import torch

from klpo.train.models.load import default_reference_path, load_causal_lm, load_tokenizer
from klpo.train.rollout.samplers import (
    Decoding,
    draw,
    generate,
    nucleus_logits,
    preallocate,
    sample_lean,
)

PROMPTS = ["12+7=", "3+45=", "99+99=", "1+2="]  # several token lengths: left padding is exercised


@pytest.fixture(scope="module")
def model_tok():
    path = str(default_reference_path())
    return load_causal_lm(path), load_tokenizer(path)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs``.

    Categories expected fewer than ``min_expected`` times are pooled into one, as the test's
    chi-square approximation needs; the p-value is the regularised upper incomplete gamma
    function Q(df/2, X²/2).
    """
    n = counts.sum()
    expected = n * probs.double()
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    x2 = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), x2 / 2.0))


def test_nucleus_by_hand():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0.5, 0.3} (0.5 < 0.7 <= 0.8); 0.5 keeps {0.5}
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = nucleus_logits(logits, 0.7).isfinite()
    assert kept.tolist() == [True, True, False, False]
    assert nucleus_logits(logits, 0.5).isfinite().tolist() == [True, False, False, False]
    assert nucleus_logits(logits, 0.96).isfinite().tolist() == [True, True, True, True]
    assert torch.equal(nucleus_logits(logits, 1.0), logits)
    # permuted input: the same tokens by value
    perm = torch.tensor([2, 0, 3, 1])
    assert nucleus_logits(logits[perm], 0.7).isfinite().tolist() == [False, True, False, True]


def test_greedy_equals_generate(model_tok):
    model, tok = model_tok
    lean = generate(
        model, tok, PROMPTS, [""] * 4, Decoding(group_size=2, max_new_tokens=5, greedy=True)
    )
    hf = generate(
        model,
        tok,
        PROMPTS,
        [""] * 4,
        Decoding(group_size=2, max_new_tokens=5, greedy=True, sampler="generate"),
    )
    assert torch.equal(lean.prompt_ids, hf.prompt_ids)
    assert torch.equal(lean.completion_ids, hf.completion_ids)
    assert torch.equal(lean.mask, hf.mask)
    assert lean.completions == hf.completions


@pytest.fixture(scope="module")
def random_lm():
    """A random tiny Llama: unlike the trained arithmetic model, its next-token laws are spread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_samples_follow_the_exact_next_token_law(random_lm, temperature, top_p):
    """First and second tokens of 6000 samples against the model's exact probabilities."""
    model = random_lm
    enc = {
        "input_ids": torch.tensor([[0, 0, 5, 9, 17]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1]]),
    }
    torch.manual_seed(1234)
    n = 6000
    toks = sample_lean(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        Decoding(group_size=n, max_new_tokens=2, temperature=temperature, top_p=top_p),
        eos_token_id=-1,
        pad_token_id=0,
    )
    pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(**enc, position_ids=pos).logits[0, -1].float()
    assert (logits.softmax(-1) > 0.01).sum() > 10  # a spread law, so the test has power
    p1 = nucleus_logits(logits / temperature, top_p).softmax(-1)
    counts1 = torch.bincount(toks[:, 0], minlength=p1.numel())
    assert chi_square_p(counts1, p1) > 1e-3
    # teeth: the same draws are rejected against a law at another temperature
    wrong = nucleus_logits(logits / (temperature * 1.5), top_p).softmax(-1)
    assert chi_square_p(counts1, wrong) < 1e-3

    # the second token, given the most frequent first token: checks the cache and positions
    first = int(counts1.argmax())
    rows = toks[:, 0] == first
    ids = torch.cat([enc["input_ids"], torch.tensor([[first]])], dim=1)
    att = torch.cat([enc["attention_mask"], torch.tensor([[1]])], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits2 = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[0, -1].float()
    p2 = nucleus_logits(logits2 / temperature, top_p).softmax(-1)
    counts2 = torch.bincount(toks[rows, 1], minlength=p2.numel())
    assert int(rows.sum()) > 500
    assert chi_square_p(counts2, p2) > 1e-3


def test_rows_stop_at_their_first_eos(random_lm):
    model = random_lm
    ids, att = torch.tensor([[3, 5, 9, 17]]), torch.ones(1, 4, dtype=torch.long)
    with torch.no_grad():
        probs = model(input_ids=ids, attention_mask=att).logits[0, -1].softmax(-1)
    eos = [int(i) for i in probs.argsort(descending=True)[:4]]  # EOS is likely at once
    torch.manual_seed(0)
    toks = sample_lean(
        model,
        ids,
        att,
        Decoding(group_size=64, max_new_tokens=30),
        eos_token_id=eos,
        pad_token_id=0,
    )
    is_eos = torch.isin(toks, torch.tensor(eos))
    assert is_eos.any(-1).all()  # every row stopped ...
    assert toks.shape[1] < 30  # ... and the loop with them, before max_new_tokens
    first = is_eos.long().argmax(-1)
    for row, f in zip(toks, first.tolist(), strict=True):
        assert (row[f + 1 :] == 0).all()  # nothing but padding after the first EOS


def test_draw_follows_softmax_and_never_draws_minus_inf():
    """The Gumbel-max draw against the exact softmax law: 20000 draws from each of two rows, one
    with masked (-inf) entries; chi-square at a fixed seed, with teeth."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 12, generator=gen, dtype=torch.float64) * 1.5
    logits[1, [0, 5, 6]] = float("-inf")
    torch.manual_seed(99)
    n = 20000
    toks = draw(logits.repeat_interleave(n, dim=0)).view(2, n)
    for row in range(2):
        p = logits[row].softmax(-1)
        counts = torch.bincount(toks[row], minlength=12)
        assert chi_square_p(counts, p) > 1e-3
        assert chi_square_p(counts, (logits[row] * 1.2).softmax(-1)) < 1e-3  # teeth
    assert not torch.isin(toks[1], torch.tensor([0, 5, 6])).any()


def test_preallocated_cache_decodes_like_the_concatenating_one(random_lm):
    """Logits of 6 cached decode steps (float64) with :func:`preallocate` equal those of the
    plain dynamic cache; a cache whose tensors were replaced (a batch select) falls back."""
    from klpo.train.models.load import cache_kwargs, output_cache

    model = random_lm.double()
    try:
        ids = torch.tensor([[0, 3, 5, 9], [4, 8, 2, 7]])
        att = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
        steps = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]])

        def decode(extra: int | None, select: bool = False) -> list[torch.Tensor]:
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True)
                cache = output_cache(out)
                if extra is not None:
                    preallocate(cache, extra)
                    assert all(type(x).__name__ == "_InPlaceLayer" for x in cache.layers)
                if select:
                    cache.batch_select_indices(torch.tensor([0, 1]))
                a, p, logits = att, pos[:, -1:], []
                for t in range(steps.shape[1]):
                    a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
                    p = p + 1
                    out = model(
                        input_ids=steps[:, t : t + 1],
                        attention_mask=a,
                        position_ids=p,
                        **cache_kwargs(model, cache),
                        use_cache=True,
                    )
                    cache = output_cache(out)
                    logits.append(out.logits[:, -1])
            return logits

        want = decode(None)
        for got in (decode(6), decode(3), decode(6, select=True)):  # 3: runs past its room
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    finally:
        random_lm.float()
