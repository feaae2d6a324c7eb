"""Prompts: the built-in task, a JSONL file, or a ``datasets`` dataset, served in a resumable order.

Every source yields :class:`Example` (prompt text, reference answer). Bad input is an error that
names the file and line (JSONL) or the sample index (datasets) and says what is missing.

Field names (``data.prompt_field``, ``data.answer_field``) are a column's name, or a dotted path
into a nested record, as verl's parquet files keep the answer in ``reward_model.ground_truth``
(:func:`field_value`). The answer is optional: an example without one has ``answer=None``, and
the preflight refuses it only where a reward reads it (:func:`klpo.train.preflight.check_answers`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from klpo.train.data.markers import check_unrendered, template_markers
from klpo.train.models.hub import hub_problem, offline_variable


@dataclass(frozen=True)
class Example:
    """One problem: the prompt the policy sees and the answer a reward function checks.

    ``messages`` holds a prompt given as chat messages (``[{"role": ..., "content": ...}]``);
    :func:`render_chat` turns it, or the plain prompt, into the text the policy sees (and keeps
    the messages it rendered, so that reward functions get conversational prompts). ``row`` is
    the whole data row, every column, as read (reward functions get each column by name;
    :attr:`columns`).
    """

    prompt: str
    answer: str | None  # None: the row has no answer field (TRL-form rewards read other columns)
    messages: tuple[tuple[str, str], ...] | None = None
    where: str = field(default="", compare=False)  # "file:line" or "name[i]", for errors
    row: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def columns(self) -> Mapping[str, Any]:
        """Every column of the data row; for the built-in task, ``prompt`` and ``answer``."""
        return self.row if self.row is not None else {"prompt": self.prompt, "answer": self.answer}


def read_jsonl(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Example]:
    """Examples from a JSONL file, one JSON object per line with the two fields (strings).

    A parquet file (by its ``PAR1`` magic, verl's data format) is read as parquet, its rows
    named ``file[i]`` in errors, whatever the source says."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(
            f"JSONL file {str(path)!r} is a directory; give the path of the JSONL file in it"
        )
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file {str(path)!r} does not exist")
    if is_parquet(path):
        return read_parquet(path, prompt_field, answer_field)
    out = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{n}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); save the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
                ) from None
            if n == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark (Windows editors)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{n}: not valid JSON ({err.msg}): {line.strip()[:80]!r}"
                ) from None
            out.append(_example(row, prompt_field, answer_field, f"{path}:{n}"))
    if not out:
        raise ValueError(f"JSONL file {str(path)!r} holds no examples")
    return out


def is_parquet(path: Path) -> bool:
    """Whether ``path`` is a parquet file (it starts with the format's magic bytes ``PAR1``)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"PAR1"
    except OSError:
        return False


def read_parquet(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Example]:
    """Examples from a parquet file (pyarrow), one per row; nested columns stay records."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow's own error types
        raise ValueError(f"cannot read {str(path)!r} as parquet: {err}") from None
    if not rows:
        raise ValueError(f"parquet file {str(path)!r} holds no examples")
    return [_example(row, prompt_field, answer_field, f"{path}[{i}]") for i, row in enumerate(rows)]


_MISSING = object()


def field_value(row: Mapping[str, Any], name: str) -> Any:
    """The value of field ``name`` in ``row``: the column of that name if there is one, else a
    dotted path into nested records (``reward_model.ground_truth`` is
    ``row["reward_model"]["ground_truth"]``; a number indexes a list). Raises KeyError with the
    part that is missing and the fields present where it was looked for."""
    if name in row:
        return row[name]
    value: Any = row
    for i, part in enumerate(name.split(".")):
        if isinstance(value, Mapping):
            value = value.get(part, _MISSING)
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            value = _MISSING
        if value is _MISSING:
            at = ".".join(name.split(".")[:i])
            inside = row if not at else field_value(row, at)
            present = (
                ", ".join(map(str, inside))
                if isinstance(inside, Mapping)
                else f"a {type(inside).__name__}"
            )
            raise KeyError(part if not at else f"{part} (in {at})", present)
    return value


def _field(row: Mapping[str, Any], name: str, where: str, *, required: bool = True) -> Any:
    try:
        return field_value(row, name)
    except KeyError as err:
        if not required:
            return None
        part, present = err.args
        raise ValueError(
            f"{where}: missing field {name!r}"
            + (f" ({part!r} is not there)" if part != name else "")
            + f" (fields present: {present}); set data.prompt_field / data.answer_field to the "
            "right names (a dotted path such as reward_model.ground_truth reaches into a nested "
            "record)"
        ) from None


def _example(row: object, prompt_field: str, answer_field: str, where: str) -> Example:
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected a JSON object with {prompt_field!r} and {answer_field!r}"
        )
    prompt = _field(row, prompt_field, where)
    answer = _field(row, answer_field, where, required=False)
    answer = None if answer is None else str(answer)
    if isinstance(prompt, list):
        return Example(
            prompt="", answer=answer, messages=chat_messages(prompt, where), where=where, row=row
        )
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(
            f"{where}: field {prompt_field!r} must be a non-empty string or a list of chat "
            f"messages, got {prompt!r}"
        )
    return Example(prompt=prompt, answer=answer, where=where, row=row)


def chat_messages(value: list, where: str) -> tuple[tuple[str, str], ...]:
    """A prompt given as chat messages (``[{"role": ..., "content": ...}]``) as ``(role,
    content)`` pairs; a ValueError naming ``where`` and the message for anything else.

    >>> chat_messages([{"role": "user", "content": "2 + 2?"}], "data.jsonl:1")
    (('user', '2 + 2?'),)
    """
    out = []
    for i, msg in enumerate(value):
        ok = (
            isinstance(msg, dict)
            and isinstance(msg.get("role"), str)
            and isinstance(msg.get("content"), str)
        )
        if not ok:
            raise ValueError(
                f"{where}: chat message {i} must be an object with string fields 'role' and "
                f"'content', got {msg!r}"
            )
        out.append((msg["role"], msg["content"]))
    if not out:
        raise ValueError(f"{where}: the prompt is an empty list of chat messages")
    return tuple(out)


def check_chat_template(tokenizer: object) -> None:
    """Raise a ValueError that says how to fix it when ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"data.chat=true needs a tokenizer with a chat template, and the tokenizer of this "
            f"model ({getattr(tokenizer, 'name_or_path', '?')!r}) has none; use the tokenizer of "
            "an instruction-tuned model, set tokenizer.chat_template and save it with the model "
            "(tokenizer_config.json or chat_template.jinja), or set data.chat=false"
        )


def render_chat(
    examples: list[Example],
    tokenizer: object,
    *,
    chat: bool,
    system_prompt: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[Example]:
    """The examples with each prompt as the text the policy sees.

    With ``chat`` on, the prompt (a plain string becomes one user message; a list of messages is
    kept, with ``system_prompt`` put first unless it already starts with a system message) is
    rendered by the tokenizer's chat template, ending with the assistant's generation prompt
    (``apply_chat_template(..., tokenize=False, add_generation_prompt=True,
    **template_kwargs)``, as TRL renders conversational prompts). The template writes every
    special token the model expects (a BOS, turn markers), so the rendered text is tokenized
    without adding any (:class:`klpo.train.models.tokens.Codec` with ``chat=True``). With
    ``chat`` off the prompts are returned as they are; each later gets the tokenizer's own
    special tokens, once.
    A rendered example keeps the messages it was rendered from (``messages``, the system
    prompt included) and its data row.

    Raises:
        ValueError: chat is on and the tokenizer has no chat template, a template keyword is
            not a variable of the template, or a prompt holds the template's own markers (it
            was rendered already: :func:`klpo.train.data.markers.check_unrendered`); or chat is
            off and an example's prompt is a list of messages (it needs a template).
    """
    if not chat:
        listed = [i for i, e in enumerate(examples) if e.messages is not None]
        if listed:
            raise ValueError(
                f"example {listed[0]} gives its prompt as chat messages; set data.chat=true to "
                "render them with the tokenizer's chat template"
            )
        if system_prompt:
            raise ValueError("data.system_prompt is only used with data.chat=true; set both")
        return examples
    import jinja2

    check_chat_template(tokenizer)
    kwargs = dict(template_kwargs or {})
    check_template_kwargs(tokenizer, kwargs)
    # text rendered already would be rendered twice (klpo.train.data.markers)
    check_unrendered(examples, template_markers(tokenizer, kwargs), system_prompt=system_prompt)
    out = []
    for e in examples:
        msgs = [{"role": r, "content": c} for r, c in (e.messages or (("user", e.prompt),))]
        if system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system_prompt})
        try:
            text = tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except jinja2.TemplateError as err:  # the template's own raise_exception
            where = e.where or "an example"
            raise ValueError(f"{where}: the chat template refused the prompt: {err}") from None
        rendered = tuple((m["role"], m["content"]) for m in msgs)
        out.append(replace(e, prompt=text, messages=rendered, row=e.columns))
    return out


def check_template_kwargs(tokenizer: object, kwargs: dict[str, Any]) -> None:
    """Raise a ValueError naming a keyword of ``data.chat_template_kwargs`` that the chat template
    never reads (a misspelt ``enable_thinking`` would otherwise change nothing, silently). A
    template jinja cannot parse here (one using transformers' own tags) is not checked."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not kwargs or not isinstance(template, str):
        return
    import jinja2
    from jinja2 import meta

    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        names = meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        raise ValueError(
            f"data.chat_template_kwargs: {unknown[0]!r} is not a variable of the tokenizer's "
            f"chat template, which reads: {', '.join(sorted(names))}; check the name"
        )


def read_dataset(
    name_or_path: str, split: str, prompt_field: str = "prompt", answer_field: str = "answer"
) -> list[Example]:
    """Examples from a ``datasets`` dataset: a ``save_to_disk`` directory, a local data file, or
    a Hub id, fetched by ``datasets.load_dataset`` (honouring ``HF_DATASETS_OFFLINE`` and
    ``HF_HUB_OFFLINE``; :mod:`klpo.train.models.hub`). Every column of a row reaches the reward
    functions (:attr:`Example.columns`)."""
    import datasets

    datasets.disable_progress_bars()  # no "Generating train split" bars in the run's output
    path = Path(name_or_path)
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"dataset {name_or_path!r} has no split {split!r}: {list(ds)}")
            ds = ds[split]
    elif path.is_file():
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(
            path.suffix
        )
        if kind is None:
            raise ValueError(f"cannot read {name_or_path!r}: use .jsonl, .json, .csv or .parquet")
        try:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as err:  # datasets wraps parser errors in its own types
            cause = err.__cause__ or err
            raise ValueError(
                f"cannot read {name_or_path!r} as {kind}: {type(cause).__name__}: "
                f"{str(cause).splitlines()[0][:200] if str(cause) else ''}; for line-by-line "
                "errors use data.source=jsonl"
            ) from None
    elif name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1:
        raise FileNotFoundError(f"data.path {name_or_path!r}: no such file or directory")
    else:
        problem = hub_problem(name_or_path, "data.path", "dataset")
        if problem:
            raise FileNotFoundError(problem)
        try:
            ds = datasets.load_dataset(name_or_path, split=split)
        except (ConnectionError, FileNotFoundError) as err:
            raise FileNotFoundError(
                f"data.path {name_or_path!r}: could not load the dataset ({err}); "
                f"{offline_variable('dataset')}=1 reads the local cache only"
            ) from None
    missing = [
        k
        for k in (prompt_field,)
        if k not in ds.column_names and k.split(".")[0] not in ds.column_names
    ]
    if missing:
        raise ValueError(
            f"dataset {name_or_path!r} has no column {missing[0]!r} (columns: "
            f"{', '.join(ds.column_names)}); set data.prompt_field (a dotted path such as "
            "extra_info.question reaches into a nested record)"
        )
    return [
        _example(dict(row), prompt_field, answer_field, f"{name_or_path}[{i}]")
        for i, row in enumerate(ds)
    ]


class PromptStream:
    """Serves examples in a seeded order, epoch after epoch, from a position that can be saved.

    The order of epoch ``e`` is a permutation drawn from ``torch.Generator().manual_seed(seed + e)``
    (or the file order when ``shuffle`` is False), so a stream rebuilt from :meth:`state_dict`
    continues exactly where it stopped.
    """

    def __init__(self, examples: list[Example], *, seed: int, shuffle: bool = True):
        if not examples:
            raise ValueError("no training examples")
        self.examples = examples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.examples)))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.examples), generator=gen).tolist()

    def next(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), len(self._order) - self.offset)
            out += [self.examples[i] for i in self._order[self.offset : self.offset + take]]
            self.offset += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)
