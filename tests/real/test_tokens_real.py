"""The real-model tier: the special-token rule and the stop set (klpo.train.models.tokens) on the
real tokenizers the GGUF files carry: SmolLM2's ChatML with its default system prompt, Gemma 3's
``<bos>`` with no chat template. Tokenizers only: no model is loaded.

The oracle of a rendered chat prompt's ids is transformers' own
``apply_chat_template(..., tokenize=True)``; the expected texts are the templates' own output as
SmolLM2's model card and Gemma's tokenizer give them.
"""

from __future__ import annotations

import pytest
import torch

from klpo.train.config import ConfigError, build_config
from klpo.train.data.sources import Example, render_chat
from klpo.train.models.tokens import check_single_bos, run_codec

pytestmark = pytest.mark.real

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _codec(model_dir, tok, **overrides):
    """The run's codec (klpo.train.models.tokens.run_codec) for a config with these keys."""
    sets = [f"model.policy={model_dir}", *(f"{k}={v}" for k, v in overrides.items())]
    return tok, run_codec(build_config(overrides=sets), tok, model_dir)


def test_smollm2_chat_prompt_has_the_default_system_prompt_and_no_added_token(
    smollm2_dir, smollm2_tokenizer
):
    tok, codec = _codec(smollm2_dir, smollm2_tokenizer, **{"data.chat": "true"})
    (ex,) = render_chat([Example("What is 17 + 25?", "42")], tok, chat=True)
    assert ex.prompt == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    )
    (ids,) = codec.ids([ex.prompt])
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == list(want)  # the template's special tokens, and nothing added to them
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3 and ids[1] != start
    check_single_bos(codec, ids, "prompt 1", ex.prompt)  # <|im_start|> is its BOS: once


def test_smollm2_plain_prompt_gets_no_special_token(smollm2_dir, smollm2_tokenizer):
    """SmolLM2's tokenizer has no post-processor BOS: a plain prompt is its text's tokens."""
    tok, codec = _codec(smollm2_dir, smollm2_tokenizer)
    (ids,) = codec.ids(["What is 17 + 25?"])
    assert tok.decode(ids) == "What is 17 + 25?"
    assert not set(ids) & set(tok.all_special_ids)


def test_smollm2_stop_set_is_the_end_of_turn(smollm2_dir, smollm2_tokenizer):
    tok, codec = _codec(smollm2_dir, smollm2_tokenizer, **{"data.chat": "true"})
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert codec.stop.ids == (end,) == (2,)
    assert codec.stop.sources == ("the tokenizer's EOS, generation_config.eos_token_id",)
    assert codec.stop.lines(tok)[-1].strip().startswith("'<|im_end|>'")
    answer = tok("17 + 25 = 42", add_special_tokens=False)["input_ids"]
    rambling = tok("\n<|im_start|>user\nAnd 3 + 4?", add_special_tokens=False)["input_ids"]
    rows = [[*answer, end, *rambling], [*answer, *rambling, tok.pad_token_id]]
    done = codec.finish(torch.tensor(rows), torch.tensor([len(rows[0]), len(rows[0]) - 1]))
    assert done.texts == ["17 + 25 = 42", tok.decode(answer + rambling, skip_special_tokens=True)]
    assert done.mask[0].sum() == len(answer) + 1 and done.truncated.tolist() == [False, True]
    # rollout.stop: a string that is one added token is that token's id
    _, more = _codec(smollm2_dir, smollm2_tokenizer, **{"rollout.stop": "['<|endoftext|>']"})
    assert more.stop.ids == (2, tok.convert_tokens_to_ids("<|endoftext|>")) == (2, 0)


def test_gemma3_plain_prompt_gets_one_bos(gemma3_dir, gemma3_tokenizer):
    tok, codec = _codec(gemma3_dir, gemma3_tokenizer)
    assert (tok.bos_token, tok.bos_token_id) == ("<bos>", 2)
    text = "Question: What is 17 + 25?\nAnswer:"
    (ids,) = codec.ids([text])
    assert ids[0] == 2 and ids[1] != 2
    assert tok.decode(ids[1:]) == text
    check_single_bos(codec, ids, "prompt 1", text)
    (twice,) = codec.ids(["<bos>" + text])  # a prompt rendered elsewhere, given as plain text
    assert twice[:2] == [2, 2]
    with pytest.raises(ConfigError, match=r"prompt 2: .*BOS token '<bos>' \(id 2\) twice"):
        check_single_bos(codec, twice, "prompt 2", "<bos>" + text)


def test_gemma3_has_no_chat_template_and_stops_at_eos(gemma3_dir, gemma3_tokenizer):
    tok, codec = _codec(gemma3_dir, gemma3_tokenizer)
    assert len(tok) == 262_144 and not tok.chat_template
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        render_chat([Example("Hi", "")], tok, chat=True)
    assert codec.stop.ids == (tok.eos_token_id,) == (1,)
    assert tok.convert_ids_to_tokens(list(codec.stop.ids)) == ["<eos>"]
    # the base model's stop set is its EOS alone: the instruct template's <end_of_turn> is not in it
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106 and 106 not in codec.stop.ids
