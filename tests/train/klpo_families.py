"""Tokenizers and tiny models built here to follow each model family's conventions (no download).

Each family's special tokens, which of them the tokenizer adds to a plain text (its
post-processor), its chat template and its ``generation_config.eos_token_id`` are written from the
family's published ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``;
the ordinary vocabulary is one token per printable character (a ``tokenizers`` BPE with no merges),
so every text's ids can be written by hand. The templates are shortened (no tools, no dates) but
keep what matters for tokens: where the BOS is written, the turn markers, the generation prompt.

- Llama 3 (``Meta-Llama-3-8B-Instruct`` as first released): ``<|begin_of_text|>`` added by the
  post-processor *and* written by the template; the tokenizer's EOS ``<|end_of_text|>``; the turn
  ends with ``<|eot_id|>``; ``generation_config.eos_token_id`` lists ``<|end_of_text|>``,
  ``<|eom_id|>``, ``<|eot_id|>`` (3.1).
- Qwen2.5 Instruct: no BOS; ``<|im_start|>``/``<|im_end|>`` turns; EOS ``<|im_end|>``, pad
  ``<|endoftext|>``; ``eos_token_id`` ``[<|im_end|>, <|endoftext|>]``; a default system message.
- Gemma 2 it: ``<bos>`` added and written; ``<start_of_turn>``/``<end_of_turn>``, the assistant
  is ``model``; no system role; ``eos_token_id`` ``[<eos>, <end_of_turn>]``.
- Mistral Instruct v0.3: ``<s>`` added and written; ``[INST] ... [/INST]`` (control tokens); a
  system message joins the last user turn; EOS ``</s>``, the only stop.
- Qwen3: Qwen2.5's tokens plus ``<think>``/``</think>`` (added, not special), and the template's
  ``enable_thinking`` keyword (false: an empty think block after the generation prompt).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c\r")

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN25 = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}{% for m in turns %}{% if m['role'] == 'user' %}"
    "{% if loop.last and system is defined %}[INST] {{ system }}\n\n{{ m['content'] }}[/INST]"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN3 = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    specials: tuple[str, ...]  # special tokens, ids 0.. in this order
    bos: str | None
    eos: str
    pad: str | None
    adds_bos: bool  # the post-processor puts the BOS before a plain text
    template: str
    generation_eos: tuple[str, ...]  # generation_config.eos_token_id, by token
    unk: str | None = None
    added: tuple[str, ...] = ()  # added tokens that are not special

    def ids(self) -> dict[str, int]:
        """Every token's id: the specials, then the characters, then the added tokens."""
        return {t: i for i, t in enumerate(self.specials + CHARS + self.added)}


FAMILIES = {
    "llama3": Family(
        "llama3",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eom_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None, adds_bos=True, template=LLAMA3,
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    ),
    "qwen2.5": Family(
        "qwen2.5", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", adds_bos=False, template=QWEN25,
        generation_eos=("<|im_end|>", "<|endoftext|>"),
    ),
    "gemma": Family(
        "gemma", ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>", eos="<eos>", pad="<pad>", adds_bos=True, template=GEMMA,
        generation_eos=("<eos>", "<end_of_turn>"), unk="<unk>",
    ),
    "mistral": Family(
        "mistral", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        bos="<s>", eos="</s>", pad=None, adds_bos=True, template=MISTRAL,
        generation_eos=("</s>",), unk="<unk>",
    ),
    "qwen3": Family(
        "qwen3", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", adds_bos=False, template=QWEN3,
        generation_eos=("<|im_end|>", "<|endoftext|>"), added=("<think>", "</think>"),
    ),
}  # fmt: skip


def build_tokenizer(f: Family, *, extra_tokens: tuple[str, ...] = ()):
    """The family's tokenizer as a ``PreTrainedTokenizerFast`` (what transformers loads for these
    families from their ``tokenizer.json``), with its chat template. ``extra_tokens``: more added
    tokens (not special), after the family's own."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = f.ids()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=f.unk))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in f.specials])
    tok.add_tokens([AddedToken(s, normalized=False) for s in f.added + extra_tokens])
    if f.adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{f.bos} $A",
            pair=f"{f.bos} $A {f.bos} $B",
            special_tokens=[(f.bos, vocab[f.bos])],
        )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f.bos, eos_token=f.eos, pad_token=f.pad, unk_token=f.unk
    )
    out.chat_template = f.template
    return out


def save_model(
    f: Family,
    path: Path,
    *,
    emit: str | None = None,
    generation_eos: tuple[str, ...] | None = None,
    extra_tokens: tuple[str, ...] = (),
    seed: int = 0,
) -> Path:
    """A random 1-layer Llama with the family's tokenizer and ``generation_config.eos_token_id``
    (``generation_eos``, default the family's), saved to ``path``.

    With ``emit``, the model puts almost all its probability on that token after any prefix: the
    embeddings share a large first coordinate (30, against ~0.02 elsewhere), so after the final
    norm the hidden state's first coordinate is ~sqrt(hidden) = 4 for every position, and the
    untied head reads only that coordinate, with weight 10 for ``emit`` and 0 for every other
    token: a margin of ~40 nats.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(f, extra_tokens=extra_tokens)
    ids = tok.get_vocab()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if emit is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 30.0
            model.lm_head.weight.zero_()
            model.lm_head.weight[ids[emit], 0] = 10.0
    model.generation_config.eos_token_id = [ids[t] for t in generation_eos or f.generation_eos]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
