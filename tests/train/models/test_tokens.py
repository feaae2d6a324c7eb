"""One rule for special tokens and one stop set (klpo.train.models.tokens), on each family's terms.

Oracles: transformers' own ``apply_chat_template(..., tokenize=True)`` (the ids a template's text
must have: nothing added to it); the ids written out by hand (one per special token, one per
character); TRL's decoding of a completion (``batch_decode(completion, skip_special_tokens=True)``);
transformers' ``generate`` with ``stop_strings``; a linear scan of every prefix for the stop
strings. Each test also shows the old rule failing (the rendered text tokenized with the
tokenizer's specials; the tokenizer's EOS as the only stop). The tokenizers and models follow the
families' published conventions and are built here (``klpo_families``); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from klpo.train import loop
from klpo.train.choices import ENGINES
from klpo.train.config import ConfigError, build_config
from klpo.train.data.sources import Example, render_chat
from klpo.train.models.load import load_causal_lm, load_tokenizer
from klpo.train.models.tokens import Codec, StopSet, check_single_bos, run_codec, stop_set
from klpo.train.rollout import engines
from klpo.train.rollout.samplers import Decoding, completion_mask, generate
from klpo.train.runtime.metrics import read_metrics


def _families():
    """The family builders (loaded by path: tests/train is on sys.path only during a test)."""
    name = "klpo_families"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


F = _families()
NAMES = list(F.FAMILIES)
MSG = [{"role": "user", "content": "1+2="}]

# Each family's generation prompt for one user turn "1+2=", as its model card writes it.
RENDERED = {
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n1+2=<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n",
    "gemma": "<bos><start_of_turn>user\n1+2=<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "<s>[INST] 1+2=[/INST]",
    "qwen3": "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n",
}
# The stop set, in order: the tokenizer's EOS, then generation_config.eos_token_id.
STOPS = {
    "llama3": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    "qwen2.5": ("<|im_end|>", "<|endoftext|>"),
    "gemma": ("<eos>", "<end_of_turn>"),
    "mistral": ("</s>",),
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
}


def hand_ids(text: str, f) -> list[int]:
    """``text``'s ids by hand: each special or added token where it is written, else one id per
    character (the families' tokenizers here have no merges)."""
    ids, whole = f.ids(), sorted(f.specials + f.added, key=len, reverse=True)
    out, i = [], 0
    while i < len(text):
        tok = next((t for t in whole if text.startswith(t, i)), text[i])
        out.append(ids[tok])
        i += len(tok)
    return out


def tokenizer(f, **kwargs):
    """The family's tokenizer with the EOS as pad where it has no pad token, as
    :func:`klpo.train.models.load.load_tokenizer` sets it."""
    tok = F.build_tokenizer(f, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def codec_of(f, tok, *, chat: bool, extra=()) -> Codec:
    ids = f.ids()
    gen = GenerationConfig(eos_token_id=[ids[t] for t in f.generation_eos])
    return Codec(tok, stop_set(tok, gen, extra), chat=chat)


# ---------------------------------------------------------------------------------------------
# Special tokens, once.


@pytest.mark.parametrize("name", NAMES)
def test_rendered_text_gets_no_special_token_and_a_plain_prompt_the_tokenizers_once(name):
    f = F.FAMILIES[name]
    tok, ids = tokenizer(f), f.ids()
    (e,) = render_chat([Example("1+2=", "3")], tok, chat=True)
    assert e.prompt == RENDERED[name]
    got = codec_of(f, tok, chat=True).ids([e.prompt])[0]
    assert got == hand_ids(e.prompt, f)
    assert (
        got == tok.apply_chat_template(MSG, tokenize=True, add_generation_prompt=True)["input_ids"]
    )
    bos = [ids[f.bos]] if f.bos else []
    assert got[: len(bos)] == bos and (not bos or got.count(bos[0]) == 1)
    # The old rule (the rendered text with the tokenizer's specials) doubles a post-processor's BOS.
    old = tok(e.prompt).input_ids
    assert old == ([ids[f.bos]] if f.adds_bos else []) + got
    if f.adds_bos:
        assert old[:2] == [ids[f.bos]] * 2
    # A plain prompt gets the tokenizer's own specials, once.
    plain = codec_of(f, tok, chat=False).ids(["1+2="])[0]
    assert plain == ([ids[f.bos]] if f.adds_bos else []) + [ids[c] for c in "1+2="]


def test_a_doubled_bos_is_refused_naming_the_token():
    f = F.FAMILIES["llama3"]
    tok = tokenizer(f)
    text = RENDERED["llama3"]  # rendered elsewhere, then given as a plain prompt
    plain = codec_of(f, tok, chat=False)
    with pytest.raises(ConfigError, match=r"f:3: .*BOS token '<\|begin_of_text\|>' \(id 0\) twice"):
        check_single_bos(plain, plain.ids([text])[0], "f:3", text)
    chat = codec_of(f, tok, chat=True)
    check_single_bos(chat, chat.ids([text])[0], "f:3", text)  # one BOS: fine
    twice = "<|begin_of_text|>" + text
    with pytest.raises(ConfigError, match=r"writes '<\|begin_of_text\|>' once"):
        check_single_bos(chat, chat.ids([twice])[0], "f:3", twice)


def test_the_template_keywords_reach_the_template_and_a_misspelt_one_is_refused():
    f = F.FAMILIES["qwen3"]
    tok = tokenizer(f)
    plain = [Example("1+2=", "3")]
    (on,) = render_chat(plain, tok, chat=True)
    (off,) = render_chat(plain, tok, chat=True, template_kwargs={"enable_thinking": False})
    assert on.prompt == RENDERED["qwen3"]
    assert off.prompt == RENDERED["qwen3"] + "<think>\n\n</think>\n\n"
    got = codec_of(f, tok, chat=True).ids([off.prompt])[0]
    want = tok.apply_chat_template(
        MSG, tokenize=True, add_generation_prompt=True, enable_thinking=False
    )["input_ids"]
    assert got == want == hand_ids(off.prompt, f)  # <think> is one (added, not special) token
    with pytest.raises(ValueError, match=r"'enable_thinkng' is not a variable .*enable_thinking"):
        render_chat(plain, tok, chat=True, template_kwargs={"enable_thinkng": False})
    with pytest.raises(ConfigError, match=r"chat_template_kwargs is only used with data\.chat"):
        build_config(overrides=["data.chat_template_kwargs={enable_thinking: false}"])
    with pytest.raises(ConfigError, match="'tokenize' is set by klpo itself"):
        build_config(overrides=["data.chat=true", "data.chat_template_kwargs={tokenize: true}"])


def test_a_template_that_refuses_a_prompt_names_it():
    tok = tokenizer(F.FAMILIES["gemma"])
    with pytest.raises(ValueError, match="f:1: the chat template refused the prompt: System role"):
        render_chat([Example("1+2=", "3", where="f:1")], tok, chat=True, system_prompt="be brief")


# ---------------------------------------------------------------------------------------------
# The stop set.


@pytest.mark.parametrize("name", NAMES)
def test_the_stop_set_is_the_tokenizers_eos_and_the_generation_configs(name):
    f = F.FAMILIES[name]
    tok, ids = tokenizer(f), f.ids()
    s = codec_of(f, tok, chat=True).stop
    assert s.ids == tuple(ids[t] for t in STOPS[name]) and s.strings == ()
    lines = s.lines(tok)
    assert lines[0] == "stop set: a completion ends at its first"
    assert [ln.split()[:3] for ln in lines[1:]] == [
        [repr(t), "id", str(ids[t])] for t in STOPS[name]
    ]
    assert "the tokenizer's EOS" in lines[1]


def test_the_stop_set_takes_an_int_none_and_rollout_stop():
    f = F.FAMILIES["llama3"]
    tok, ids = tokenizer(f, extra_tokens=("wer>xy",)), f.ids()
    eot, eom, end = ids["<|eot_id|>"], ids["<|eom_id|>"], ids["<|end_of_text|>"]
    assert stop_set(tok, GenerationConfig(eos_token_id=eot)).ids == (end, eot)
    assert stop_set(tok, None).ids == (end,)
    s = stop_set(tok, None, [eom, "<|eot_id|>", "</answer>", end])
    assert s.ids == (end, eom, eot) and s.strings == ("</answer>",)  # an added token is its id
    assert s.sources == ("the tokenizer's EOS, rollout.stop", "rollout.stop", "rollout.stop",
                         "rollout.stop")  # fmt: skip
    for bad in (len(tok), "", True, 1.5):
        with pytest.raises(ConfigError, match=r"rollout\.stop: .* neither a token id"):
            stop_set(tok, None, [bad])
    tok.eos_token = None
    with pytest.raises(ConfigError, match="nothing ends a completion"):
        stop_set(tok, GenerationConfig())
    assert stop_set(tok, GenerationConfig(), ["\n\n"]).strings == ("\n\n",)
    with pytest.raises(ConfigError, match=r"rollout\.stop.*cannot end a completion"):
        build_config(overrides=["rollout.stop=['']"])
    assert build_config(overrides=["rollout.stop=[7, '</a>']"]).rollout.stop == [7, "</a>"]


@pytest.mark.parametrize("name", NAMES)
def test_a_completion_ends_at_its_first_stop_and_the_reward_never_sees_it(name):
    f = F.FAMILIES[name]
    tok, ids = tokenizer(f), f.ids()
    codec = codec_of(f, tok, chat=True)
    c = lambda text: [ids[ch] for ch in text]  # noqa: E731
    # A special token inside a completion (not a stop): skipped, as TRL skips it.
    turn = next(ids[t] for t in reversed(f.specials) if ids[t] not in codec.stop.ids)
    rows = [[*c("4"), turn, *c("2"), s, *c("7")] for s in codec.stop.ids] + [c("42424")]
    done = codec.finish(torch.tensor(rows))
    n = len(codec.stop.ids)
    assert done.mask.sum(-1).tolist() == [4] * n + [5]
    assert done.truncated.tolist() == [False] * n + [True]
    assert done.texts == ["42"] * n + ["42424"]
    assert done.ids[:n, 4:].eq(tok.pad_token_id).all() and done.ids[:n, :4].tolist() == [
        r[:4] for r in rows[:n]
    ]
    # TRL's decoding of the valid completion (the stop included) gives the same text: every stop
    # here is a special token, which skip_special_tokens drops.
    trl = tok.batch_decode([r[:4] for r in rows[:n]], skip_special_tokens=True)
    assert trl == done.texts[:n]
    # The old stop set (the tokenizer's EOS alone) runs past the generation config's ids.
    _, old_trunc = completion_mask(torch.tensor(rows), tok.eos_token_id)
    for i, s in enumerate(codec.stop.ids):
        assert bool(old_trunc[i]) == (s != tok.eos_token_id)


def test_stop_strings_end_at_the_completing_token_overhang_included():
    f = F.FAMILIES["llama3"]
    tok = tokenizer(f, extra_tokens=("wer>xy",))
    codec = codec_of(f, tok, chat=True, extra=["</answer>"])
    v = tok.get_vocab()
    row = [v[ch] for ch in "42</ans"] + [v["wer>xy"]] + [v["z"]] * 3
    done = codec.finish(torch.tensor([row]))
    assert done.mask.sum().item() == 8 and done.texts == ["42"] and not done.truncated.item()
    hits = [bool(codec.stops_in(torch.tensor([row[:k]]))) for k in range(1, len(row) + 1)]
    assert hits == [False] * 7 + [True] * 4


def test_the_bisected_end_is_the_first_prefix_holding_a_stop_string():
    f = F.FAMILIES["qwen2.5"]
    tok = tokenizer(f)
    v = tok.get_vocab()
    codec = codec_of(f, tok, chat=True, extra=["bab", "aaa"])
    rng = random.Random(0)
    alphabet = [v["a"], v["b"], v["c"], v["<|im_start|>"]]
    rows = [[rng.choice(alphabet) for _ in range(12)] for _ in range(300)]
    done = codec.finish(torch.tensor(rows))
    for row, m, text in zip(rows, done.mask.sum(-1).tolist(), done.texts, strict=True):
        # the oracle: the first k whose prefix's text (special tokens skipped) holds a string
        prefixes = [tok.decode(row[:k], skip_special_tokens=True) for k in range(1, 13)]
        first = next((k for k, t in enumerate(prefixes, 1) if "bab" in t or "aaa" in t), 12)
        assert m == first
        full = prefixes[first - 1]
        assert text == full[: min((i for s in ("bab", "aaa") if (i := full.find(s)) >= 0),
                                  default=len(full))]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Sampling with the family's model.


@pytest.fixture(scope="module")
def emitting(tmp_path_factory):
    """``emitting(name, token, generation_eos=None)``: the directory of a family's model that
    always emits ``token`` (cached)."""
    made: dict = {}

    def make(name: str, token: str, generation_eos: tuple[str, ...] | None = None) -> Path:
        key = (name, token, generation_eos)
        if key not in made:
            path = tmp_path_factory.mktemp(name.replace(".", "")) / "model"
            made[key] = F.save_model(
                F.FAMILIES[name], path, emit=token, generation_eos=generation_eos
            )
        return made[key]

    return make


@pytest.mark.parametrize("sampler", ["lean", "generate"])
@pytest.mark.parametrize("name", NAMES)
def test_each_family_stops_at_its_end_of_turn(name, sampler, emitting):
    f = F.FAMILIES[name]
    last = f.generation_eos[-1]  # the end of turn; the tokenizer's EOS only for Mistral
    path = emitting(name, last)
    model, tok = load_causal_lm(str(path)), load_tokenizer(str(path))
    cfg = build_config(overrides=[f"model.policy={path}", "data.chat=true"])
    codec = run_codec(cfg, tok, str(path))
    (e,) = render_chat([Example("1+2=", "3")], tok, chat=True)
    r = generate(model, tok, [e.prompt], ["3"], Decoding(group_size=2, max_new_tokens=8, sampler=sampler), codec=codec)  # fmt: skip
    prompt = r.prompt_ids[0][r.prompt_mask[0]].tolist()
    assert prompt == hand_ids(e.prompt, f)
    assert r.completion_ids.tolist() == [[f.ids()[last]]] * 2
    assert r.mask.all() and not r.truncated.any() and r.completions == ["", ""]
    if last != f.eos:  # the tokenizer's EOS alone never ends these completions
        old = Codec(tok, StopSet((tok.eos_token_id,)), chat=True)
        r = generate(model, tok, [e.prompt], ["3"], Decoding(group_size=2, max_new_tokens=8, sampler=sampler), codec=old)  # fmt: skip
        assert r.mask.sum(-1).tolist() == [8, 8] and r.truncated.all()


@pytest.mark.parametrize("sampler", ["lean", "generate"])
def test_a_stop_string_stops_both_samplers_at_the_same_token(sampler, emitting):
    path = emitting("llama3", "x")
    model, tok = load_causal_lm(str(path)), load_tokenizer(str(path))
    cfg = build_config(overrides=[f"model.policy={path}", "rollout.stop=['xxx']"])
    codec = run_codec(cfg, tok, str(path))
    r = generate(model, tok, ["1+2="], ["3"], Decoding(group_size=2, max_new_tokens=8, sampler=sampler), codec=codec)  # fmt: skip
    # Both loops stop at the third x (generate by its StopStringCriteria, lean by Codec.stops_in).
    assert r.completion_ids.shape[1] == 3 and r.mask.all() and not r.truncated.any()
    assert r.completions == ["", ""]


# ---------------------------------------------------------------------------------------------
# A run: a Llama-3-style tokenizer and a model that ends its turn with its second EOS, end to end.


def _chat_data(path: Path, n: int) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)}
            for a in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("sampler", ["lean", "generate"])
def test_one_bos_and_the_second_eos_in_a_run(sampler, emitting, quick, tmp_path, monkeypatch):
    # A BOS-adding post-processor, a template that writes bos_token, a generation config that
    # lists two EOS ids, and a model that always emits the second.
    f = F.FAMILIES["llama3"]
    path = emitting("llama3", "<|eot_id|>", ("<|end_of_text|>", "<|eot_id|>"))
    data = _chat_data(tmp_path / "train.jsonl", 8)
    over = {"data.source": "jsonl", "data.path": str(data), "data.eval_path": str(data),
            "data.chat": "true", "run.steps": 1, "run.eval_every": 1,
            "rollout.max_new_tokens": 8, "rollout.sampler": sampler}  # fmt: skip
    cfg = build_config(overrides=quick(path, tmp_path / "run", **over))
    seen, evaluated = [], []
    fake = importlib.import_module("klpo_fake_engine")  # tests/train, on sys.path in a test
    monkeypatch.setitem(ENGINES, "hf", fake.recording(seen))  # the hf engine's rollouts
    import klpo.train.evaluate as ev

    real_eval = ev.rollout_generate

    def spy_eval(*args, **kwargs):
        evaluated.append(kwargs["codec"])
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(ev, "rollout_generate", spy_eval)
    lines: list[str] = []
    loop.train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    tok = load_tokenizer(str(path))
    want = {  # transformers' own tokens of each rendered prompt: one BOS, 27 tokens
        tuple(tok.apply_chat_template([{"role": "user", "content": f"{a}+{a}="}], tokenize=True,
                                      add_generation_prompt=True)["input_ids"])
        for a in range(8)
    }  # fmt: skip
    assert {len(w) for w in want} == {27} and all(w.count(f.ids()[f.bos]) == 1 for w in want)
    (r,) = seen
    got = {tuple(row[mask].tolist()) for row, mask in zip(r.prompt_ids, r.prompt_mask, strict=True)}
    assert got <= want and len(got) == cfg.rollout.prompts_per_step
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1:]
    assert row["completion/length"] == 1.0 and row["completion/truncated"] == 0.0
    assert evaluated and all(c.chat and c.stop.ids == (1, 5) for c in evaluated)
    at = lines.index("stop set: a completion ends at its first")
    assert lines[at - 2] == (
        "prompts: rendered by the chat template, tokenized without adding special tokens"
    )
    assert lines[at - 1].startswith(
        "  the first training prompt is 27 tokens, one BOS: '<|begin_of_text|><|start_header_id|>"
    )
    assert lines[at + 1].split() == [
        "'<|end_of_text|>'", "id", "1", "the", "tokenizer's", "EOS,",
        "generation_config.eos_token_id",
    ]  # fmt: skip
    assert lines[at + 2].split() == ["'<|eot_id|>'", "id", "5", "generation_config.eos_token_id"]
    assert len(lines) == at + 3 or not lines[at + 3].startswith("  ")


def test_a_prompt_rendered_elsewhere_is_refused_before_any_model_loads(
    emitting, quick, tmp_path, monkeypatch
):
    path = emitting("llama3", "<|eot_id|>")
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": RENDERED["llama3"], "answer": "3"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = {"data.source": "jsonl", "data.path": str(data)}
    cfg = build_config(overrides=quick(path, tmp_path / "run", **over))
    from klpo.train.models import build

    monkeypatch.setattr(build, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(
        ConfigError, match=r"train\.jsonl:2: the prompt begins with the BOS token "
        r"'<\|begin_of_text\|>' \(id 0\) twice: .*data\.chat=true"
    ):  # fmt: skip
        loop.train(cfg, log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_the_vllm_engine_follows_the_same_rule(emitting, quick, tmp_path, monkeypatch):
    """vLLM itself is replaced by a stand-in that records what it is given and returns scripted
    completions as vLLM lays them out (each ends with the stop token that ended it)."""
    f = F.FAMILIES["llama3"]
    path = emitting("llama3", "<|eot_id|>")
    ids = f.ids()
    c = lambda text: [ids[ch] for ch in text]  # noqa: E731
    script = [[*c("42"), ids["<|eot_id|>"]], c("7777"), [*c("1"), ids["<|eom_id|>"]]]
    made = []

    class LLM:
        def __init__(self, **kwargs):
            made.append(self)

        def generate(self, inputs, params, use_tqdm=False):
            self.inputs, self.params = inputs, params
            out = [SimpleNamespace(token_ids=r, logprobs=[{t: SimpleNamespace(logprob=-0.5)}
                                                          for t in r]) for r in script]  # fmt: skip
            return [SimpleNamespace(outputs=out) for _ in inputs]

    monkeypatch.setitem(
        sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=SimpleNamespace)
    )
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    over = {"data.chat": "true", "rollout.engine": "vllm", "rollout.group_size": 3,
            "rollout.max_new_tokens": 4}  # fmt: skip
    cfg = build_config(overrides=quick(path, tmp_path / "run", **over))
    tok = load_tokenizer(str(path))
    m = SimpleNamespace(policy=load_causal_lm(str(path)), tokenizer=tok,
                        codec=run_codec(cfg, tok, str(path)))  # fmt: skip
    engine = engines.make_engine(cfg, m, SimpleNamespace(), str(path))
    (text,) = [e.prompt for e in render_chat([Example("1+2=", "3")], tok, chat=True)]
    r = engine.sample([text], ["3"])
    (llm,) = made
    assert llm.inputs == [{"prompt_token_ids": hand_ids(text, f)}]  # one BOS
    assert llm.params.stop_token_ids == [ids[t] for t in STOPS["llama3"]]
    assert r.mask.sum(-1).tolist() == [3, 4, 2] and r.truncated.tolist() == [False, True, False]
    assert r.completions == ["42", "7777", "1"]
    assert torch.equal(r.engine_logp, torch.where(r.mask, -0.5, 0.0))


def test_the_reference_samples_and_the_doctor_follow_the_rule(emitting, quick, moved, tmp_path):
    import klpo.measure as M
    from klpo.measure import MeasureError
    from klpo.train.models.backbone import Backbone
    from klpo.train.rollout.ref_samples import sample_reference

    f = F.FAMILIES["llama3"]
    path = emitting("llama3", "<|eot_id|>")
    cfg = build_config(overrides=quick(path, tmp_path / "run", **{"data.chat": "true"}))
    tok = load_tokenizer(str(path))
    codec = run_codec(cfg, tok, str(path))
    (text,) = [e.prompt for e in render_chat([Example("1+2=", "3")], tok, chat=True)]
    policy = generate(load_causal_lm(str(path)), tok, [text], ["3"], Decoding(group_size=4, max_new_tokens=4), codec=codec)  # fmt: skip
    batch = sample_reference(cfg, Backbone(load_causal_lm(str(path))), codec, [text], ["3"], policy)
    r = batch.rollout
    assert r.prompt_ids[0][r.prompt_mask[0]].tolist() == hand_ids(text, f)
    assert r.mask.sum(-1).tolist() == [1] * 4 and not r.truncated.any()
    # The doctor's prompts are plain: the tokenizer's BOS once; completions stop at <|eot_id|>.
    data = tmp_path / "prompts.txt"
    data.write_text("1+2=\n3+4=\n")
    ref = moved(path, tmp_path / "reference", 0.01)  # (the same weights: nothing to measure)
    out = M.measure(str(path), str(ref), str(data), prompts=2, samples=3, max_new_tokens=6)
    assert out["sequences"] == 6 and out["tokens"] == 6
    data.write_text("1+2=\n<|begin_of_text|>3+4=\n")
    with pytest.raises(MeasureError, match=r"prompt 2: .*'<\|begin_of_text\|>' \(id 0\) twice"):
        M.measure(str(path), str(path), str(data), prompts=2, samples=3, max_new_tokens=6)
