"""The real-model tier: klpo.logprobs on SmolLM2-135M-Instruct (V = 49,152) and Gemma 3 270M
(V = 262,144) against each model's own float64 logits, on a few real prompts.

For each model, once: the float32 model's last hidden states and logits at every position of
three short prompts, and the same model's next-token distributions with four tokens after the
first dropped as the reference (a real pair of distributions of one model: the KL between them
is that of forgetting the prompt's start, not a toy's). Then the model in float64, whose
logits are the oracle. Three questions, each with its own tolerance:

1. klpo in float64 (logits path and fused path) equals the naive float64 ``log_softmax`` sums:
   the algorithm is exact (to ~1e-13 on values of order 10);
2. klpo in float32 (logits path and the fused head path, the one the trainer uses) equals the
   float64 arithmetic on the same float32 hidden states and head: the rounding of float32 sums
   over the vocabulary and the hidden size, bounded below;
3. the whole float32 model against the whole float64 model (the table of docs/real-models.md):
   what a float32 run's log-probs are worth, the model's own rounding through its layers
   included. Gradients: the fused path's gradient of logp + entropy + KL with respect to the
   hidden states against float64 autograd through ``log_softmax``.

The measurement loads each model once (module-scoped, then freed), so the tier costs about one
model load each.
"""

from __future__ import annotations

import gc

import pytest
import torch

from klpo import heads, logprobs
from klpo.train.models.load import load_causal_lm

pytestmark = pytest.mark.real

DROP = 4  # the reference forgets the first DROP tokens of each prompt

SMOLLM2_CHATS = [
    "What is 17 + 25? Answer with just the number.",
    "Name the capital of France in one word.",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
]
GEMMA_TEXTS = [
    "Question: What is 17 + 25? Think step by step, then give the answer.\nAnswer:",
    "The capital of France is Paris, the capital of Spain is Madrid, and the capital of Italy is",
    'def add(a, b):\n    """Return the sum of a and b."""\n    return',
]


def _naive(logits: torch.Tensor, logits_ref: torch.Tensor, tokens: torch.Tensor):
    """float64 log_softmax sums: logp of the tokens, entropy, KL(pi ‖ pi_ref), per position."""
    lp = torch.log_softmax(logits.double(), -1)
    lq = torch.log_softmax(logits_ref.double(), -1)
    p = lp.exp()
    return (
        lp.gather(-1, tokens[:, None])[:, 0],
        -(p * lp).sum(-1),
        (p * (lp - lq)).sum(-1),
    )


def _positions(model, seqs: list[torch.Tensor]):
    """``hidden [N, H]``, ``hidden_ref [N, H]``, ``tokens [N]``: the backbone's last hidden
    states at the positions of ``seqs`` from DROP + 1 on (targets: the next tokens), and the same
    model's at the same positions with the DROP tokens after the first removed (the first, a BOS
    or ``<|im_start|>``, is kept: a shorter context, not a broken one)."""
    hs, hrs, ys = [], [], []
    for ids in seqs:
        h = heads.last_hidden(model, ids[None])[0]
        h_ref = heads.last_hidden(model, torch.cat([ids[:1], ids[1 + DROP :]])[None])[0]
        hs.append(h[DROP + 1 : -1])  # position i predicts ids[i + 1] ...
        hrs.append(h_ref[1:-1])  # ... as the reference's position i - DROP does
        ys.append(ids[DROP + 2 :])
    return torch.cat(hs), torch.cat(hrs), torch.cat(ys)


def _measure(model_dir, tok, texts: list[str], chat: bool) -> dict:
    """Every value the tests compare, from one load of the model (float32, then float64 in
    place); the model is freed before it returns. Peak memory: the float64 model (2.1 GB for
    Gemma) and a few [N, V] float64 tensors."""
    if chat:  # the model's own template, its default system prompt included
        seqs = [
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
            )
            for t in texts
        ]
    else:
        seqs = tok(texts)["input_ids"]
    seqs = [torch.tensor(list(s)) for s in seqs]
    model = load_causal_lm(str(model_dir)).eval()
    head = heads.checked_head(model)  # the head, checked against the model's own forward
    out: dict = {"V": head.weight.shape[0], "transform": head.transform}
    n = 8  # positions of the gradient check
    with torch.no_grad():
        h, h_ref, y = _positions(model, seqs)
        w = head.weight
        z, z_ref = h @ w.T, h_ref @ w.T  # the model's float32 logits (checked_head: its own)
        out["tokens"] = y
        out["f32_logits"] = logprobs.from_logits(z, y, logits_ref=z_ref)
        out["f32_fused"] = logprobs.fused(h, w, y, hidden_ref=h_ref, weight_ref=w)
        # the float64 arithmetic on the same float32 inputs, in row chunks (no [N, V] float64
        # copy of the head's product beyond a chunk's)
        w64 = w.double()
        parts = [
            _naive(h[i : i + 8].double() @ w64.T, h_ref[i : i + 8].double() @ w64.T, y[i : i + 8])
            for i in range(0, len(y), 8)
        ]
        out["same_inputs64"] = tuple(torch.cat(c) for c in zip(*parts, strict=True))
        del z, z_ref, parts
    # the fused path's gradient of logp + entropy + KL at n positions; its float64 oracle by
    # autograd through log_softmax on the same float32 hidden states and head
    hg = h[:n].clone().requires_grad_(True)
    r = logprobs.fused(hg, w.detach(), y[:n], hidden_ref=h_ref[:n], weight_ref=w.detach())
    (r.logp.sum() + r.entropy.sum() + r.kl.sum()).backward()
    out["grad32"] = hg.grad
    h64 = h[:n].double().requires_grad_(True)
    lp, ent, kl = _naive(h64 @ w64.T, h_ref[:n].double() @ w64.T, y[:n])
    (lp.sum() + ent.sum() + kl.sum()).backward()
    out["grad64"] = h64.grad
    del r, hg, h64, lp, ent, kl, w64, w, head, h, h_ref
    gc.collect()
    model.double()  # in place: the float32 weights are freed
    with torch.no_grad():
        h64, h64_ref, _ = _positions(model, seqs)
        w64 = heads.read_head(model).weight
        z64, z64_ref = h64 @ w64.T, h64_ref @ w64.T
        out["oracle"] = _naive(z64, z64_ref, y)
        out["f64_logits"] = logprobs.from_logits(z64, y, logits_ref=z64_ref)
        out["f64_fused"] = logprobs.fused(h64, w64, y, hidden_ref=h64_ref, weight_ref=w64)
    del model, z64, z64_ref, w64
    gc.collect()
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, smollm2_tokenizer) -> dict:
    return _measure(smollm2_dir, smollm2_tokenizer, SMOLLM2_CHATS, chat=True)


@pytest.fixture(scope="module")
def gemma3(gemma3_dir, gemma3_tokenizer) -> dict:
    return _measure(gemma3_dir, gemma3_tokenizer, GEMMA_TEXTS, chat=False)


def _errors(got, want) -> tuple[float, float, float]:
    return tuple(float((g.double() - w).abs().max()) for g, w in zip(got, want, strict=True))


MODELS = ["smollm2", "gemma3"]


@pytest.fixture(params=MODELS)
def measured(request) -> dict:
    return request.getfixturevalue(request.param)


def test_the_measurement_is_of_the_real_models(smollm2, gemma3):
    assert smollm2["V"] == 49_152 and gemma3["V"] == 262_144  # Gemma through the fused head
    for m in (smollm2, gemma3):
        assert m["transform"] is None  # neither model scales or caps its logits
        logp, ent, kl = m["oracle"]
        assert len(logp) >= 40
        # a real model: peaked (most entropies well under log V) and the dropped context moves
        # its distributions by a real amount, not by rounding
        assert float(ent.median()) < 0.5 * torch.log(torch.tensor(float(m["V"])))
        assert float(kl.max()) > 0.1 and bool((kl >= -1e-12).all())


def test_float64_is_exact(measured):
    """klpo's two paths in float64 equal the naive float64 sums (algorithm, not precision)."""
    for path in ("f64_logits", "f64_fused"):
        for err in _errors(measured[path], measured["oracle"]):
            assert err < 1e-10, (path, err)


def test_float32_paths_match_float64_arithmetic_on_the_same_inputs(measured):
    """Both float32 paths on the model's float32 hidden states and head, against float64 on the
    same inputs: the rounding of float32 sums over the vocabulary (V <= 262,144 terms, chunked)
    and the hidden size. The logits path shifts each row by its maximum, so every term is at
    most 1 and its values carry a rounding of order sqrt(V) eps32 ~ 3e-5 in relative terms:
    1e-4 absolute per position (measured: <= 1.6e-5). The fused path shifts by the sampled
    token's own logit, so its sums hold terms up to exp(-logp(y)) and the entropy and KL come
    out as differences of numbers of size |logp(y)|: their error grows with the token's
    surprisal, bounded here by 1e-4 (1 + |logp(y)|) per position (measured: 4.7e-4 at logp(y) =
    -15.5 on SmolLM2, 0.28 of the bound; the logp itself stays within 1e-4)."""
    want = measured["same_inputs64"]
    surprisal = want[0].abs()
    for path, bound in (("f32_logits", 1e-4), ("f32_fused", 1e-4 * (1 + surprisal))):
        for name, got, ref in zip(("logp", "entropy", "kl"), measured[path], want, strict=True):
            err = (got.double() - ref).abs()
            tol = 1e-4 if name == "logp" else bound
            assert bool((err <= tol).all()), (path, name, float(err.max()))


def test_fused_gradient_matches_float64_autograd(measured):
    g32, g64 = measured["grad32"].double(), measured["grad64"]
    rel = float((g32 - g64).norm() / g64.norm())
    assert rel < 1e-4, rel


def test_float32_model_against_float64_model(measured):
    """The whole float32 forward (every layer in float32) against the float64 forward: what a
    float32 run's values are worth. Loose bounds (the model's rounding, not klpo's); the
    numbers are in docs/real-models.md."""
    for path in ("f32_logits", "f32_fused"):
        e_logp, e_ent, e_kl = _errors(measured[path], measured["oracle"])
        assert e_logp < 5e-2 and e_ent < 5e-2 and e_kl < 5e-2, (path, e_logp, e_ent, e_kl)
