"""Tests for klpo.integrations.trl against TRL's GRPOTrainer (peer: skipped without TRL; run with
TRL 1.0.0, 1.8.0 and 1.16.0, docs/frameworks.md's version matrix).

Oracles: TRL's own ``GRPOTrainer._compute_loss`` (the stock loss, value and gradient) on a fixed
batch; klpo's library functions assembled by hand (``ppo_clip`` + beta · ``kl_loss``, reduced);
per-token log-probs computed here from the model's logits, independently of TRL's fused LM head;
k3 written out in float64. The model is a random 1-layer Llama (hidden 16) with a character
tokenizer, built in the test; nothing is downloaded.

Run with an environment that has TRL: ``PYTHONPATH=$PWD/src PEERS_VENV/bin/python -m pytest
tests/integrations``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klpo import losses
from klpo.advantages import broadcast_to_tokens
from klpo.reduce import reduce

F64 = torch.float64
BETA = 0.04
EPS_LOW, EPS_HIGH = 0.2, 0.28
MAX_LEN = 8  # max_completion_length


# ---------------------------------------------------------------------------------------------
# Without TRL (these run everywhere, CI included).


def test_import_without_trl_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    monkeypatch.delitem(sys.modules, "klpo.integrations.trl", raising=False)
    with pytest.raises(ImportError, match=r"pip install trl==1\.16\.0"):
        importlib.import_module("klpo.integrations.trl")


def test_import_klpo_never_imports_trl():
    src = str(Path(importlib.import_module("klpo").__file__).parents[1])
    code = (
        "import sys, klpo, klpo.integrations, klpo.kl, klpo.losses, klpo.reduce\n"
        "print(sorted(m for m in ('trl', 'accelerate') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# Fixtures: a tiny model, a trainer, a fixed batch.


def _tiny_model_dir(root: Path) -> Path:
    """A random Llama (hidden 16, 1 layer) and the character tokenizer of the built-in task."""
    from klpo.train.tools.make_reference import ReferenceConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    cfg = ReferenceConfig(
        hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2, num_kv_heads=1
    )
    torch.manual_seed(0)
    model = build_model(cfg, tok)
    path = root / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def reward_chars(completions, **kwargs):
    """A reward that varies between random completions: mean of (code point mod 7) / 7."""
    return [sum(ord(c) % 7 for c in s) / (7 * max(1, len(s))) for s in completions]


def reward_tool(x: int) -> int:
    """Add one.

    Args:
        x: a number.
    """
    return x + 1


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """(trl, klpo.integrations.trl, model dir, make_trainer)."""
    trl = pytest.importorskip("trl")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    integration = importlib.import_module("klpo.integrations.trl")
    from datasets import Dataset

    root = tmp_path_factory.mktemp("trl")
    path = _tiny_model_dir(root)
    dataset = Dataset.from_dict({"prompt": [f"Q{i}: say a" for i in range(16)]})

    def make_trainer(
        cls=None,
        *,
        max_steps=2,
        perturb=0.0,
        num_iterations=1,
        beta=BETA,
        config=None,
        **klpo_kwargs,
    ):
        from transformers import AutoTokenizer

        cfg = trl.GRPOConfig(
            output_dir=str(root / "out"),
            max_steps=max_steps,
            num_iterations=num_iterations,
            beta=beta,
            epsilon=EPS_LOW,
            epsilon_high=EPS_HIGH,
            num_generations=4,
            per_device_train_batch_size=8,
            max_completion_length=MAX_LEN,
            learning_rate=1e-2,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=0,
            use_cpu=True,
            bf16=False,
            **(config or {}),
        )
        trainer = (cls or integration.KLPOGRPOTrainer)(
            model=str(path),
            reward_funcs=reward_chars,
            args=cfg,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(path),
            **klpo_kwargs,
        )
        if perturb:
            # Move the policy away from the reference so that the KL is not zero at step 1.
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(perturb * torch.randn(p.shape, generator=gen))
        return trainer

    return trl, integration, path, make_trainer


def token_logps(model, inputs) -> torch.Tensor:
    """log pi(y_t) of the completion tokens from the model's plain logits (not TRL's fused head)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    t = inputs["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attn).logits[:, -t - 1 : -1]
    logq = torch.log_softmax(logits.float(), dim=-1)  # temperature 1.0
    return logq.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)


def fixed_batch(model, *, lengths=(6, 4, 5, 2), seed=0):
    """Fixed prompts, completions, advantages and log-probs; old and ref are off the policy."""
    gen = torch.Generator().manual_seed(seed)
    b, p, t = len(lengths), 3, max(lengths)
    prompt_ids = torch.randint(4, 100, (b, p), generator=gen)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[1, 0] = 0  # one left-padded prompt
    prompt_ids[1, 0] = 0
    completion_ids = torch.randint(4, 100, (b, t), generator=gen)
    completion_mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()
    completion_ids = torch.where(completion_mask.bool(), completion_ids, 0)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=gen),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        logp = token_logps(model, inputs)
    # Ratios exp(logp - old) spread over ~[0.5, 2]: both clips bind on some tokens.
    inputs["old_per_token_logps"] = logp + 0.4 * torch.randn(b, t, generator=gen)
    inputs["ref_per_token_logps"] = logp + 0.5 * torch.randn(b, t, generator=gen)
    return inputs


@pytest.fixture(scope="module")
def trainer(peer):
    _, _, _, make_trainer = peer
    tr = make_trainer()
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by the HF training loop; we call the loss
    return tr


def value_and_grad(loss_fn, model):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_fn()
    grads = torch.autograd.grad(loss, params)
    return loss.detach().double(), torch.cat([g.flatten() for g in grads]).double()


def assert_same(a, b, *, what):
    """Value and gradient equal to float32 rounding.

    The per-token terms are O(1) (advantages ~ N(0, 1), ratios near 1) and TRL sums them in
    float32, so the value is compared to 1e-5 (~80 float32 ulps of an O(1) term) absolutely or
    relatively, whichever is larger: the total can be much smaller than its terms.
    """
    (va, ga), (vb, gb) = a, b
    assert abs(va - vb).item() <= 1e-5 * max(1.0, abs(vb.item())), f"{what}: {va} vs {vb}"
    err = (ga - gb).norm() / gb.norm().clamp_min(1e-12)
    assert err.item() < 1e-5, f"{what}: gradient relative error {err.item():.2e}"


def _trl_version(trl) -> tuple[int, int]:
    major, minor = (
        int("".join(c for c in p if c.isdigit()) or 0) for p in trl.__version__.split(".")[:2]
    )
    return major, minor


def _differs_here(peer, loss_type) -> bool:
    """Whether this TRL reduces ``loss_type`` otherwise than TRL 1.16 (the integration's table)."""
    rows = peer[1].LOSS_TYPE_SINCE
    return any(lt == loss_type and _trl_version(peer[0]) < since for lt, since, _ in rows)


# ---------------------------------------------------------------------------------------------
# Construction.


@pytest.mark.peer
def test_rejects_unsupported_estimators_and_placements(peer):
    _, integration, _, make_trainer = peer
    assert "full" not in integration.ESTIMATORS
    assert set(integration.ESTIMATORS) | {"full"} == set(
        importlib.import_module("klpo.kl").ESTIMATORS
    )
    with pytest.raises(ValueError, match="logits"):
        make_trainer(kl_estimator="full")
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'"):
        make_trainer(kl_estimator="k4")
    with pytest.raises(ValueError, match="kl_placement='advantage'"):
        make_trainer(kl_estimator="k1", kl_placement="advantage")
    with pytest.raises(ValueError, match=r"beta is 0\.0.*set GRPOConfig\(beta=\.\.\.\) > 0"):
        make_trainer(beta=0.0, kl_estimator="k3+")
    plain = make_trainer(beta=0.0)  # no estimator asked for: plain TRL, no reference, no KL
    assert plain.ref_model is None and plain.reward_func_names == ["reward_chars"]
    with pytest.raises(ValueError, match="not supported with tools"):
        make_trainer(kl_estimator="k1", kl_placement="reward", tools=[reward_tool])


@pytest.mark.peer
def test_a_loss_type_this_trl_reduces_otherwise_is_refused(peer):
    """luspo before TRL 1.10 weights unmasked per-token losses, which klpo's KL term (reduced as
    1.16 reduces) would not match: refused there, constructed from 1.10 on."""
    _, integration, _, make_trainer = peer
    (row,) = [r for r in integration.LOSS_TYPE_SINCE if r[0] == "luspo"]
    config = {"loss_type": "luspo", "importance_sampling_level": "sequence"}
    if _differs_here(peer, "luspo"):
        with pytest.raises(ValueError, match=r"loss_type='luspo' with TRL .*use TRL >= 1\.10"):
            make_trainer(config=config, kl_estimator="k3")
    else:
        assert make_trainer(config=config, kl_estimator="k3").loss_type == "luspo"
    assert row[1] == (1, 10)


@pytest.mark.peer
def test_default_estimator_is_trls_own_choice(peer, trainer):
    # TRL's use_bias_correction_kl defaults to True from 1.10 (its KL term the IS-weighted k3),
    # to False before (plain k3); the default estimator follows whichever TRL says.
    new = _trl_version(peer[0]) >= (1, 10)
    assert trainer.args.use_bias_correction_kl is new
    assert trainer.kl_estimator == ("k3_is" if new else "k3")
    assert trainer.kl_placement == "loss"


# ---------------------------------------------------------------------------------------------
# (b) TRL's stock GRPO loss equals klpo's assembly from library functions.

# TRL loss_type -> klpo reduction mode, as read from TRL 1.16's _compute_loss (written here, not
# imported from the integration, so the test checks the integration's table too).
MODES = {
    "grpo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "bnpo": "token-mean",
}


def stock_loss(peer, trainer, inputs, *, loss_type, bias_correction):
    trl = peer[0]
    trainer.loss_type = loss_type
    trainer.args.use_bias_correction_kl = bias_correction
    return lambda: trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)


@pytest.mark.peer
@pytest.mark.parametrize("loss_type", list(MODES))
@pytest.mark.parametrize("bias_correction", [False, True])
def test_stock_trl_loss_equals_klpo_assembly(peer, trainer, loss_type, bias_correction):
    model = trainer.model
    inputs = fixed_batch(model)
    mask = inputs["completion_mask"].bool()
    adv = broadcast_to_tokens(inputs["advantages"], mask)
    old, ref = inputs["old_per_token_logps"], inputs["ref_per_token_logps"]

    def klpo_loss():
        logp = token_logps(model, inputs)
        pg = losses.ppo_clip(logp, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
        if bias_correction:
            # TRL's k3 · exp(logp - old), ratio differentiable, token level: klpo's k3_is.
            term = losses.kl_loss("k3_is", logp, ref, logp_old=old)
        else:
            # TRL's k3 takes no weight for off-policy tokens: kl_loss with no logp_old.
            term = losses.kl_loss("k3", logp, ref)
        return reduce(pg + BETA * term, mask, MODES[loss_type], max_len=MAX_LEN)

    theirs = value_and_grad(
        stock_loss(peer, trainer, inputs, loss_type=loss_type, bias_correction=bias_correction),
        model,
    )
    assert_same(value_and_grad(klpo_loss, model), theirs, what=f"{loss_type}")


@pytest.mark.peer
def test_trl_delta_is_klpo_dual_clip(peer, trainer):
    # TRL's two-sided clipping caps the ratio at delta in the first branch of the min; for
    # delta > 1 + epsilon_high that is the dual clip, min(loss, -delta · A) on tokens with A < 0.
    model = trainer.model
    inputs = fixed_batch(model, seed=4)
    with torch.no_grad():
        logp = token_logps(model, inputs)
    shift = torch.tensor([1.5, -0.5, 0.0, 1.5, 0.1, -1.5])  # ratios e^1.5 ≈ 4.5 > delta = 3
    inputs["old_per_token_logps"] = logp - shift
    inputs["advantages"] = torch.tensor([-1.0, 0.7, -0.3, 1.2])
    mask = inputs["completion_mask"].bool()
    adv = broadcast_to_tokens(inputs["advantages"], mask)
    old, ref = inputs["old_per_token_logps"], inputs["ref_per_token_logps"]
    assert bool(((logp - old).exp() > 3.0).logical_and(adv < 0).logical_and(mask).any())

    def klpo_loss():
        lp = token_logps(model, inputs)
        pg = losses.ppo_clip(lp, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH, dual_clip=3.0)
        term = losses.kl_loss("k3_is", lp, ref, logp_old=old)
        return reduce(pg + BETA * term, mask, "token-mean")

    trainer.args.delta = 3.0
    try:
        theirs = value_and_grad(
            stock_loss(peer, trainer, inputs, loss_type="dapo", bias_correction=True), model
        )
    finally:
        trainer.args.delta = None
    assert_same(value_and_grad(klpo_loss, model), theirs, what="delta")


@pytest.mark.peer
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_empty_completion_is_where_trl_and_klpo_reductions_differ(peer, trainer, loss_type):
    # TRL averages grpo over all B rows and divides dr_grpo by B · max_completion_length, counting
    # a completion with no valid token; klpo (like verl) counts only the S rows that take part.
    # So TRL = klpo · S / B exactly; here B = 4, S = 3.
    model = trainer.model
    inputs = fixed_batch(model, lengths=(6, 0, 5, 2))
    mask = inputs["completion_mask"].bool()
    adv = broadcast_to_tokens(inputs["advantages"], mask)
    ref = inputs["ref_per_token_logps"]
    del inputs["old_per_token_logps"]  # on-policy

    def klpo_loss():
        logp = token_logps(model, inputs)
        pg = losses.ppo_clip(logp, logp.detach(), adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
        per_token = pg + BETA * losses.kl_loss("k3", logp, ref)
        return reduce(per_token, mask, MODES[loss_type], max_len=MAX_LEN) * 3 / 4

    theirs = value_and_grad(
        stock_loss(peer, trainer, inputs, loss_type=loss_type, bias_correction=False), model
    )
    assert_same(value_and_grad(klpo_loss, model), theirs, what=loss_type)


# ---------------------------------------------------------------------------------------------
# The override: KLPOGRPOTrainer's loss is stock TRL's where they mean the same thing.

ALL_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def klpo_trainer_loss(trainer, inputs, *, loss_type, estimator, placement="loss"):
    trainer.loss_type = loss_type
    trainer.kl_estimator = estimator
    trainer.kl_placement = placement
    return lambda: trainer._compute_loss(trainer.model, inputs)


@pytest.mark.peer
@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_override_reproduces_stock_trl_for_every_loss_type(peer, trainer, loss_type):
    if _differs_here(peer, loss_type):
        pytest.skip(f"TRL {peer[0].__version__} reduces {loss_type} otherwise: refused (next test)")
    model = trainer.model
    # An empty completion is in the batch: TRL counts its row in grpo, sapo, luspo and dr_grpo.
    off_policy = fixed_batch(model, lengths=(6, 0, 5, 2), seed=1)
    on_policy = {k: v for k, v in off_policy.items() if k != "old_per_token_logps"}
    kl_log = trainer._metrics["train"]["kl"]
    # TRL's default (use_bias_correction_kl=True) is klpo's k3_is, on- and off-policy.
    for inputs in (on_policy, off_policy):
        theirs = value_and_grad(
            stock_loss(peer, trainer, inputs, loss_type=loss_type, bias_correction=True), model
        )
        ours = value_and_grad(
            klpo_trainer_loss(trainer, inputs, loss_type=loss_type, estimator="k3_is"), model
        )
        assert_same(ours, theirs, what=f"{loss_type} k3_is")
        assert kl_log[-1] == pytest.approx(kl_log[-2], rel=1e-5)  # the logged `kl` too
    # Plain k3 agrees on-policy (off-policy klpo adds the detached weight, next test).
    theirs = value_and_grad(
        stock_loss(peer, trainer, on_policy, loss_type=loss_type, bias_correction=False), model
    )
    ours = value_and_grad(
        klpo_trainer_loss(trainer, on_policy, loss_type=loss_type, estimator="k3"), model
    )
    assert_same(ours, theirs, what=f"{loss_type} k3")
    # Reward placement: the loss has no KL term, i.e. TRL's loss at beta = 0.
    trainer.beta = 0.0
    try:
        theirs = value_and_grad(
            stock_loss(peer, trainer, off_policy, loss_type=loss_type, bias_correction=False),
            model,
        )
    finally:
        trainer.beta = BETA
    ours = value_and_grad(
        klpo_trainer_loss(
            trainer, off_policy, loss_type=loss_type, estimator="k1", placement="reward"
        ),
        model,
    )
    assert_same(ours, theirs, what=f"{loss_type} reward placement")


@pytest.mark.peer
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_off_policy_k3_gets_the_detached_weight(peer, trainer, loss_type):
    # klpo's kl_loss("k3", logp_old=old) is sg(w) · k3, w = exp(logp - old); stock TRL has no w.
    model = trainer.model
    inputs = fixed_batch(model, seed=2)
    mask = inputs["completion_mask"].bool()
    adv = broadcast_to_tokens(inputs["advantages"], mask)
    old, ref = inputs["old_per_token_logps"], inputs["ref_per_token_logps"]

    def by_hand():
        logp = token_logps(model, inputs)
        lp, lr = logp.double(), ref.double()
        w = torch.exp(lp - old.double()).detach()
        k3 = torch.exp(lr - lp) - (lr - lp) - 1  # written out in float64
        pg = losses.ppo_clip(logp, old, adv, clip_low=EPS_LOW, clip_high=EPS_HIGH)
        return reduce(pg.double() + BETA * w * k3, mask, MODES[loss_type], max_len=MAX_LEN)

    ours = value_and_grad(
        klpo_trainer_loss(trainer, inputs, loss_type=loss_type, estimator="k3"), model
    )
    assert_same(ours, value_and_grad(by_hand, model), what=loss_type)
    stock = value_and_grad(
        stock_loss(peer, trainer, inputs, loss_type=loss_type, bias_correction=False), model
    )
    assert abs(ours[0] - stock[0]).item() > 1e-4  # the weight matters on this batch


@pytest.mark.peer
def test_k3_plus_logs_k3_and_descends_k2(trainer):
    # Straight-through: the loss value of k3, the gradient of k2 (on-policy, so w = 1).
    model = trainer.model
    inputs = {k: v for k, v in fixed_batch(model, seed=3).items() if k != "old_per_token_logps"}
    plus = value_and_grad(
        klpo_trainer_loss(trainer, inputs, loss_type="dapo", estimator="k3+"), model
    )
    k3 = value_and_grad(klpo_trainer_loss(trainer, inputs, loss_type="dapo", estimator="k3"), model)
    k2 = value_and_grad(klpo_trainer_loss(trainer, inputs, loss_type="dapo", estimator="k2"), model)
    assert plus[0].item() == pytest.approx(k3[0].item(), rel=1e-6)
    assert_same((k2[0] * 0, plus[1]), (k2[0] * 0, k2[1]), what="k3+ gradient")
    assert (plus[1] - k3[1]).norm() > 1e-3 * k3[1].norm()


# ---------------------------------------------------------------------------------------------
# (a) Training, end to end on CPU.


@pytest.mark.peer
def test_trains_two_steps_with_k3_plus_in_the_loss(peer):
    # num_iterations = 2: step 1 generates a batch (on-policy), step 2 takes a second gradient step
    # on the same batch, whose tokens now come from pi_old ≠ pi_theta, so klpo's term is
    # sg(w) · k3+ with w = pi_theta / pi_old, and its logged value is the token mean of w · k3.
    _, integration, _, make_trainer = peer

    class Recording(integration.KLPOGRPOTrainer):
        """Records, before each loss, the value the step should log (an independent oracle)."""

        expected_kl: list[float]
        weights: list[float]

        def _compute_loss(self, model, inputs):
            with torch.no_grad():
                lp = token_logps(model, inputs).double()
            lr = inputs["ref_per_token_logps"].double()
            old = inputs["old_per_token_logps"].double()  # TRL keeps them: num_iterations > 1
            mask = inputs["completion_mask"].bool()
            w = torch.exp(lp - old)
            k3 = torch.exp(lr - lp) - (lr - lp) - 1  # the value of k3+
            self.weights.append((w[mask] - 1).abs().max().item())
            self.expected_kl.append(((w * k3)[mask].sum() / mask.sum()).item())
            return super()._compute_loss(model, inputs)

    Recording.expected_kl, Recording.weights = [], []
    tr = make_trainer(
        Recording, perturb=0.05, num_iterations=2, kl_estimator="k3+", kl_placement="loss"
    )
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    logs = [h for h in tr.state.log_history if "kl" in h]
    assert len(logs) == 2 and len(Recording.expected_kl) == 2
    assert Recording.weights[0] < 1e-5  # step 1: pi_old = pi_theta (float32 recomputation)
    assert Recording.weights[1] > 1e-3  # step 2: the first update moved the policy
    for log, expected in zip(logs, Recording.expected_kl, strict=True):
        assert expected > 1e-4  # the perturbed policy is away from the reference
        assert log["kl"] == pytest.approx(expected, rel=1e-5)
    changed = [n for n, p in tr.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)


@pytest.mark.peer
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_trains_one_step_with_k1_in_the_reward(peer, num_iterations):
    # num_iterations = 1: TRL computes no old log-probs, the penalty's sampling-policy log-probs
    # come from one extra no-grad forward; 2: TRL computes them and they are reused.
    _, integration, _, make_trainer = peer

    class Recording(integration.KLPOGRPOTrainer):
        """Records the kl_penalty rewards and an independent k1 oracle at rollout time."""

        seen: list[tuple[int, list[float], list[float]]]

        def _kl_penalty(self, prompts, completions, **kwargs):
            calls = len(self._klpo_rollout)
            out = super()._kl_penalty(prompts, completions, **kwargs)
            ref = self._klpo_rollout[-1]
            t = ref.logits_to_keep
            inputs = {
                "prompt_ids": ref.input_ids[:, :-t],
                "prompt_mask": ref.attention_mask[:, :-t],
                "completion_ids": ref.input_ids[:, -t:],
                "completion_mask": ref.attention_mask[:, -t:],
            }
            with torch.no_grad():
                lp = token_logps(self.model, inputs).double()
            mask = inputs["completion_mask"].bool()
            k1 = torch.where(mask, lp - ref.logps.double(), 0.0)
            self.seen.append((calls, out, (-k1.sum(-1)).tolist()))
            return out

    Recording.seen = []
    tr = make_trainer(
        Recording,
        max_steps=1,
        perturb=0.05,
        num_iterations=num_iterations,
        kl_estimator="k1",
        kl_placement="reward",
    )
    assert tr.reward_func_names[-1] == "kl_penalty"
    assert tr.reward_weights[-1].item() == pytest.approx(BETA)
    tr.train()
    ((calls, got, expected),) = Recording.seen
    assert calls == num_iterations  # [ref] or [old, ref]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert max(abs(v) for v in expected) > 1e-2
    (log,) = [h for h in tr.state.log_history if "kl" in h]
    penalty = log["rewards/kl_penalty/mean"]
    assert penalty == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    # TRL's logged reward is the weighted sum: the task reward minus beta · the sequence KL.
    assert log["reward"] == pytest.approx(
        log["rewards/reward_chars/mean"] + BETA * penalty, rel=1e-5
    )


# ---------------------------------------------------------------------------------------------
# loss_type_normaliser by hand.


@pytest.mark.peer
def test_loss_type_normaliser_by_hand(peer):
    _, integration, _, _ = peer
    norm = integration.loss_type_normaliser
    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    kw = {"max_completion_length": 8}
    assert norm("grpo", mask, accumulation_steps=2, **kw).item() == 6.0  # B · GA = 3 · 2
    assert norm("bnpo", mask, accumulation_steps=2, **kw).item() == 10.0  # 5 tokens · 2
    assert norm("dr_grpo", mask, accumulation_steps=2, **kw).item() == 48.0  # 3 · 8 · 2
    assert norm("luspo", mask, training=False, accumulation_steps=2, **kw).item() == 3.0
    # dapo: N = 40 tokens in the generation batch, 2 processes, GA 4, 2 steps per generation:
    # 40 / 2 · 4 / 2 = 40; in eval, 40 / 2 = 20.
    dapo = {"num_items_in_batch": torch.tensor(40), "num_processes": 2, **kw}
    assert norm("dapo", mask, accumulation_steps=4, steps_per_generation=2, **dapo).item() == 40.0
    assert norm("dapo", mask, training=False, **dapo).item() == 20.0
    assert norm("bnpo", torch.zeros(2, 3, dtype=torch.bool), **kw).item() == 1.0  # max(0, 1)
    with pytest.raises(ValueError, match="unknown TRL loss_type 'ppo'"):
        norm("ppo", mask, **kw)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        norm("cispo", mask, **kw)
    assert set(integration.LOSS_TYPE_MODES) == set(ALL_LOSS_TYPES)
    for loss_type, mode in MODES.items():
        assert integration.LOSS_TYPE_MODES[loss_type] == mode
