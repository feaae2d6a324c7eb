"""The doctor's tables and statements against the frameworks themselves (peer tests).

Each section skips when its framework is absent. Side environments (never klpo's default
install), by the convention of tests/integrations: run this file with the side environment's
python and klpo's source on the path::

    PYTHONPATH=$PWD/src VERL_VENV/bin/python -m pytest tests/doctor/test_peers.py   # verl 0.9.1
    PYTHONPATH=$PWD/src TRL_VENV/bin/python -m pytest tests/doctor/test_peers.py    # TRL 1.16.0

OpenRLHF does not import without a GPU: its wheels are read as source. Unpack each version into
``$KLPO_OPENRLHF_SRC/<version>/`` (``pip download --no-deps openrlhf==V -d D``, then
``python -m zipfile -e D/openrlhf-V-*.whl $KLPO_OPENRLHF_SRC/V``) and set ``KLPO_OPENRLHF_SRC``;
any python then runs that section.

What is pinned: every table (each field the doctor reads included) equals the one the installed
framework gives, so a version bump lists each changed default; verl's ``kl_penalty`` value and
gradient for every name equal the doctor's model of the term (clamps, ``+`` straight-through);
verl's KL loss call site passes no old log-probs (no importance weight); verl's rollout
correction rejection keeps what klpo's trm_mask keeps under the doctor's keys; verl's iterator takes
the doctor's number of optimiser steps; the ReMax and GRPO credits; TRL's own config resolution
of the optimiser steps per generation and its refusal of unknown fields; OpenRLHF's own
``compute_approx_kl`` (value clamp, ``unbiased_gradient``) and the ``group_norm`` division, at
the file:line of the pinned versions.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from klpo import kl
from klpo.doctor import diagnose, read, tables
from klpo.doctor.report import _BASE, _term_at

pytestmark = pytest.mark.peer
F64 = torch.float64
EX = Path(__file__).parent / "fixtures" / "examples"

HAVE_VERL = importlib.util.find_spec("verl") is not None
HAVE_TRL = importlib.util.find_spec("trl") is not None
OPENRLHF_SRC = os.environ.get("KLPO_OPENRLHF_SRC")


def _doctors_term(term, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The doctor's model of a framework's clamped term and its derivative at each d."""
    pairs = [_term_at(_BASE[term.estimator], float(x), term) for x in d.detach().flatten()]
    value, grad = (torch.tensor(v, dtype=F64).view_as(d) for v in zip(*pairs, strict=True))
    return value, grad


needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="peer test: needs verl==0.9.1")
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="peer test: needs trl==1.16.0")
needs_openrlhf = pytest.mark.skipif(
    not OPENRLHF_SRC, reason="peer test: set KLPO_OPENRLHF_SRC to unpacked OpenRLHF wheels"
)


def _diff(shipped: dict, installed: dict) -> list[str]:
    """Every key whose default differs, in both directions."""
    out = []
    for key in sorted(set(shipped) | set(installed)):
        a, b = shipped.get(key, "<absent>"), installed.get(key, "<absent>")
        if a != b:
            out.append(f"{key}: doctor {a!r}, framework {b!r}")
    return out


def _same_table(fresh: dict) -> None:
    versions = tables.known_versions(fresh["framework"])
    assert fresh["version"] in versions, (
        f"{fresh['framework']} {fresh['version']} has no table; nearest shipped differs in: "
        + "; ".join(
            _diff(tables.load(fresh["framework"], versions[-1]).defaults, fresh["defaults"])
        )
    )
    shipped = tables.load(fresh["framework"], fresh["version"])
    assert _diff(shipped.defaults, json.loads(json.dumps(fresh["defaults"]))) == []


# ---------------------------------------------------------------------------------------------
# verl 0.9.1


@needs_verl
def test_verl_table_is_the_installed_verls():
    _same_table(tables.verl_table())


def _verl_term(name: str):
    """The doctor's term for verl's kl_loss_type ``name``."""
    cfg = {"actor_rollout_ref": {"actor": {"use_kl_loss": True, "kl_loss_type": name}}}
    from klpo.doctor.frameworks import verl as reader

    [term] = reader.read_settings(cfg, "peer").terms
    return term


VERL_NAMES = [
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]  # fmt: skip


@needs_verl
@pytest.mark.parametrize("name", VERL_NAMES)
def test_verl_kl_penalty_value_and_gradient(name):
    """verl's kl_penalty against the doctor's model of the term, value and gradient, across
    log-ratios that reach every clamp (d from -25 to 25); and against klpo's estimator where the
    doctor names the same one and no clamp binds."""
    from verl.trainer.ppo import core_algos

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(400, generator=g, dtype=F64) - 2.0
    d = torch.linspace(-25.0, 25.0, 400, dtype=F64)
    logp = (ref + d).requires_grad_(True)
    value = core_algos.kl_penalty(logp, ref, name)
    (grad,) = torch.autograd.grad(value.sum(), logp)

    term = _verl_term(name)
    mine, mine_grad = _doctors_term(term, d)
    torch.testing.assert_close(value.detach(), mine, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, mine_grad, rtol=1e-12, atol=1e-12)
    if name.endswith("+"):
        torch.testing.assert_close(grad, d)  # k2's gradient, d, everywhere: never clamped
    free = d.abs() < 2.0  # no clamp binds here
    ours = kl.estimate(term.estimator, logp.detach()[free], ref[free])
    torch.testing.assert_close(value.detach()[free], ours.to(F64), rtol=1e-6, atol=1e-6)


@needs_verl
def test_verl_full_raises_as_the_doctor_says(tmp_path):
    from verl.trainer.ppo import core_algos

    with pytest.raises(NotImplementedError):
        core_algos.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "full")
    cfg = tmp_path / "f.yaml"
    cfg.write_text("actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_type: full\n")
    assert any("NotImplementedError" in f["text"] for f in diagnose(cfg)["findings"])


@needs_verl
def test_verl_kl_loss_carries_no_importance_weight():
    """verl's KL-loss call site hands kl_penalty the current and reference log-probs only
    (verl/workers/utils/losses.py, ppo_loss), and kl_penalty takes nothing else: no pi_old."""
    from verl.trainer.ppo import core_algos
    from verl.workers.utils import losses

    assert list(inspect.signature(core_algos.kl_penalty).parameters) == [
        "logprob",
        "ref_logprob",
        "kl_penalty",
    ]
    src = inspect.getsource(losses.ppo_loss)
    assert "kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob" in src
    assert "policy_loss += kl_loss * config.kl_loss_coef" in src
    [t] = read(EX / "verl_grpo_qwen2_7b_math.sh").terms
    assert not t.corrected


@needs_verl
@pytest.mark.parametrize(
    ("option", "threshold"),
    [("seq_max_k3", 0.05), ("seq_mean_k3", 0.02), ("seq_mean_k1", "0.8_1.25"),
     ("seq_mean_k1", 1.1), ("seq_max_k2", 0.08)],
)  # fmt: skip
def test_verl_rejection_is_the_translated_trm_mask(option, threshold, tmp_path):
    """verl's own compute_rollout_rejection_mask (rollout_corr_helper.py) keeps exactly the
    completions klpo's trm_mask keeps under the keys the doctor prints for it; verl's threshold
    parsers read what the doctor's do."""
    from verl.trainer.ppo import rollout_corr_helper as rch

    from klpo import offpolicy
    from klpo.doctor.verl_rollout_corr import RC, is_threshold, rs_thresholds

    g = torch.Generator().manual_seed(1)
    log_r = torch.randn(400, 12, generator=g, dtype=F64) * 0.3
    log_r += torch.randn(400, 1, generator=g, dtype=F64) * 0.2
    mask = torch.rand(400, 12, generator=g) > 0.2
    mask[:, 0] = True
    kept, _ = rch.compute_rollout_rejection_mask(log_r, mask.to(F64), option, threshold)
    verl_keep = kept.sum(-1) == mask.sum(-1)
    cfg = tmp_path / "run.sh"
    cfg.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        f"{RC}.rollout_rs={option} {RC}.rollout_rs_threshold={threshold}\n"
    )
    algo = diagnose(cfg)["equivalent"]["config"]["algo"]
    klpo_keep = offpolicy.trm_mask(
        log_r, torch.zeros_like(log_r), mask, delta=algo["trm_delta"],
        statistic=algo["trm_statistic"], aggregate=algo["trm_aggregate"],
    ).any(-1)  # fmt: skip
    assert klpo_keep.tolist() == verl_keep.tolist()
    theirs = rch._parse_rollout_rs_thresholds([option], threshold)
    assert {o: (v["lower"], v["upper"]) for o, v in theirs.items()} == rs_thresholds(
        [option], threshold
    )
    for spec in (2.0, "0.5_5.0", "3"):
        assert rch._parse_rollout_is_threshold(spec) == is_threshold(spec)


@needs_verl
@pytest.mark.parametrize(
    ("batch", "mini", "n", "epochs"), [(512, 128, 5, 1), (1024, 1024, 8, 1), (64, 16, 2, 3)]
)
def test_verl_optimiser_steps_are_its_iterators(batch, mini, n, epochs, tmp_path):
    """The trainer passes mini_batch_size = ppo_mini_batch_size × rollout.n
    (ray_trainer.py) to tu.make_iterator, one optimiser step per mini-batch."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    td = TensorDict({"x": torch.zeros(batch * n, 1)}, batch_size=[batch * n])
    steps = sum(1 for _ in tu.make_iterator(td, mini_batch_size=mini * n, epochs=epochs, seed=0))
    cfg = tmp_path / "v.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "data": {"train_batch_size": batch},
                "actor_rollout_ref": {
                    "actor": {"ppo_mini_batch_size": mini, "ppo_epochs": epochs},
                    "rollout": {"n": n},
                },
            }
        )
    )
    assert diagnose(cfg)["updates_per_batch"] == steps


@needs_verl
def test_verl_remax_and_grpo_credit():
    """ReMax: returns-to-go of the penalised reward minus the greedy baseline (per token);
    GRPO: only the completion's sum counts (permuting the penalty within a row changes nothing)."""
    from verl.trainer.ppo import core_algos

    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=g, dtype=F64)
    mask = torch.ones(4, 6, dtype=F64)
    base = torch.randn(4, generator=g, dtype=F64)
    adv, _ = core_algos.compute_remax_outcome_advantage(rewards, base, mask)
    rtg = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, rtg - base[:, None])
    t = read(EX / "verl_remax_qwen3_8b.sh").terms[0]
    assert "returns-to-go" in t.reduction and "greedy" in t.reduction

    import numpy as np

    index = np.array(["a", "a", "b", "b"], dtype=object)
    a1, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask.bool(), index)
    a2, _ = core_algos.compute_grpo_outcome_advantage(rewards.flip(-1), mask.bool(), index)
    torch.testing.assert_close(a1, a2)
    assert "summed over the completion" in read(EX / "verl_rloo_qwen2_7b.sh").terms[0].reduction


# ---------------------------------------------------------------------------------------------
# TRL 1.16.0


@needs_trl
@pytest.mark.parametrize("kind", tables.TRL_KINDS)
def test_trl_table_is_the_installed_trls(kind):
    _same_table(tables.trl_table(kind))


def _trl_config(fields: dict, tmp_path):
    import trl

    return trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **fields)


STEP_CASES = [
    {},
    {"num_iterations": 3},
    {"gradient_accumulation_steps": 4},
    {"steps_per_generation": 4, "gradient_accumulation_steps": 1},
    {"steps_per_generation": 8, "gradient_accumulation_steps": 32},
    {
        "generation_batch_size": 64,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2,
    },
    {"generation_batch_size": 32, "per_device_train_batch_size": 8, "num_iterations": 2},
]


@needs_trl
@pytest.mark.parametrize("fields", STEP_CASES)
def test_trl_optimiser_steps_per_generation(fields, tmp_path):
    """TRL resolves steps_per_generation in GRPOConfig.__post_init__; the trainer generates
    every steps_per_generation × num_iterations micro-steps and steps the optimiser every
    gradient_accumulation_steps (GRPOTrainer._prepare_inputs): that many optimiser steps feed
    on one generation (at least one, on one process)."""
    c = _trl_config(fields, tmp_path)
    expected = max(1, c.steps_per_generation // c.gradient_accumulation_steps) * c.num_iterations
    cfg = tmp_path / "g.yaml"
    cfg.write_text(yaml.safe_dump(fields or {"beta": 0.0}))
    assert diagnose(cfg, framework="trl-grpo")["updates_per_batch"] == expected


@needs_trl
@pytest.mark.parametrize("name", sorted(p.name for p in EX.glob("trl_*.yaml")))
def test_trl_accepts_every_example_and_refuses_typos(name, tmp_path):
    fields = {k: v for k, v in yaml.safe_load((EX / name).read_text()).items()}
    refused = [f for f in diagnose(EX / name)["findings"] if "TRL refuses this config" in f["text"]]
    if refused:  # the doctor says TRL refuses it on one process: so does TRL
        with pytest.raises(ValueError, match="must be divisible by num_generations"):
            _trl_config(fields, tmp_path)
        return
    _trl_config(fields, tmp_path)  # TRL takes every field the doctor took
    with pytest.raises(TypeError, match="betta"):
        _trl_config({**fields, "betta": 0.04}, tmp_path)


@needs_verl
def test_verl_distillation_modes_and_refusals_are_verls_own():
    """The modes the doctor reads are verl's registry; the combinations it calls refused raise in
    verl's DistillationLossConfig; forward_kl_topk clamps at zero, the estimator modes are
    kl_penalty's (verl/trainer/distillation/losses.py)."""
    from verl.trainer.distillation import losses
    from verl.workers.config import DistillationLossConfig

    from klpo.doctor import verl_distill

    assert set(losses.DISTILLATION_LOSS_REGISTRY) == set(verl_distill.MODES)
    with pytest.raises(ValueError, match="k1"):
        DistillationLossConfig(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="Unsupported loss mode"):
        DistillationLossConfig(loss_mode="reverse_kl_topk")
    DistillationLossConfig(loss_mode="k1", use_policy_gradient=True)  # the PG form starts
    # the estimator modes are kl_penalty's names, read as klpo's estimators with the teacher in
    # the reference's place (the ref-KL peer tests check kl_penalty against klpo per name)
    assert all(
        losses.get_distillation_loss_settings(m).use_estimator for m in verl_distill.ESTIMATORS
    )
    assert losses.get_distillation_loss_settings("forward_kl_topk").use_topk


def _two_models(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden states and heads of a student (H 8) and a teacher (H 5) over a vocabulary of 11."""
    gen = torch.Generator().manual_seed(seed)
    hs, ws = torch.randn(6, 8, generator=gen), torch.randn(11, 8, generator=gen)
    ht, wt = torch.randn(6, 5, generator=gen), torch.randn(11, 5, generator=gen)
    return hs, ws, ht, wt


def _klpo_divergence(direction: str, zs: torch.Tensor, zt: torch.Tensor, beta: float):
    """klpo.teacher's divergence for a term's direction as the doctor reads it."""
    from klpo import teacher

    if direction == "reverse":
        return teacher.reverse_kl(zs, zt)
    if direction == "forward":
        return teacher.forward_kl(zs, zt)
    return teacher.jsd(zs, zt, beta)


@needs_trl
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_trl_distillation_beta_is_the_divergence_the_doctor_reads(beta, tmp_path):
    """TRL's own ChunkedDivergenceFunction (trl/kernels/chunked_divergence.py) computes, for each
    beta, the divergence the doctor names for it (klpo.teacher's, on the same logits)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    hs, ws, ht, wt = _two_models()
    got, _ = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta, 1.0)
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(f"teacher_model_name_or_path: T\nbeta: {beta}\n")
    (term,) = read(cfg).teacher_terms
    want = _klpo_divergence(term.direction, hs @ ws.T, ht @ wt.T, beta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@needs_trl
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_sdpo_alpha_is_the_direction_the_doctor_reads(alpha, tmp_path):
    """SDPO's compute_divergence passes its arguments to F.kl_div, which computes KL(target ‖
    input): alpha 1 is the reverse KL(pi_theta ‖ pi_T), as its docs say and the doctor reads (a
    review of huggingface/trl#4935 claimed the two were swapped)."""
    from trl.experimental.sdpo.loss_utils import compute_divergence

    hs, ws, ht, wt = _two_models(1)
    zs, zt = hs @ ws.T, ht @ wt.T
    got = compute_divergence(torch.log_softmax(zs, -1), torch.log_softmax(zt, -1), alpha)
    cfg = tmp_path / "sdpo.py"
    cfg.write_text(
        "from trl.experimental.sdpo import SDPOConfig\n"
        f"a = SDPOConfig(output_dir='o', distillation_mode='full_logits', distillation_alpha={alpha})\n"
    )
    (term,) = read(cfg).teacher_terms
    torch.testing.assert_close(
        got, _klpo_divergence(term.direction, zs, zt, alpha), rtol=1e-5, atol=1e-6
    )
    if alpha == 1.0:  # and not the forward KL, which the review's reading would give
        assert not torch.allclose(got, _klpo_divergence("forward", zs, zt, alpha), rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# OpenRLHF (read from the wheels' source)


def _openrlhf_root(version: str) -> Path | None:
    base = Path(OPENRLHF_SRC or "") / version
    hits = sorted(base.glob("**/openrlhf/cli/train_ppo_ray.py"))
    return hits[0].parents[1] if hits else None


@needs_openrlhf
@pytest.mark.parametrize("version", tables.known_versions("openrlhf"))
def test_openrlhf_table_is_the_parsers(version):
    root = _openrlhf_root(version)
    if root is None:
        pytest.skip(f"OpenRLHF {version} is not unpacked under KLPO_OPENRLHF_SRC")
    _same_table(tables.openrlhf_table(root, version))


def _compute_approx_kl(version: str):
    """OpenRLHF's own compute_approx_kl, loaded from models/utils.py (deepspeed stubbed: the
    module imports it for functions this test does not call)."""
    root = _openrlhf_root(version)
    if root is None:
        pytest.skip(f"OpenRLHF {version} is not unpacked under KLPO_OPENRLHF_SRC")
    saved = sys.modules.get("deepspeed")
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    try:
        spec = importlib.util.spec_from_file_location(
            f"openrlhf_utils_{version.replace('.', '_')}", root / "models" / "utils.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if saved is None:
            del sys.modules["deepspeed"]
        else:
            sys.modules["deepspeed"] = saved
    return mod.compute_approx_kl


def _openrlhf_term(version: str, estimator: str, unbiased: bool = False):
    flat = "init_kl_coef" in tables.load("openrlhf", version).defaults
    if flat:
        words = f"--use_kl_loss --kl_estimator {estimator}"
    else:
        words = f"--algo.kl.use_loss --algo.kl.estimator {estimator}"
        words += " --algo.kl.unbiased_gradient" if unbiased else ""
    from klpo.doctor.document import Document
    from klpo.doctor.frameworks import openrlhf

    text = f"python3 -m openrlhf.cli.train_ppo_ray {words}\n"
    [t] = openrlhf.read(Document(Path("peer.sh"), "peer", text, "script"), version).terms
    return t


@needs_openrlhf
@pytest.mark.parametrize("version", ["0.9.0", "0.11.2"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_openrlhf_compute_approx_kl_is_the_doctors_term(version, estimator):
    """models/utils.py compute_approx_kl (0.11.2: lines 69-127; 0.9.0: its k1/k2/k3 branches and
    the final clamp(min=-10, max=10)) against the doctor's term, value and gradient."""
    f = _compute_approx_kl(version)
    d = torch.linspace(-25.0, 25.0, 401, dtype=F64)
    ref = torch.full_like(d, -3.0)
    logp = (ref + d).requires_grad_(True)
    value = f(logp, ref, kl_estimator=estimator)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    term = _openrlhf_term(version, estimator)
    mine, mine_grad = _doctors_term(term, d)
    torch.testing.assert_close(value.detach().to(F64), mine, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.to(F64), mine_grad, rtol=1e-6, atol=1e-6)


@needs_openrlhf
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_openrlhf_unbiased_gradient_is_weighted_k2(estimator):
    """0.11.2's --algo.kl.unbiased_gradient: the clamped value, the gradient of w · d²/2 with
    w = clamp(pi_theta/pi_old, max=10), detached: klpo's `+` estimator with its off-policy
    weight (the doctor: estimator k1+/k2/k3+, corrected)."""
    f = _compute_approx_kl("0.11.2")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(300, generator=g, dtype=F64) - 2
    d = torch.randn(300, generator=g, dtype=F64)
    old = ref + d + 0.3 * torch.randn(300, generator=g, dtype=F64)
    logp = (ref + d).requires_grad_(True)
    value = f(logp, ref, log_probs_old=old, kl_estimator=estimator, unbiased_gradient=True)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    w = torch.exp(logp.detach() - old).clamp(max=10.0)
    # OpenRLHF computes in float32 (log_probs.float()): float32 rounding of |w·d| <= 30.
    torch.testing.assert_close(grad.to(F64), w * d, rtol=1e-5, atol=1e-6)
    plain = f(logp.detach(), ref, kl_estimator=estimator)
    torch.testing.assert_close(value.detach(), plain)
    t = _openrlhf_term("0.11.2", estimator, unbiased=True)
    assert (t.estimator, t.corrected) == ({"k1": "k1+", "k2": "k2", "k3": "k3+"}[estimator], True)


@needs_openrlhf
@pytest.mark.parametrize("version", ["0.9.0", "0.11.2"])
def test_openrlhf_group_norm_divides_by_the_group_std(version):
    """trainer/ppo_utils/experience_maker.py: the group_norm branch divides by the group's std
    (0.11.2: lines 273-274), and no_std_norm is read only in the batch whitening after it."""
    root = _openrlhf_root(version)
    if root is None:
        pytest.skip(f"OpenRLHF {version} is not unpacked")
    lines = (root / "trainer" / "ppo_utils" / "experience_maker.py").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if 'estimator == "group_norm"' in ln)
    assert "/ (rewards.std(-1, keepdim=True)" in lines[at + 1]
    uses = [i for i, ln in enumerate(lines) if "no_std_norm" in ln or "no_advantage_std_norm" in ln]
    assert uses and all(i > at + 1 for i in uses)
