"""``klpo probe`` (klpo.measure.probe, klpo.cli.probe) on the shipped model and on broken ones.

Oracles: the model's own logits, log-softmaxed in float64 one unpadded sequence at a time (every
layout's log-probs must be those); the identities at step 0 (ratio 1, KL 0, exactly); and models
broken on purpose (a forward that reads the batch's size, one that ignores position ids, one
with dropout in train mode, a difference only float32 makes), each caught by its row and exit 1.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers.models.llama import modeling_llama
from typer.testing import CliRunner

from klpo.cli import app
from klpo.measure import MeasureError
from klpo.measure import probe as P
from klpo.measure.models import same_weights
from klpo.train.models.load import default_reference_path, load_causal_lm, load_tokenizer

REF = str(default_reference_path())
runner = CliRunner()
KW = dict(prompts=3, samples=2, max_new_tokens=6)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Prompts of three lengths: the rows are padded, so the layouts differ."""
    f = tmp_path_factory.mktemp("data") / "prompts.txt"
    f.write_text("12+34=\n7+8=\n156+219=\n")
    return str(f)


def _status(result):
    return {r["check"]: r["status"] for r in result["rows"]}


def _row(result, name):
    return next(r for r in result["rows"] if r["check"] == name)


def test_every_check_passes_on_the_shipped_model(prompts):
    res = P.probe(REF, data=prompts, **KW)
    assert res["passed"] and res["sequences"] == 6
    for name in ("ratio", "kl_self"):  # klpo computes the same numbers twice: exactly equal
        assert _row(res, name)["value"] == 0.0 and _row(res, name)["status"] == "pass"
    for name in P.INVARIANCES:
        assert _row(res, name)["status"] == "pass" and _row(res, name)["value"] <= 1e-4
    assert _status(res)["reference"] == _status(res)["adapters_off"] == "skip"
    assert _row(res, "engine")["note"] == "vLLM is not installed here"


def test_every_layout_gives_the_models_own_log_probs(prompts):
    """Each path against the oracle: the model's logits of one unpadded sequence, float64."""
    policy, tok = load_causal_lm(REF), load_tokenizer(REF)
    from klpo.measure.prompts import _prompt_codec
    from klpo.train.models.backbone import Backbone
    from klpo.train.rollout.samplers import Decoding, generate

    texts = ["12+34=", "7+8=", "156+219="]
    torch.manual_seed(0)
    codec = _prompt_codec(tok, policy, texts, "t")
    rollout = generate(policy, tok, texts, [""] * 3, Decoding(group_size=2, max_new_tokens=6), codec=codec)  # fmt: skip
    oracle = torch.zeros(rollout.mask.shape, dtype=torch.float64)
    exact = load_causal_lm(REF).double().eval()
    for b, (p, c) in enumerate(P._sequences(rollout)):
        with torch.no_grad():
            logits = exact(torch.tensor([p + c])).logits[0]
        logp = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) - 1 + len(c)]
        oracle[b, : len(c)] = logp[torch.arange(len(c)), torch.tensor(c)]
    backbone = Backbone(policy.eval())
    paths = {"trainer": lambda bb, r: P._trainer_logp(bb, r), **P.INVARIANCES}
    for name, path in paths.items():
        got = path(backbone, rollout).double()
        err = (got - oracle).abs()[rollout.mask].max()
        assert err < 1e-5, (name, float(err))
    # An off-by-one is caught: the oracle shifted by a position is far away.
    shifted = torch.roll(oracle, 1, dims=1)
    assert (shifted - oracle).abs()[rollout.mask].max() > 1e-2


def _patched(monkeypatch, change):
    """LlamaModel.forward with ``change(self, kwargs)`` applied to its arguments or output."""
    forward = modeling_llama.LlamaModel.forward

    def wrapped(self, *args, **kwargs):
        return change(forward, self, args, kwargs)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", wrapped)


def test_a_model_that_ignores_position_ids_fails_packing(monkeypatch, prompts):
    def no_positions(forward, self, args, kwargs):
        kwargs["position_ids"] = None  # positions counted from 0 over every column
        return forward(self, *args, **kwargs)

    _patched(monkeypatch, no_positions)
    res = P.probe(REF, data=prompts, **KW)
    s = _status(res)
    assert not res["passed"]
    # Without position ids transformers cannot find the packed sequences: one causal mask over
    # the whole row, each sequence attends to those before it. The padded layouts still pass:
    # rotary positions are relative, and a left-padded row's are all shifted by one constant.
    assert s["packing"] == "FAIL"
    assert s["pad_left"] == s["pad_right"] == s["ratio"] == s["kl_self"] == "pass"
    packing = _row(res, "packing")
    assert packing["where"]["row"] in range(6) and packing["value"] > 1e-3
    assert "prime-rl#606" in packing["note"] and "in float64 too" in packing["note"]


def test_a_model_that_reads_the_batch_fails_the_micro_batch_rows(monkeypatch, prompts):
    def by_batch(forward, self, args, kwargs):
        out = forward(self, *args, **kwargs)
        rows = kwargs["input_ids"].shape[0]
        out.last_hidden_state = out.last_hidden_state * (1 + 1e-2 * rows)
        return out

    _patched(monkeypatch, by_batch)
    res = P.probe(REF, data=prompts, **KW)
    s = _status(res)
    assert s["micro_batch_1"] == s["micro_batch_2"] == s["packing"] == "FAIL"
    assert s["order"] == "pass"  # the same rows, reversed: the same batch size
    assert "verl#6280" in _row(res, "micro_batch_2")["note"]


def test_float32_rounding_is_told_from_a_real_difference(monkeypatch, prompts):
    """A change that only float32 makes (a stand-in for rounding) is said as such."""

    def float32_only(forward, self, args, kwargs):
        out = forward(self, *args, **kwargs)
        if out.last_hidden_state.dtype == torch.float32:
            rows = kwargs["input_ids"].shape[0]
            out.last_hidden_state = out.last_hidden_state * (1 + 1e-3 * rows)
        return out

    _patched(monkeypatch, float32_only)
    res = P.probe(REF, data=prompts, **KW)
    mb = _row(res, "micro_batch_1")
    assert mb["status"] == "FAIL" and mb["float64"] <= P.EXACT_FLOAT64
    assert mb["note"].startswith("float32 rounding: the paths agree in float64")
    assert next(iter(load_causal_lm(REF).parameters())).dtype == torch.float32


def test_dropout_in_train_mode_breaks_the_step0_ratio(tmp_path, prompts):
    """A model with dropout: the update's forward (train mode) is not the scoring pass."""
    model = load_causal_lm(REF)
    model.config.attention_dropout = 0.5
    model.save_pretrained(tmp_path)
    load_tokenizer(REF).save_pretrained(tmp_path)
    res = P.probe(str(tmp_path), data=prompts, **KW)
    assert _status(res)["ratio"] == "FAIL" and _row(res, "ratio")["value"] > 1e-3
    assert "dropout" in _row(res, "ratio")["note"]


def test_the_reference_row(tmp_path, prompts):
    same = tmp_path / "same"
    shutil.copytree(REF, same)
    res = P.probe(REF, reference=str(same), data=prompts, **KW)
    ref = _row(res, "reference")
    assert ref["status"] == "pass" and ref["value"] == 0.0
    other = load_causal_lm(REF)
    with torch.no_grad():
        other.model.norm.weight.mul_(1.5)
    other.save_pretrained(tmp_path / "other")
    res = P.probe(REF, reference=str(tmp_path / "other"), data=prompts, **KW)
    ref = _row(res, "reference")
    assert ref["status"] == "info" and ref["value"] > 1e-3 and res["passed"]


def test_same_weights():
    a, b = load_causal_lm(REF), load_causal_lm(REF)
    assert same_weights(a, b)
    with torch.no_grad():
        b.model.norm.weight[0] += 1e-7
    assert not same_weights(a, b)


def test_adapters_off_is_the_base_model(tmp_path, prompts):
    from klpo.train.models.lora import apply_lora

    peft_model = apply_lora(load_causal_lm(REF), r=4, alpha=8, dropout=0.0, target_modules="all-linear")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # trained adapters: the policy is not the base model
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(tmp_path / "adapter")
    res = P.probe(REF, adapter=str(tmp_path / "adapter"), data=prompts, **KW)
    off = _row(res, "adapters_off")
    assert off["status"] == "pass" and off["value"] == 0.0
    assert _status(res)["ratio"] == "pass" and _status(res)["engine"] == "skip"
    with pytest.raises(MeasureError, match=r"adapter_config\.json"):
        P.probe(REF, adapter=str(tmp_path), data=prompts, **KW)


def test_thresholds():
    t = P.read_thresholds(["invariance=1e-3", "packing=0", "identity=1e-9"])
    assert t["packing"] == 0.0 and t["order"] == 1e-3 and t["ratio"] == 1e-9
    assert t["reference"] == 0.0 and t["engine"] == 1e-3
    for bad in ("packing", "nope=1", "order=-1", "order=x", "order=inf"):
        with pytest.raises(MeasureError, match="--threshold"):
            P.read_thresholds([bad])


def test_the_command_line(monkeypatch, prompts):
    base = ["probe", REF, "--data", prompts, "--prompts", "3", "--max-new-tokens", "6"]
    ok = runner.invoke(app, base)
    assert ok.exit_code == 0, ok.output
    assert "step-0 ratio" in ok.output and "every check passed" in ok.output
    js = runner.invoke(app, [*base, "--json"])
    assert js.exit_code == 0
    record = json.loads(js.stdout)
    assert record["passed"] and [r["check"] for r in record["rows"]] == list(P.CHECKS)
    bad = runner.invoke(app, [*base, "--threshold", "wrong=1"])
    assert bad.exit_code == 2 and "--threshold 'wrong=1'" in bad.output
    missing = runner.invoke(app, ["probe", "/nonexistent/model", "--data", prompts])
    assert missing.exit_code == 2 and "no such directory" in missing.output

    def no_positions(forward, self, args, kwargs):
        kwargs["position_ids"] = None
        return forward(self, *args, **kwargs)

    _patched(monkeypatch, no_positions)
    failed = runner.invoke(app, base)
    assert failed.exit_code == 1
    assert "FAIL" in failed.output and "checks failed" in failed.output


def test_builtin_prompts_follow_the_chat_template():
    tok = load_tokenizer(REF)
    texts, chat = P._builtin_prompts(tok, 2)
    assert not chat and all(isinstance(t, str) for t in texts)  # no chat template: plain text
    res = P.probe(REF, prompts=2, samples=1, max_new_tokens=4)
    assert res["passed"] and res["sequences"] == 2
    assert _row(res, "whole_rows")["note"] == "one completion a prompt"


@pytest.mark.parametrize("key", ["smollm2_dir", "gemma3_dir"])
def test_real_models_pass_and_are_exact_at_step0(key, request):
    """SmolLM2-135M-Instruct (chat template) and Gemma 3 270M (sliding-window layers, no
    template): klpo's path is exact at step 0, and every layout within float32's rounding
    (docs/probe.md has the full tables; 2 prompts × 2 completions of 4 tokens here)."""
    path = str(request.getfixturevalue(key))
    res = P.probe(path, prompts=2, samples=2, max_new_tokens=4)
    assert res["passed"], P.render_probe(res)
    assert _row(res, "ratio")["value"] == 0.0 and _row(res, "kl_self")["value"] == 0.0
    assert max(_row(res, n)["value"] for n in P.INVARIANCES) < 1e-4


def test_the_help_states_the_default_thresholds():
    """The command's help cannot import the table (it imports no torch): it is checked here."""
    out = " ".join(runner.invoke(app, ["probe", "--help"]).output.split())
    stated = ", ".join(f"{k}={v:g}" for k, v in P.KINDS.items())
    assert f"({stated} by default, float32)" in out, out


def test_a_nan_fails_its_row_and_json_stays_json(monkeypatch, prompts):
    def nan_packed(backbone, rollout):  # a path whose log-probs overflow to NaN
        return torch.full(rollout.mask.shape, float("nan"))

    monkeypatch.setitem(P.INVARIANCES, "packing", nan_packed)
    base = ["probe", REF, "--data", prompts, "--prompts", "3", "--max-new-tokens", "6"]
    result = runner.invoke(app, [*base, "--json"])
    assert result.exit_code == 1
    row = next(r for r in json.loads(result.stdout)["rows"] if r["check"] == "packing")
    assert row["status"] == "FAIL" and row["value"] is None and "not finite" in row["note"]
    assert row["where"] == {"row": 0, "position": 0, **row["where"]}  # the first token
    text = runner.invoke(app, base).output
    assert "not finite" in text
