"""What a framework reader returns: the KL terms a configuration switches on, and what it implies.

A reader (a module of :mod:`klpo.doctor.frameworks`, one per row of the table) turns one
configuration into a :class:`Reading`: the framework's
own settings with their defaults filled in, each KL term in klpo's words (:class:`Term`: estimator,
placement, coefficient, reduction, clamps), whether the tokens the KL term sees can come from an
older policy, and findings (settings ignored, applied twice, or doing something other than what
their name says). :mod:`klpo.doctor.report` adds what :func:`klpo.kl.explain` derives.
"""

from __future__ import annotations

import difflib
import errno
import json
import os
import re
import stat
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "FINDING_KINDS",
    "DoctorError",
    "Finding",
    "Reading",
    "TeacherTerm",
    "Term",
    "UnknownFramework",
    "command_flags",
    "duplicate_keys",
    "flatten",
    "interpolate",
    "known_key",
    "load_mapping",
    "merge",
    "nearest",
    "read_text",
    "scalar",
]


class DoctorError(ValueError):
    """A configuration the doctor cannot read; the message names the file, the key and the fix."""


class UnknownFramework(DoctorError):
    """A file that is no config of any framework the doctor reads: the message says what it
    looked like, and that no framework's reading was applied to it.

    ``what``: that description alone (``a YAML/JSON mapping with the top-level keys name, on,
    jobs``), for the one-line note ``klpo doctor --skip-non-configs`` gives instead of an error.
    """

    def __init__(self, message: str, what: str = "") -> None:
        super().__init__(message)
        self.what = what


FINDING_KINDS: dict[str, str] = {
    "unknown-key": "a key the framework's version does not have: refused (strict, Hydra "
    "struct) or silently accepted and read by nobody (lenient), with the nearest real key",
    "unread-key": "a key the framework accepts but no code of it reads",
    "refused": "a combination the framework asserts against: the run does not start (the "
    "assertion's file:line in the pinned version)",
    "cancelled": "a combination that cancels a KL term: reported as no term, with the reason",
    "structure": "what the config builds, not what it is named: the algorithm a critic "
    "section implies, asynchrony, the group a baseline is taken over",
    "zero-advantage": "a group baseline over groups of one: every advantage is zero",
}
"""The finding classes (:attr:`Finding.kind`) of the framework rules that are not about one
KL term; a finding without a kind is about the KL terms themselves."""


@dataclass(frozen=True)
class Term:
    """One KL term in effect, in klpo's words.

    Attributes:
        option: the framework's setting(s) that switch it on, as written there.
        framework_name: the framework's name of the estimator (e.g. verl's ``low_var_kl``).
        estimator: the klpo estimator with the same value and gradient (``klpo.kl.ESTIMATORS``);
            ``None`` where klpo has none.
        placement: ``"loss"`` or ``"reward"``.
        beta: the coefficient.
        beta_option: the setting that holds it.
        reduction: how the term is reduced to the loss (a ``klpo.reduce`` mode), or for the
            reward, how the per-token penalty reaches the advantage.
        value_clamp: ``(lo, hi)`` clamp of the estimate's value, or None.
        log_ratio_clamp: ``(lo, hi)`` clamp of ``log pi_ref - log pi_theta`` before the estimator.
        corrected: whether the framework weights the term for tokens sampled by pi_old.
        logged_as: the metric the framework logs the term's value under.
        adaptive: whether a controller changes ``beta`` during training.
    """

    option: str
    framework_name: str
    estimator: str | None
    placement: str
    beta: float
    beta_option: str
    reduction: str
    value_clamp: tuple[float, float] | None = None
    log_ratio_clamp: tuple[float, float] | None = None
    corrected: bool = False
    logged_as: str = ""
    adaptive: bool = False


@dataclass(frozen=True)
class TeacherTerm:
    """One distillation term in effect: the student pi_theta pulled towards a teacher pi_T.

    The student samples, the teacher scores its tokens (on-policy distillation); the term is a
    divergence between the two next-token distributions, or a sampled-token estimate of one.
    :mod:`klpo.doctor.report` adds what ``klpo explain --teacher`` derives for it
    (:func:`klpo.registry.teacher_positions`, :func:`klpo.registry.teacher_sequence`).

    Attributes:
        option: the framework's settings that switch it on, as written there.
        framework_name: the framework's name of the term (verl's ``forward_kl_topk``).
        divergence: what its value is defined as, in words with both arguments written out
            (``KL(pi_theta ‖ pi_T)`` is the reverse direction, ``KL(pi_T ‖ pi_theta)`` the
            forward one).
        direction: ``"reverse"``, ``"forward"``, ``"JSD(beta)"``, ``"mixed"`` or ``"none"``.
        support: ``"sampled"`` (the sampled token only), ``"full"`` (the whole vocabulary) or
            ``"top-k"`` (a top-k subset of it).
        placement: ``"loss"`` (differentiated) or ``"reward"`` (its detached value in the
            advantage, a policy-gradient signal).
        beta: the term's coefficient; ``beta_option`` the setting that holds it.
        credit: for the reward: ``"token"`` (each token credited only with its own value,
            discount 0) or ``"returns"`` (returns-to-go); empty for the loss.
        top_k: the k of a top-k support; ``topk_of``: whose top-k (``"teacher"``,
            ``"student"``).
        clamps: each clamp on the term, in words.
        estimator: for a sampled term, the :data:`klpo.kl.ESTIMATORS` name with the same value
            and gradient (the teacher in the reference's place), else None.
        value_clamp, log_ratio_clamp: a sampled term's clamps as numbers, of its value and of
            ``log pi_T - log pi_theta`` (for the regions where they zero the gradient).
        table_key: the form's key in ``klpo explain --teacher``'s table, or None where it has
            none.
        teacher: the teacher model the config names, or a description (self-distillation).
        logged_as: the metric the framework logs it under.
        klpo: the ``teacher:`` keys of klpo's teacher mode that do the same, or ``{}`` where
            klpo has no such estimator.
    """

    option: str
    framework_name: str
    divergence: str
    direction: str
    support: str
    placement: str
    beta: float
    beta_option: str
    credit: str = ""
    top_k: int | None = None
    topk_of: str = ""
    clamps: tuple[str, ...] = ()
    estimator: str | None = None
    value_clamp: tuple[float, float] | None = None
    log_ratio_clamp: tuple[float, float] | None = None
    table_key: str | None = None
    teacher: str = ""
    logged_as: str = ""
    klpo: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    """Something the user should know. ``level``: ``"error"`` (a setting that cannot do what it
    says, or that the framework rejects), ``"warning"`` (ignored, doubled, silently rescaled or
    off-policy), ``"note"``."""

    level: str
    keys: tuple[str, ...]
    text: str
    kind: str = ""  # one of FINDING_KINDS, or "" (about the KL terms)


@dataclass
class Reading:
    """One configuration, read.

    Attributes:
        framework: ``"verl"``, ``"trl-grpo"``, ``"trl-rloo"``, ``"openrlhf"`` or ``"klpo"``.
        defaults_version: the framework version whose defaults fill what the file leaves out.
        version: the version the user named (None: assumed ``defaults_version``).
        source: the file read.
        settings: every setting the doctor looked at, with its value in effect and whether it came
            from the file or the defaults.
        algorithm: the advantage estimator / algorithm, in the framework's words.
        group_size: completions per prompt (1 where there are no groups).
        updates_per_batch: optimiser steps taken on one batch of rollouts.
        terms: the KL terms in effect.
        group_scaling: how the group normalisation scales a KL that is in the reward, or None.
        asynchronous: whether rollouts come from an older policy from the first step on (a
            rollout queue, a stale-rollout bound).
        findings: see :class:`Finding`.
        equivalent: the klpo config (a nested dict, ``klpo train -c``) that does the same thing,
            as far as klpo can; ``equivalent_differences`` says where it cannot, and
            ``equivalent_unmapped`` lists the file's settings klpo has no key for.
        intended: the klpo config that does what the settings most likely meant, and ``why``.
        defaults_from: how the framework's keys and defaults were read (composed by Hydra from
            verl's files, TRL's dataclass through ``HfArgumentParser``, a table), or empty.
        teacher_terms: the distillation terms in effect (:class:`TeacherTerm`).
        teacher_section: the ``teacher:`` section of klpo's teacher mode that does the same
            thing (as far as klpo can; ``teacher_differences`` says where not), and
            ``teacher_intended`` the one the settings most likely meant, with
            ``teacher_intended_why``. The report validates each beside the equivalent klpo
            config (:mod:`klpo.doctor.report`).
    """

    framework: str
    defaults_version: str
    version: str | None
    source: str
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    algorithm: str = ""
    group_size: int = 1
    updates_per_batch: int = 1
    terms: list[Term] = field(default_factory=list)
    group_scaling: str | None = None
    asynchronous: bool = False
    findings: list[Finding] = field(default_factory=list)
    equivalent: dict[str, Any] = field(default_factory=dict)
    equivalent_differences: list[str] = field(default_factory=list)
    equivalent_unmapped: list[str] = field(default_factory=list)
    intended: dict[str, Any] = field(default_factory=dict)
    intended_why: list[str] = field(default_factory=list)
    defaults_from: str = ""  # how the framework's keys and defaults were read
    teacher_terms: list[TeacherTerm] = field(default_factory=list)
    teacher_section: dict[str, Any] = field(default_factory=dict)
    teacher_differences: list[str] = field(default_factory=list)
    teacher_intended: dict[str, Any] = field(default_factory=dict)
    teacher_intended_why: list[str] = field(default_factory=list)

    @property
    def off_policy(self) -> bool:
        """Whether a KL term in the loss sees tokens sampled by an older policy: several
        optimiser steps per batch, or rollouts generated while the policy trains
        (:attr:`asynchronous`)."""
        return self.updates_per_batch > 1 or self.asynchronous

    def warn(
        self, level: str, keys: tuple[str, ...] | list[str], text: str, kind: str = ""
    ) -> None:
        if kind and kind not in FINDING_KINDS:
            raise ValueError(f"unknown finding kind {kind!r}; one of {', '.join(FINDING_KINDS)}")
        self.findings.append(Finding(level, tuple(keys), text, kind))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["off_policy"] = self.off_policy
        return out


class Settings:
    """Dotted-key lookups into a flattened config, with the framework's defaults, remembering
    what was read and where it came from.

    ``labels`` maps a key to the name the file used for it (OpenRLHF's flat or grouped flag), so
    findings speak the file's words. A value the file holds but the doctor cannot read (it
    depends on a shell variable the script does not define) is a finding, and the framework's
    default is read in its place, marked so in :attr:`read`.
    """

    def __init__(
        self,
        values: dict[str, Any],
        defaults: dict[str, Any],
        source: str,
        labels: dict[str, str] | None = None,
    ):
        self.values, self.defaults, self.source = values, defaults, source
        self.labels = labels or {}
        self.read: dict[str, dict[str, Any]] = {}
        self.findings: list[Finding] = []
        self.stand_ins: list[str] = []  # klpo settings carried from a default, and why

    def label(self, key: str) -> str:
        return self.labels.get(key, key)

    def given(self, key: str) -> bool:
        return key in self.values

    def differs(self, key: str) -> bool:
        """Whether the file sets ``key`` to something other than the default (and not zero)."""
        if key not in self.values:
            return False
        self.get(key)
        value, default = self.values[key], self.defaults.get(key)
        if value in (0, 0.0, False, None, "") and not isinstance(value, str):
            return False
        return str(value).lower() != str(default).lower()

    def get(self, key: str) -> Any:
        if key in self.values:
            value, origin = self.values[key], "file"
            unread = _unresolved_text(value)
            if unread:
                value, origin = self.defaults.get(key), "default (the file's value was unreadable)"
                self.findings.append(
                    Finding(
                        "warning",
                        (self.label(key),),
                        f"{self.label(key)} = {self.values[key]!r} depends on {unread}, which "
                        "the script does not define: the doctor cannot read it and took the "
                        f"default {value!r}; give its value with --var NAME=VALUE"
                        + "".join(
                            f" (--var {n}=VALUE for ${n})"
                            for n in re.findall(r"\$\{([0-9]+)\}", str(self.values[key]))[:1]
                        ),
                    )
                )
        else:
            value, origin = self.defaults.get(key), "default"
        self.read[key] = {"value": value, "from": origin}
        return value

    def _typed(self, key: str, kind: type, check: str) -> Any:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, str) and "${" in value:
            raise DoctorError(
                f"{self.source}: {self.label(key)} = {value!r} is an interpolation the doctor "
                "does not resolve; give the resolved config (for verl, add `--cfg job --resolve` "
                "to the main_ppo command line to print it)"
            )
        try:
            if kind is bool:
                if isinstance(value, bool):
                    return value
                text = str(value).strip().lower()
                if text in ("true", "1", "yes"):
                    return True
                if text in ("false", "0", "no"):
                    return False
                raise ValueError
            if kind is int and isinstance(value, float) and value.is_integer():
                return int(value)
            return kind(value)
        except (TypeError, ValueError):
            raise DoctorError(
                f"{self.source}: {self.label(key)} = {value!r} is not {check}; write it as "
                f"{check}, e.g. {self.label(key)}={self.defaults.get(key)!r}"
            ) from None

    def bool(self, key: str) -> bool:
        return bool(self._typed(key, bool, "true or false"))

    def float(self, key: str) -> float | None:
        return self._typed(key, float, "a number")

    def int(self, key: str) -> int | None:
        return self._typed(key, int, "an integer")

    def str(self, key: str) -> str | None:
        value = self.get(key)
        return None if value is None else str(value)


def _unresolved_text(value: Any) -> str | None:
    """The shell names a value from a script still depends on (``${HOME}``, ``$(date)``, a
    positional parameter ``${1}``, said as one: :func:`shell_name`)."""
    if not isinstance(value, str):
        return None
    names = re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*|[0-9]+)\}|(\$\([^)]*\))", value)
    if not names:
        return None
    return ", ".join(shell_name(a) if a else b for a, b in names)


def shell_name(name: str) -> str:
    """``$NAME``, or for a digit ``$1 (a positional parameter: an argument of the script, or of
    the shell function the command sits in)``, which ``--var 1=VALUE`` gives."""
    if name.isdigit():
        return (
            f"${name} (a positional parameter: argument {name} of the script, or of the shell "
            "function the command sits in)"
        )
    return f"${name}"


def nearest(key: str, known: list[str] | set[str] | dict[str, Any]) -> str | None:
    """The known key closest to ``key`` (its last dotted part weighs most), or None."""
    pool = list(known)
    hit = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
    if hit:
        return hit[0]
    # By the last part only within the same section (a first part in common): a suggestion
    # from another section (``qat.mode`` for a recipe's ``algorithm.mode``) misleads.
    tail, head = key.rsplit(".", 1)[-1], key.split(".", 1)[0]
    by_tail: dict[str, str] = {}
    for k in pool:
        if "." not in key or k.split(".", 1)[0] == head:
            by_tail.setdefault(k.rsplit(".", 1)[-1], k)
    hit = difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.8)
    return by_tail[hit[0]] if hit else None


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base``, nested mappings key by key (OmegaConf's merge)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def interpolate(data: dict[str, Any], resolvers: dict[str, Any] | None = None) -> dict[str, Any]:
    """``data`` with its OmegaConf interpolations evaluated: ``${a.b}`` references to other keys
    and two-argument resolvers ``${name:x,y}`` from ``resolvers`` (NeMo-RL's ``mul``, ...), as
    the framework's loader resolves them; what cannot be resolved stays as written.

    >>> interpolate({"a": 2, "b": {"c": "${a}", "d": "${mul:${a},3}"}}, {"mul": lambda x, y: x * y})
    {'a': 2, 'b': {'c': 2, 'd': 6}}
    """
    resolvers = resolvers or {}
    flat = flatten(data)

    def value(text: str, depth: int = 0) -> Any:
        if depth > 20:
            return text
        m = re.fullmatch(r"\$\{([\w.]+)\}", text.strip())
        if m and m.group(1) in flat:
            got = flat[m.group(1)]
            return value(got, depth + 1) if isinstance(got, str) and "${" in got else got
        m = re.fullmatch(r"\$\{(\w+):(.*)\}", text.strip())
        if m and m.group(1) in resolvers:
            args = [value(a, depth + 1) if "${" in a else scalar(a) for a in _arguments(m.group(2))]
            if len(args) == 2 and all(isinstance(v, int | float) for v in args):
                return resolvers[m.group(1)](*args)
        return text

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, str) and "${" in node:
            return value(node)
        return node

    return walk(data)


def _arguments(text: str) -> list[str]:
    """``a, ${b}, ${c:d,e}`` -> its top-level comma-separated arguments."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    return [*out, cur.strip()]


def known_key(key: str, table: dict[str, Any]) -> bool:
    """Whether a framework's flattened key table has ``key``, or an open mapping above it
    (a key whose value in the table is ``{}`` or None takes any key under it)."""
    if key in table:
        return True
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in table:
            return table[prefix] in ({}, None)
    return any(k.startswith(key + ".") for k in table)


# What a path that is not a regular file is, by its mode (a FIFO or a character device would
# block the read until another process writes: the doctor must never wait on one).
_NOT_FILES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe): reading it would wait for a writer"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_config_file(path: Path) -> None:
    """A DoctorError unless ``path`` is a regular file (after its symlinks): it names a path that
    does not exist, a broken symlink, a symlink loop, and a directory, FIFO, socket or device
    (whose read would block or fail), each with the fix."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DoctorError(
                f"{path}: a symlink loop (its links lead back to themselves, so no file is at the "
                "end); point the link at the config file"
            ) from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            if path.is_symlink():
                raise DoctorError(
                    f"{path}: a broken symlink (to {os.readlink(path)!r}, which does not exist); "
                    "point it at the config file"
                ) from None
            raise DoctorError(f"config file {str(path)!r} does not exist") from None
        raise DoctorError(f"{path}: cannot be read ({err.strerror})") from None
    for test, what in _NOT_FILES:
        if test(mode):
            raise DoctorError(
                f"{path}: {what}, not a config file; give the YAML/JSON config or the launch "
                "script (a regular file)"
            )


def read_text(path: Path) -> str:
    """A config file's text, or a DoctorError naming the file and what is wrong with it
    (:func:`check_config_file` first: a FIFO is refused, never waited on)."""
    check_config_file(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise DoctorError(f"{path}: a directory, not a config file") from None
    except OSError as err:
        raise DoctorError(f"{path}: cannot be read ({err.strerror})") from None
    nul = data.find(b"\0", 0, 8192)
    if nul >= 0:
        raise DoctorError(
            f"{path}: a binary file (a NUL byte at offset {nul}), not a config; "
            "give the YAML/JSON config or the launch script"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DoctorError(
            f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "give the YAML/JSON config or the launch script as text"
        ) from None


def scalar(text: str) -> Any:
    """A command-line value as Python: numbers (``1e-3`` included), booleans, null, or the text."""
    t = text.strip().strip("'\"")
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(t)
        except ValueError:
            pass
    return t


def command_flags(
    words: list[str], switches: Collection[str] = ()
) -> Iterator[tuple[str, str | None]]:
    """A command line's flags, argparse's way: ``(name, value as written)`` for each
    ``--name=value`` or ``--name value``, and ``(name, None)`` for a flag that takes no value:
    one in ``switches`` (unless written ``--name=value``), or one followed by another flag or by
    nothing. Words that belong to no flag are passed over."""
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        if eq:
            yield name, value
        elif name in switches or i >= len(words) or words[i].startswith("--"):
            yield name, None
        else:
            yield name, words[i]
            i += 1


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c.d": 2}`` → ``{"a.b": 1, "c.d": 2}`` (Hydra's dotted keys)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, str):
            out[name] = scalar(value) if _looks_numeric(value) else value
        else:
            out[name] = value
    return out


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", text))


def duplicate_keys(text: str, is_json: bool = False) -> list[tuple[str, int, int]]:
    """Keys a YAML (or JSON) mapping holds twice: (dotted key, first line, repeated line).

    PyYAML and :mod:`json` keep the last value silently; OmegaConf (verl, NeMo-RL, SkyRL,
    AReaL) refuses the file. The YAML is walked as composed nodes, so lines are the file's.
    """
    if is_json:
        found: list[tuple[str, int, int]] = []

        def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    found.append((k, 0, 0))
                seen.add(k)
            return dict(pairs)

        try:
            json.loads(text, object_pairs_hook=hook)
        except json.JSONDecodeError:
            return []
        return found
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return []
    out: list[tuple[str, int, int]] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = f"{prefix}{key.value}" if isinstance(key, yaml.ScalarNode) else prefix
                line = key.start_mark.line + 1
                if name in first:
                    out.append((name, first[name], line))
                else:
                    first[name] = line
                walk(value, name + ".")
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, prefix)

    walk(root, "")
    return out


class _KeysAsWritten(yaml.SafeLoader):
    """PyYAML's safe loader, but a mapping key that YAML 1.1 would read as another type is the
    text written: a GitHub workflow's ``on:`` is the key ``"on"``, not ``True`` (``yes``, ``no``,
    ``off``, ``1``, ``~`` likewise). Every key of a config is then a string, as the readers
    assume; values are read as PyYAML reads them."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            node.value = [
                (
                    yaml.ScalarNode("tag:yaml.org,2002:str", k.value, k.start_mark, k.end_mark)
                    if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:str"
                    else k,
                    v,
                )
                for k, v in node.value
            ]
        return super().construct_mapping(node, deep)


def load_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file holding one mapping (its keys strings, as written:
    :class:`_KeysAsWritten`), or a DoctorError that says what is wrong (an
    :class:`UnknownFramework` for a file that holds a list or a scalar: data, not settings)."""
    text = read_text(path)
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, _KeysAsWritten)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise DoctorError(f"{path}: not valid {kind}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        what = f"a {'JSON' if path.suffix == '.json' else 'YAML'} {type(data).__name__}"
        raise UnknownFramework(
            f"{path}: the file holds a {type(data).__name__}, not a mapping of settings; "
            "give a YAML/JSON mapping (verl, TRL, klpo) or a command line (OpenRLHF, verl "
            "overrides)",
            what=f"{what}, not a mapping of settings",
        )
    return data


def check_known(
    value: str, allowed: dict[str, Any] | tuple[str, ...], key: str, source: str
) -> str:
    if value not in allowed:
        raise DoctorError(
            f"{source}: {key} = {value!r} is not a value this framework accepts; "
            f"allowed: {', '.join(allowed)}"
        )
    return value


def as_dict(obj: Any) -> Any:
    """Dataclasses and tuples to JSON-ready values."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [as_dict(v) for v in obj]
    return obj


def version_matches(named: str | None, known: str) -> bool:
    """``"0.9.1"`` matches ``"0.9"``; None (not named) matches."""
    if named is None:
        return True
    return named == known or named.startswith(known + ".")
