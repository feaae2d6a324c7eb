"""The frameworks are a table: adding one is one reader module and one row.

A made-up framework ("kitten") is added the way docs/frameworks.md says, "How to add a
framework": a module with ``detect`` and ``read`` written to a temporary folder, one
:func:`klpo.doctor.frameworks.register` call naming it lazily, as the built-in rows do; then its
own YAML file and launch script are detected, read and diagnosed, and every loop over the table
(detection, entry points, the kinds of file, ``--framework``'s names) knows it. The house rules
of the folder are checked too: no reader imports another, no file of the doctor is over 800
lines, and reading the table imports no reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from klpo.doctor import DoctorError, detect, diagnose, frameworks
from klpo.doctor.frameworks import Entry, Framework, KeyPolicy, lazy, register, unregister

DOCTOR = Path(__file__).resolve().parents[2] / "src" / "klpo" / "doctor"

READER = '''
"""Kitten RL's configs (made up for the registry test)."""

from klpo.doctor.advice import build_equivalent, build_intended
from klpo.doctor.reading import Reading, Settings, Term, flatten

DEFAULTS = {"kitten.kl_coef": 0.05, "kitten.kl": "k2", "kitten.samples": 4}


def detect(doc):
    data = doc.data or {}
    return (3, "a kitten: section") if isinstance(data.get("kitten"), dict) else None


def read(doc, version=None):
    if doc.kind == "script":
        values = {}
        for w in doc.entry().arguments:
            k, _, v = w.partition("=")
            values[f"kitten.{k.lstrip('-')}"] = v
    else:
        values = flatten(doc.data)
    r = Reading(framework="kitten", defaults_version="1.0", version=version, source=doc.source)
    s = Settings(values, DEFAULTS, doc.source)
    beta, est = s.float("kitten.kl_coef"), s.str("kitten.kl")
    r.algorithm, r.group_size = "grpo", s.int("kitten.samples")
    r.terms.append(Term(option=f"kl={est}", framework_name=est, estimator=est,
                        placement="loss", beta=beta, beta_option="kitten.kl_coef",
                        reduction="token-mean"))
    build_equivalent(r, {"name": "grpo", "epochs": 1, "minibatches": 1,
                         "loss_reduction": "token-mean"}, {"group_size": r.group_size}, {})
    build_intended(r)
    r.settings = s.read
    return r
'''


@pytest.fixture
def kitten(tmp_path, monkeypatch):
    """The made-up framework: one module (on sys.path) and one row."""
    (tmp_path / "kitten_reader.py").write_text(textwrap.dedent(READER))
    monkeypatch.syspath_prepend(str(tmp_path))
    row = register(
        Framework(
            name="kitten",
            title="Kitten RL",
            versions=("1.0",),
            kinds=frozenset({"mapping", "script"}),
            policy=KeyPolicy("strict", "made up"),
            read=lazy("kitten_reader", "read"),
            detect=lazy("kitten_reader", "detect"),
            entries=(Entry(r"kitten-train"),),
            module="kitten_reader",
        )
    )
    yield row
    unregister("kitten")
    sys.modules.pop("kitten_reader", None)


def test_a_registered_framework_is_detected_read_and_diagnosed(kitten, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("kitten:\n  kl_coef: 0.1\n  kl: k3\n  samples: 8\n")
    assert detect(cfg) == "kitten"
    d = diagnose(cfg)
    assert (d["framework"], d["group_size"]) == ("kitten", 8)
    [t] = d["terms"]
    # What klpo.kl.explain says of k3 in the loss comes with it, as for every framework.
    assert (t["estimator"], t["placement"], t["beta"]) == ("k3", "loss", 0.1)
    assert t["on_policy"]["gradient"] == "grad KL(pi_ref ‖ pi_theta)"
    assert d["intended"]["config"]["kl"]["estimator"] == "k3+"
    # Its launch script, by its entry point behind a launcher.
    sh = tmp_path / "run.sh"
    sh.write_text("torchrun --nproc_per_node 8 kitten-train --kl_coef=0.2 --samples=4\n")
    assert detect(sh) == "kitten"
    assert [x["beta"] for x in diagnose(sh)["terms"]] == [0.2]


def test_every_loop_over_the_table_knows_the_new_row(kitten, tmp_path):
    from klpo import doctor

    assert "kitten" in frameworks.names() and "kitten" in doctor.FRAMEWORKS
    toml = tmp_path / "x.toml"
    toml.write_text("[kitten]\nkl_coef = 0.1\n")
    with pytest.raises(DoctorError, match="kitten is read from its mapping or script"):
        diagnose(toml, framework="kitten")


def test_the_row_goes_away(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("kitten:\n  kl_coef: 0.1\n")
    assert "kitten" not in frameworks.names()
    with pytest.raises(DoctorError, match="not a config of any framework this doctor reads"):
        diagnose(cfg)


def test_no_reader_imports_another():
    readers = {p.stem for p in (DOCTOR / "frameworks").glob("*.py") if p.stem != "__init__"}
    assert {"verl", "trl", "openrlhf", "nemo_rl", "slime", "skyrl", "roll", "areal"} <= readers
    found = []
    for name in sorted(readers):
        tree = ast.parse((DOCTOR / "frameworks" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                other = m.removeprefix("klpo.doctor.frameworks.")
                if m.startswith("klpo.doctor.frameworks.") and other in readers - {name}:
                    found.append(f"{name} imports {other}")
    assert not found, found


def test_no_file_of_the_doctor_is_over_800_lines():
    long = {
        str(p.relative_to(DOCTOR)): n
        for p in DOCTOR.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long


def test_reading_the_table_imports_no_reader():
    code = (
        "import sys, klpo.doctor.frameworks as f\n"
        "assert len(f.ROWS) >= 12\n"
        "print(sorted(m for m in sys.modules if m.startswith('klpo.doctor.frameworks.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_the_doctor_imports_the_measurement_only_for_model():
    # klpo.measure (torch, the trainer's model loading) is imported by `--model` alone.
    fixture = Path(__file__).parent / "fixtures" / "verl_grpo.yaml"
    code = (
        "import sys\n"
        "from klpo.doctor import diagnose, render\n"
        "import klpo.doctor.command\n"
        f"render(diagnose({str(fixture)!r}))\n"
        "print([m for m in sys.modules if m.startswith('klpo.measure')])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_the_docs_table_has_every_row():
    docs = (DOCTOR.parents[2] / "docs" / "frameworks.md").read_text()
    section = docs.split("## The frameworks, as a table")[1].split("\n## ")[0]
    missing = [name for name in frameworks.names() if f"`{name}`" not in section]
    assert not missing, f"docs/frameworks.md's table of frameworks lacks {missing}"
