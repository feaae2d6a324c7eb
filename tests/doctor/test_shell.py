"""klpo.doctor.shell against bash itself.

Oracle: bash. Each script here ends in a command whose words are what a launcher would receive;
the test runs the same script under ``bash`` with that command a function printing each argument
NUL-terminated (so word boundaries, newlines included, are visible) and compares bash's words with the reader's.
Skipped where bash is absent. Cases the oracle cannot show (what is left undefined, notes) are
checked against the hand-written expectation in the test.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from klpo.doctor.shell import read_script

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash as the oracle")


def _bash_words(script: str, command: str = "launch", cwd: str | None = None) -> list[str]:
    """The words bash passes to ``command`` (a function printing one argument per line)."""
    body = f"{command}() {{ printf '%s\\0' \"$@\"; printf '%s\\0' '<<end>>'; }}\n{script}"
    out = subprocess.run(
        [BASH, "-c", body], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, cwd=cwd
    )
    assert out.returncode == 0, out.stderr
    words = out.stdout.split("\0")
    return words[: words.index("<<end>>")]


def _ours(script: str) -> list[str]:
    cmd = read_script(script).find("launch")
    assert cmd is not None
    return cmd.words[1:]


CASES = {
    "comment inside an array ends at its line": """
ARGS=(
   --a 1   # a note with a 'quote
   --b 2
   # --c 3
   --d "four words here"
)
launch "${ARGS[@]}" --e 5
""",
    "variables, braces and defaults": """
rollout_n=5
MODEL=${MODEL:-Qwen/Qwen2.5-7B}
EMPTY=
launch n=${rollout_n} m=$MODEL d=${UNSET_X:-8} e=${EMPTY:-fallback} f=${EMPTY-kept}
""",
    "arithmetic and nested expansion": """
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
launch tokens=$(((max_prompt_length + max_response_length) * 2)) p=$max_prompt_length
""",
    "single quotes stay literal, double quotes expand": """
X=value
launch '$X' "$X" "pre-${X}-post" '${X}' \\$X
""",
    "unquoted expansion is split, quoted is not": """
EXTRA="--f 6 --g 7"
launch $EXTRA "$EXTRA"
""",
    "continuations and glued hashes": """
launch \\
    --name run#2 \\
    --x=1 \\
    --y 2
""",
    "appended arrays and element counts": """
A=(--one 1)
A+=(--two 2)
B=x
B+=y
launch "${A[@]}" count=${#A[@]} first=${A[0]} b=$B
""",
    "if and case take bash's branch": """
device_name=cuda
P=(a=1)
if [ "$device_name" ] && [ "$device_name" == "npu" ]; then
    P+=(npu=1)
elif [ "$device_name" = cuda ]; then
    P+=(cuda=1)
else
    P+=(other=1)
fi
DEVICE=gpu
case "${DEVICE}" in
    gpu)
        n=8
        ;;
    npu)
        n=16
        ;;
esac
launch "${P[@]}" n=$n
""",
    "several commands, separators and redirections": """
set -e; export A=1 && B=2
launch --a $A --b $B 2>&1 | tee log.txt
""",
    "a multi-line quoted value": """
launch --json '{"a": 1,
  "b": 2}' --z 0
""",
}


@needs_bash
@pytest.mark.parametrize("name", list(CASES))
def test_words_are_bashs(name, tmp_path):
    script = CASES[name]
    assert _ours(script) == _bash_words(script, cwd=str(tmp_path))


def test_comment_in_array_keeps_every_later_setting():
    # Without the comment rule, everything after "# note" would vanish.
    words = _ours(CASES["comment inside an array ends at its line"])
    assert words == ["--a", "1", "--b", "2", "--d", "four words here", "--e", "5"]


def test_undefined_names_are_named_not_guessed():
    script = "launch --model $MODEL_PATH --out ${SAVE}/x --when $(date +%F) --arith $((N * 2))\n"
    s = read_script(script)
    words = s.find("launch").words
    assert words[1:] == [
        "--model",
        "${MODEL_PATH}",
        "--out",
        "${SAVE}/x",
        "--when",
        "$(date +%F)",
        "--arith",
        "$((N * 2))",
    ]
    assert [u.name for u in s.unresolved] == ["MODEL_PATH", "SAVE", "$(date +%F)", "$((N * 2))"]
    assert all(u.line == 1 for u in s.unresolved)


def test_given_values_fill_undefined_names():
    s = read_script("launch --n ${ROLLOUT_N:-5} --m $M\n", {"ROLLOUT_N": "8", "M": "x"})
    assert s.find("launch").words[1:] == ["--n", "8", "--m", "x"]
    assert s.unresolved == []


def test_script_arguments_are_noted():
    s = read_script('launch --a 1 "$@"\n')
    assert s.find("launch").words[1:] == ["--a", "1"]
    assert any("script's own arguments" in n for n in s.notes)


def test_conditions_it_cannot_evaluate_are_noted():
    s = read_script("if [ -f /etc/x ]; then\n  A=1\nfi\nlaunch a=$A\n")
    assert s.find("launch").words[1:] == ["a=1"]
    assert any("cannot be evaluated" in n for n in s.notes)


def test_heredoc_body_is_not_commands():
    s = read_script("cat <<EOF > x.yaml\nlaunch --nope 1\nEOF\nlaunch --yes 2\n")
    assert [c.words for c in s.commands if c.words[0] == "launch"] == [["launch", "--yes", "2"]]


def test_quote_left_open_names_the_line():
    with pytest.raises(ValueError, match="line 2: No closing quotation"):
        read_script("A=1\nlaunch --x 'open\n")


def test_a_case_on_a_command_substitution_reads_its_first_branch():
    # verl's gspo example: DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' ... || echo gpu)}; the
    # substitution is never run, so `case "${DEVICE}"` reads its first branch and says so.
    text = (
        "DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}\n"
        'case "${DEVICE}" in\n    gpu)\n        BS=512\n        ;;\n    npu)\n        BS=256\n'
        "        ;;\nesac\npython3 run.py bs=$BS\n"
    )
    s = read_script(text)
    assert s.commands[-1].words == ["python3", "run.py", "bs=512"]
    assert any("first branch (`gpu)`)" in n for n in s.notes)
