"""``data`` and ``rewards``: the prompts, their rendering, and the reward functions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from klpo.train.config.common import Section

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "chat_template", "tools", "documents", "return_dict", "return_tensors", "padding",
     "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip
"""Arguments of ``apply_chat_template`` that ``data.chat_template_kwargs`` may not set."""


PLAIN_CHAT_STOP = ("\n", "\n\n", "\n\n\n")
r"""``rollout.stop`` of the built-in chat task as plain text (``data.chat: false``), unless given:
a newline ends the answer's line. Runs of newlines are listed too: a tokenizer may hold them as
tokens of their own (Gemma 3: ``"\n\n"`` is one token, id 108), and a stop string that is one
token of the tokenizer stops at that token only (:func:`klpo.train.models.tokens.stop_set`)."""


DataSource = Literal["builtin", "builtin-overopt", "builtin-chat-arith", "jsonl", "datasets"]

SOURCE_REWARDS = {"builtin": "exact_match", "builtin-chat-arith": "numeric"}
"""The reward a built-in task is scored by: a run on it trains on this reward unless ``rewards``
says otherwise, and its held-out accuracy is this reward's wherever no reward is trained on
(on-policy distillation, ``rewards: []``). The over-optimisation task's is its gold reward."""


class DataConfig(Section):
    source: DataSource = Field(
        "builtin",
        description="Where prompts come from: the built-in arithmetic task, the same task as the "
        "over-optimisation task (a proxy reward to train on, exact correctness as the gold "
        "reward; docs/overopt.md), the built-in chat task for an instruction-tuned model "
        "(arithmetic and word problems as chat messages, scored by the numeric reward; with "
        "data.chat=false, as plain text for a model without a chat template; "
        "docs/real-models.md), a JSONL file, or a datasets dataset (a local path, or a Hub "
        "id fetched by datasets; HF_HUB_OFFLINE=1 reads the local cache only). Every column "
        "of a row reaches TRL-form reward functions by name (docs/rewards.md).",
    )
    path: str | None = Field(
        None, description="The JSONL (or parquet) file, or the datasets name/path."
    )
    split: str = Field("train", description="datasets split to train on.")
    eval_split: str | None = Field(
        None, description="datasets split for held-out evaluation (default: none for datasets)."
    )
    eval_path: str | None = Field(None, description="JSONL file of held-out problems.")
    prompt_field: str = Field(
        "prompt",
        description="Field holding the prompt (text or chat messages); a dotted path reaches "
        "into a nested record.",
    )
    answer_field: str = Field(
        "answer",
        description="Field holding the reference answer; a dotted path reaches into a nested "
        "record (verl's reward_model.ground_truth). Optional where no reward reads it "
        "(docs/frameworks.md).",
    )
    eval_size: int = Field(500, ge=0, description="Held-out problems evaluated (greedy).")
    max_prompt_tokens: int = Field(
        256, gt=0, description="Longer prompts are an error naming the line or sample."
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch over the data (seeded).")
    chat: bool = Field(
        False,
        description="Render each prompt (a string, or a list of {role, content} messages) with "
        "the tokenizer's chat template, ending with the assistant's generation prompt.",
    )
    system_prompt: str | None = Field(
        None, description="With chat: a system message put before each prompt's messages."
    )
    shots: Literal["one", "per-kind", "none"] = Field(
        "one",
        description="builtin-chat-arith: the solved examples before each question: one addition, "
        "one of each kind of problem, or none (docs/real-models.md).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="With chat: extra variables the chat template reads, passed to "
        "apply_chat_template (e.g. {enable_thinking: false} for Qwen3); each must be a variable "
        "of the template.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(
                f"{taken[0]!r} is set by klpo itself when it renders a prompt; give only the "
                "template's own variables (e.g. enable_thinking)"
            )
        return v

    @model_validator(mode="after")
    def _shots_need_chat_arith(self) -> DataConfig:
        if self.shots != "one" and self.source != "builtin-chat-arith":
            raise ValueError(
                f"shots is only read by data.source=builtin-chat-arith (source is "
                f"{self.source!r}); drop data.shots={self.shots!r} or set that source"
            )
        return self

    @model_validator(mode="after")
    def _kwargs_need_chat(self) -> DataConfig:
        if self.chat_template_kwargs and not self.chat:
            raise ValueError(
                "chat_template_kwargs is only used with data.chat=true; set both, or drop it"
            )
        return self

    @model_validator(mode="after")
    def _path_for_files(self) -> DataConfig:
        if self.source in ("jsonl", "datasets") and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self


class RewardTerm(Section):
    name: str = Field(
        description="A built-in reward ('exact_match', 'numeric', 'format', 'boxed'), 'model' (a reward model at path) or 'module:function' (a module in the working directory or an installed package; TRL's form fn(completions, **kwargs) or klpo's fn(prompts, completions, answers), docs/rewards.md)."
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    path: str | None = Field(
        None,
        description="name 'model': the reward model's directory (a sequence classifier), or a "
        ".gguf file of one.",
    )

    @model_validator(mode="after")
    def _path_for_model(self) -> RewardTerm:
        if self.name == "model" and not self.path:
            raise ValueError(
                "the reward 'model' needs the reward model's directory: {name: model, path: DIR} "
                "(make a small one with 'klpo make-reward-model DIR')"
            )
        if self.name != "model" and self.path:
            raise ValueError(f"path is only used by the reward 'model', not by {self.name!r}")
        return self
