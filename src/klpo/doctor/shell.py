r"""Launch scripts read the way bash reads them: words, comments, variables, arrays, commands.

The lexing is the standard library's :mod:`shlex` (POSIX mode), one logical line at a time: it
does bash's quoting (single quotes literal, double quotes, backslashes), comments and word
splitting. Around it, this module does what bash does before and after:

- **logical lines**: a line that ends in an unquoted backslash continues on the next (shlex
  reports "No escaped character"), a quote left open continues with the newline kept ("No
  closing quotation"); a backslash inside a comment continues nothing, as in bash, so a
  comment line inside a ``\``-continued command ends the command there;
- **comments**: ``#`` starts one only at the start of a word (``run#2`` is one word): a ``#``
  glued to a preceding character is hidden from shlex and put back;
- **expansions**, on the words shlex returns: ``$NAME``, ``${NAME}``, ``${NAME:-default}`` (and
  ``-``, ``:=``, ``=``, ``:+``, ``+``), ``${#NAME}``, ``"${ARR[@]}"`` / ``${ARR[*]}`` / ``${ARR[i]}``,
  ``$((arithmetic))`` on integers; a ``$`` inside single quotes stays literal and an unquoted
  expansion is split into words, as in bash. Which ``$`` sits in which quotes is found by shlex
  itself: the text is lexed twice with each ``$`` replaced by a private character wrapped in
  double quotes (which stay visible inside single quotes) and in single quotes (visible inside
  double quotes);
- **assignments**: ``NAME=value``, ``export``/``declare``/``local``/``readonly NAME=value``,
  arrays ``NAME=( ... )`` over several lines (comments inside end at their line),
  ``NAME+=( ... )`` and ``NAME+=value``; prefix assignments (``A=1 cmd``) set the command's
  environment only;
- **commands**: split at ``;``, ``&&``, ``||``, ``|``, ``&`` and newlines; redirections and
  here-documents are dropped.

What a script does not define (an environment variable, ``$(command)``, a loop variable, the
script's own arguments ``$1`` / ``"$@"``) is never guessed silently: the word keeps a visible
``${NAME}`` placeholder and :attr:`Script.unresolved` names it with the line, so a reader can say
what it could not read (or take a value given with ``klpo doctor --var NAME=VALUE``).
"""

from __future__ import annotations

import ast
import operator
import re
import shlex
from dataclasses import dataclass, field

__all__ = ["Command", "Script", "Unresolved", "read_script"]

_UNQ, _DQ = "\ue002", "\ue003"  # an expandable $, outside quotes / inside double quotes
_HASH = "\ue005"  # a # glued to the character before it: never a comment
_LIT = "\ue006"  # a literal $ (escaped, or inside single quotes)
_PUNCT = ";&|<>"
_SEPARATORS = {";", "&", "&&", "||", "|", "|&", ";;"}
_REDIRECTS = {">", ">>", "<", ">&", "<&", "&>", "&>>", ">|", "<>"}
_DECLARE = {"export", "declare", "local", "readonly", "typeset"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)


@dataclass(frozen=True)
class Unresolved:
    """A ``$NAME`` (or ``$(...)``, ``$1``) the script does not define, where it was used."""

    name: str
    line: int
    assumed: str  # what the word holds in its place


@dataclass
class Command:
    """One simple command: its words after expansion, and the line it starts on."""

    words: list[str]
    line: int


@dataclass
class Script:
    """A script read: its commands, its variables, and what it leaves undefined."""

    commands: list[Command] = field(default_factory=list)
    variables: dict[str, str | list[str]] = field(default_factory=dict)
    unresolved: list[Unresolved] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hydra: dict[str, str] = field(default_factory=dict)  # --config-name / --config-path given
    overrides: dict[str, str] = field(default_factory=dict)  # verl's key -> its override as written

    def find(self, *markers: str) -> Command | None:
        """The last command with a word containing one of ``markers`` (a module or script)."""
        found = None
        for cmd in self.commands:
            if any(m in w for w in cmd.words for m in markers):
                found = cmd
        return found


def _lex(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=_PUNCT)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def _hide_glued_hashes(text: str) -> str:
    """``#`` after a word character is no comment in bash; shlex would take it for one."""
    return re.sub(r"(?<=[^\s;&|()<>])#", _HASH, text)


def _marked_words(text: str) -> list[str]:
    """The line's words, each expandable ``$`` replaced by a marker saying its quoting."""
    text = _hide_glued_hashes(text.replace("\\$", _LIT))
    by_dq = _lex(text.replace("$", f'"{_UNQ}"'))  # visible as '"\ue002"' inside single quotes
    by_sq = _lex(text.replace("$", f"'{_DQ}'"))  # visible as "'\ue003'" inside double quotes
    out = []
    for a, b in zip(by_dq, by_sq, strict=True):
        literal = [p == f'"{_UNQ}"' for p in re.findall(f'"?{_UNQ}"?', a)]
        quoted = [p == f"'{_DQ}'" for p in re.findall(f"'?{_DQ}'?", b)]
        parts = re.split(f'"?{_UNQ}"?', a)
        word = parts[0]
        for lit, dq, rest in zip(literal, quoted, parts[1:], strict=True):
            word += ("$" if lit else _DQ if dq else _UNQ) + rest
        out.append(word.replace(_HASH, "#").replace(_LIT, "$"))
    return out


def _logical_lines(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, marked words) of each logical line, continuations joined."""
    lines = text.splitlines()
    out: list[tuple[int, list[str]]] = []
    i = 0
    while i < len(lines):
        start, buf = i + 1, lines[i]
        i += 1
        while True:
            try:
                words = _marked_words(buf)
                break
            except ValueError as err:
                if i >= len(lines):
                    raise ValueError(f"line {start}: {err} (at the end of the script)") from None
                # backslash-newline: the words join; an open quote: the newline is in the word
                joined = "escaped" in str(err)
                buf = buf[:-1] + lines[i] if joined else buf + "\n" + lines[i]
                i += 1
        out.append((start, words))
    return out


_ARITH_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


def _arith(expr: str, lookup) -> int | None:
    """bash's ``$(( ))`` on integers and names; None where it cannot be evaluated."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            value = lookup(node.id)
            if value is None or not str(value).lstrip("-").isdigit():
                raise ValueError(node.id)
            return int(value)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(ast.dump(node))

    expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr.replace(_UNQ, "$"))
    try:
        return ev(ast.parse(expr.replace("/", "//").strip(), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError):
        return None


class _Expander:
    """Expands marked words against the script's variables, recording what is undefined."""

    def __init__(self, script: Script, given: dict[str, str]):
        self.script, self.given = script, given

    def value(self, name: str) -> str | list[str] | None:
        if name in self.script.variables:
            return self.script.variables[name]
        return self.given.get(name)

    def _scalar(self, name: str) -> str | None:
        v = self.value(name)
        return v[0] if isinstance(v, list) and v else (v if isinstance(v, str) else None)

    def _missing(self, name: str, line: int, default: str | None = None) -> str:
        name = name.replace(_UNQ, "$").replace(_DQ, "$")
        shown = name if name.startswith("$") else "${" + name + "}"
        assumed = default if default is not None else shown
        self.script.unresolved.append(Unresolved(name, line, assumed))
        return assumed

    def _brace(self, body: str, line: int) -> tuple[list[str], bool]:
        """``${body}``: (words, whether it is an array expanded element by element)."""
        m = re.fullmatch(r"#([A-Za-z_][A-Za-z0-9_]*)(\[[@*]\])?", body)
        if m:
            v = self.value(m.group(1))
            if v is None:
                return [self._missing(m.group(1), line)], False
            n = (
                len(v)
                if isinstance(v, list) and m.group(2)
                else len(v[0] if isinstance(v, list) else v)
            )
            return [str(n)], False
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\[(.+)\]", body)
        if m:
            name, index = m.groups()
            v = self.value(name)
            if v is None:
                return [self._missing(name, line)], False
            items = v if isinstance(v, list) else [v]
            if index in ("@", "*"):
                return list(items), index == "@"
            i = _arith(index, self._scalar)
            return [items[i] if i is not None and 0 <= i < len(items) else ""], False
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$])(:?[-=+?])?(.*)", body, re.S)
        if not m:
            return [self._missing(body, line)], False
        name, op, word = m.groups()
        if op is None and word:
            return [self._missing(body, line)], False  # ${A/x/y}, ${A%x}: not evaluated
        v = self._scalar(name) if name not in "@*" else None
        unset = v is None or (op is not None and op.startswith(":") and v == "")
        if op in ("-", ":-", "=", ":="):
            if unset:
                default = self.expand_text(word, line)
                if name not in self.script.variables:
                    self.script.notes.append(
                        f"line {line}: ${{{name}}} is not set in the script; its default "
                        f"{default!r} was used"
                    )
                if op.endswith("="):
                    self.script.variables[name] = default
                return [default], False
            return [v], False
        if op in ("+", ":+"):
            return ["" if unset else self.expand_text(word, line)], False
        return [v if v is not None else self._missing(name, line)], False

    def expand_text(self, text: str, line: int) -> str:
        return " ".join(w for w in self.words(text, line) if w)

    def _pieces(self, word: str, line: int) -> list[str]:
        """(text, splittable) pieces of a marked word; an ``"${A[@]}"`` element ends a piece."""
        out: list[str] = []
        buf, i = "", 0
        while i < len(word):
            c = word[i]
            if c not in (_UNQ, _DQ):
                buf += c
                i += 1
                continue
            split = c == _UNQ
            rest = word[i + 1 :]
            if rest.startswith("(("):
                end = _closing(rest, 0, "(", ")")
                expr = rest[2 : end - 1]
                n = _arith(expr, self._scalar)
                text = str(n) if n is not None else self._missing(f"$(({expr}))", line)
                buf += text
                i += 1 + end + 1
            elif rest.startswith("("):
                end = _closing(rest, 0, "(", ")")
                buf += self._missing(f"$({rest[1:end]})", line)
                i += 1 + end + 1
            elif rest.startswith("{"):
                end = _closing(rest, 0, "{", "}")
                words, elements = self._brace(rest[1:end], line)
                if elements and not split and len(words) != 1:
                    # "${A[@]}": one word per element; the text around sticks to the ends.
                    if not words:
                        i += 1 + end + 1
                        continue
                    out.append(buf + words[0])
                    out.extend(words[1:-1])
                    buf = words[-1]
                else:
                    text = " ".join(words)
                    buf += text if not split else _mark_split(text)
                i += 1 + end + 1
            else:
                m = _NAME.match(rest) or re.match(r"[0-9@*#?$!-]", rest)
                if not m:
                    buf += "$"
                    i += 1
                    continue
                name = m.group(0)
                if name in ("@", "*"):
                    self.script.notes.append(
                        f"line {line}: ${name} passes the script's own arguments on; the "
                        "doctor reads the script as run without any"
                    )
                    text = ""
                else:
                    v = self._scalar(name)
                    text = v if v is not None else self._missing(name, line)
                buf += text if not split else _mark_split(text)
                i += 1 + len(name)
        out.append(buf)
        return out

    def words(self, word: str, line: int) -> list[str]:
        """A marked word as bash's words: unquoted expansions split on whitespace."""
        out: list[str] = []
        for text in self._pieces(word, line):
            out.extend(_split_marked(text) if _SPLIT in text else [text])
        return [w for w in out if w != ""]


_SPLIT = "\ue007"  # bounds an unquoted expansion's text: split on its whitespace


def _mark_split(text: str) -> str:
    return f"{_SPLIT}{text}{_SPLIT}" if any(ch.isspace() for ch in text) else text


def _split_marked(text: str) -> list[str]:
    words, cur, inside = [], "", False
    for ch in text:
        if ch == _SPLIT:
            inside = not inside
        elif inside and ch.isspace():
            if cur:
                words.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        words.append(cur)
    return words


def _closing(text: str, start: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``start`` (or the end of the text)."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def _rejoin_substitutions(words: list[str]) -> list[str]:
    """Rejoin ``$(date +%F)`` that shlex split at its inner space (bash keeps it one word)."""
    out: list[str] = []
    depth = 0
    for w in words:
        if depth > 0:
            out[-1] += " " + w
        else:
            out.append(w)
        if depth > 0 or re.search(f"[{_UNQ}{_DQ}]\\(", w):
            depth = max(depth + w.count("(") - w.count(")"), 0)
    return out


def _events(text: str) -> list[tuple]:
    """The script as a stream of ("cmd", line, separator before, words) and ("array", line,
    name, append, element words) events, words still marked (expanded when they run)."""
    events: list[tuple] = []
    array: tuple[str, bool, int] | None = None  # (name, append, line) inside NAME=( ... )
    elements: list[str] = []
    heredoc: str | None = None
    current: list[str] = []
    sep, current_line = "", 0
    raw = text.splitlines()

    def flush(next_sep: str) -> None:
        nonlocal current, sep
        if current:
            events.append(("cmd", current_line, sep, current))
        current, sep = [], next_sep

    for lineno, words in _logical_lines(text):
        if heredoc is not None:
            if raw[lineno - 1].strip() == heredoc:
                heredoc = None
            continue
        words = _rejoin_substitutions(words)
        i = 0
        while i < len(words):
            w = words[i]
            if array is not None:
                closing = w == ")" or (w.endswith(")") and not w.endswith("\\)"))
                if w != ")":
                    elements.append(w[:-1] if closing else w)
                if closing:
                    events.append(("array", array[2], array[0], array[1], elements))
                    array, elements = None, []
                i += 1
                continue
            m = _ASSIGN.fullmatch(w)
            declaring = all(c in _DECLARE or c.startswith("-") for c in current)
            if m and declaring and m.group(3).startswith("("):
                name, plus, rest = m.groups()
                current = []
                array, elements = (name, bool(plus), lineno), []
                if rest[1:]:
                    words.insert(i + 1, rest[1:])
            elif w in _SEPARATORS:
                flush(w)
            elif w in ("<<", "<<-"):
                if i + 1 < len(words):
                    heredoc = words[i + 1].strip("'\"")
                    i += 1
            elif w in _REDIRECTS or re.fullmatch(r"[0-9]*[<>]+&?", w):
                if current and current[-1].isdigit():
                    current.pop()  # the 2 of 2>&1 (shlex splits it off)
                i += 1  # the redirection's target goes with it
            else:
                if not current:
                    current_line = lineno
                current.append(w)
            i += 1
        if array is None:
            flush(";")
    flush(";")
    return events


_OPENERS = {"if", "case", "for", "while", "until", "select"}
_KEYWORDS = {"then", "else", "do", "{", "}", "!"}


@dataclass
class _Frame:
    kind: str  # "if", "case", "loop"
    parent_active: bool
    active: bool = False
    taken: bool = False
    cond: list[tuple[str, list[str]]] | None = None  # (separator, words) until `then`
    line: int = 0
    value: str = ""  # a case's word
    unknown: bool = False  # the case's word holds a name the script does not define


def read_script(text: str, given: dict[str, str] | None = None) -> Script:
    """Read a shell script into its commands (expanded) and variables.

    ``if``/``elif``/``else`` and ``case`` run the branch bash would take where the test is one
    the doctor can evaluate (``[ ]``/``[[ ]]``/``test`` on strings and integers, ``case``
    patterns); where it cannot, the ``then`` branch is taken and :attr:`Script.notes` says so.
    Loops run their body once. ``given`` supplies values for names the script does not define
    (environment variables, arguments ``1``, ``2``, ...). Raises ``ValueError`` naming the line
    for a quote left open at the end of the script.
    """
    script = Script()
    ex = _Expander(script, dict(given or {}))
    stack: list[_Frame] = []

    def active() -> bool:
        return not stack or stack[-1].active

    for event in _events(text):
        if event[0] == "array":
            _, line, name, append, words = event
            if active():
                elements = [e for w in words for e in ex.words(w, line)]
                old = script.variables.get(name, [])
                base = (old if isinstance(old, list) else [old]) if append else []
                script.variables[name] = base + elements
            continue
        _, line, sep, words = event
        _control(script, ex, stack, line, sep, list(words), active)
    return script


def _control(script, ex, stack, line, sep, words, active) -> None:
    """One simple command under bash's if/case/loops (see :func:`read_script`)."""
    top = stack[-1] if stack else None
    if top is not None and top.cond is not None:
        if words[0] != "then":
            top.cond.append((sep, words))
            return
        value = _condition(ex, top.cond, line, script)
        top.cond = None
        hit = value is not False and not top.taken
        top.active, top.taken = top.parent_active and hit, top.taken or hit
        words = words[1:]
    while words:
        head = words[0]
        if head == "if":
            stack.append(_Frame("if", active(), cond=[("", words[1:])], line=line))
            return
        if head == "elif" and top is not None and top.kind == "if":
            top.cond, top.active = [("", words[1:])], False
            return
        if head == "else" and top is not None and top.kind == "if":
            top.active = top.parent_active and not top.taken
            top.taken = True
            words = words[1:]
            continue
        if head in ("fi", "esac", "done") and stack:
            stack.pop()
            top = stack[-1] if stack else None
            words = words[1:]
            continue
        if head == "case" and len(words) >= 3:
            before = len(script.unresolved)
            value = " ".join(ex.words(words[1], line))
            unknown = len(script.unresolved) > before or "${" in value or "$(" in value
            stack.append(_Frame("case", active(), line=line, value=value, unknown=unknown))
            return
        if top is not None and top.kind == "case" and head.endswith(")") and sep in (";", ";;"):
            import fnmatch

            patterns = head[:-1].lstrip("(").split("|")
            if top.unknown and not top.taken:
                # As an `if` it cannot evaluate: the first branch is read, and said.
                hit = True
                script.notes.append(
                    f"line {top.line}: `case {top.value}` tests a name the script does not "
                    f"define: its first branch (`{head}`) is read; give the value with --var"
                )
            else:
                hit = not top.taken and any(fnmatch.fnmatchcase(top.value, p) for p in patterns)
            top.active, top.taken = top.parent_active and hit, top.taken or hit
            words = words[1:]
            continue
        if head in ("for", "while", "until", "select"):
            stack.append(_Frame("loop", active(), active=active(), line=line))
            if head == "for" and len(words) > 1:
                script.notes.append(
                    f"line {line}: a `for {words[1]}` loop: its body is read once, with "
                    f"${words[1]} undefined"
                )
            return
        if head in _KEYWORDS:
            words = words[1:]
            continue
        break
    if words and active():
        _command(script, ex, words, line)


def _condition(ex, parts, line, script) -> bool | None:
    """A condition list (``[ a ] && [ b ]``) as True/False, or None where it cannot be told."""
    value: bool | None = None
    for i, (sep, words) in enumerate(parts):
        one = _test(ex, words, line)
        if i == 0:
            value = one
        elif sep == "&&":
            value = (
                None if (value is None or one is None) and value is not False else (value and one)
            )
        elif sep == "||":
            value = None if (value is None or one is None) and value is not True else (value or one)
    if value is None:
        text = " ".join(" ".join(w) for _, w in parts).replace(_UNQ, "$").replace(_DQ, "$")
        script.notes.append(
            f"line {line}: the condition `{text}` cannot be evaluated; its `then` branch is read"
        )
    return value


def _test(ex, words: list[str], line: int) -> bool | None:
    """bash's ``[ ... ]`` / ``[[ ... ]]`` / ``test ...`` on strings and integers."""
    negate = False
    if words and words[0] == "!":
        negate, words = True, words[1:]
    if not words or words[0] not in ("[", "[[", "test"):
        return None
    body = words[1:]
    if body and body[-1] in ("]", "]]"):
        body = body[:-1]
    args = [" ".join(ex.words(w, line)) for w in body]
    if any("${" in a or "$(" in a for a in args):
        return None
    ops = {
        "=": lambda a, b: a == b,
        "==": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
    }
    nums = {
        "-eq": "__eq__",
        "-ne": "__ne__",
        "-gt": "__gt__",
        "-lt": "__lt__",
        "-ge": "__ge__",
        "-le": "__le__",
    }
    result: bool | None = None
    if len(args) == 1:
        result = args[0] != ""
    elif len(args) == 2 and args[0] in ("-n", "-z"):
        result = (args[1] != "") == (args[0] == "-n")
    elif len(args) == 3 and args[1] in ops:
        result = ops[args[1]](args[0], args[2])
    elif len(args) == 3 and args[1] in nums:
        try:
            result = getattr(int(args[0]), nums[args[1]])(int(args[2]))
        except ValueError:
            result = None
    if result is None:
        return None
    return not result if negate else result


def _command(script: Script, ex: _Expander, words: list[str], line: int) -> None:
    """Record one simple command: assignments become variables, the rest a command."""
    i = 0
    if words[0] in _DECLARE:
        i = 1
        while i < len(words) and words[i].startswith("-"):
            i += 1
        for w in words[i:]:
            _assign(script, ex, w, line)
        return
    assignments = []
    while i < len(words) and _ASSIGN.fullmatch(words[i]):
        assignments.append(words[i])
        i += 1
    if i == len(words):
        for w in assignments:
            _assign(script, ex, w, line)
        return
    expanded: list[str] = []
    for w in words[i:]:
        expanded.extend(ex.words(w, line))
    inner = _shell_string(expanded)
    if inner is None:
        script.commands.append(Command(expanded, line))
        return
    # `bash -c "…"` (often after `srun …`): the string is a script of its own, run by a new
    # shell that inherits the variables this one exported (all of them, as far as the doctor
    # can tell: it reads every assignment as exported).
    known = {k: v if isinstance(v, str) else " ".join(v) for k, v in script.variables.items()}
    try:
        sub = read_script(inner, {**ex.given, **known})
    except ValueError as err:
        raise ValueError(f"line {line}: in the `-c` string: {err}") from None
    script.notes.append(
        f"line {line}: the command runs `{' '.join(expanded[: expanded.index(inner)])} …`: "
        "the doctor reads the commands inside its string"
    )
    for cmd in sub.commands:
        script.commands.append(Command(cmd.words, line + cmd.line - 1))
    script.unresolved.extend(
        Unresolved(u.name, line + u.line - 1, u.assumed) for u in sub.unresolved
    )
    script.notes.extend(sub.notes)


_SHELLS = {"bash", "sh", "zsh", "dash", "ksh"}


def _shell_string(words: list[str]) -> str | None:
    """The script string of a ``bash -c STRING`` (``sh -lc``, ``/bin/bash -ec``) in ``words``."""
    for j, w in enumerate(words[:-2]):
        if w.rsplit("/", 1)[-1] in _SHELLS and re.fullmatch(r"-[a-z]*c[a-z]*", words[j + 1]):
            return words[j + 2]
    return None


def _assign(script: Script, ex: _Expander, word: str, line: int) -> None:
    m = _ASSIGN.fullmatch(word)
    if not m:
        return
    name, plus, rest = m.groups()
    value = " ".join(ex.words(rest, line)) if rest else ""
    old = script.variables.get(name)
    if plus and isinstance(old, list):
        script.variables[name] = [*old, value]
    else:
        script.variables[name] = (old if isinstance(old, str) and plus else "") + value
