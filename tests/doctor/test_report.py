"""The report's clamp regions, computed in closed form without torch, against autograd of the
same clamped terms on the same grid (the implementation the doctor had when it imported torch),
and the report's gradient facts from the shipped table, not derived at each call."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from klpo.doctor import diagnose, report
from klpo.doctor.reading import Term

FIXTURES = Path(__file__).parent / "fixtures"


def _torch_term(base: str, d: torch.Tensor, term: Term) -> torch.Tensor:
    x = -d
    if term.log_ratio_clamp is not None:
        x = x.clamp(*term.log_ratio_clamp)
    value = {"k1": lambda: -x, "k2": lambda: 0.5 * x * x,
             "k3": lambda: torch.expm1(x) - x, "abs": lambda: x.abs()}[base]()  # fmt: skip
    if term.value_clamp is not None:
        value = value.clamp(*term.value_clamp)
    if (term.estimator or "").endswith("+"):
        k2 = 0.5 * d * d
        value = k2 - k2.detach() + value.detach()
    return value


def _oracle(term: Term, span: float = 30.0, step: float = 1e-3) -> dict:
    """clamp_regions by autograd, on the grid clamp_regions uses."""
    base = report._BASE[term.estimator]
    n = round(2 * span / step) + 1
    grid = [-span + 2 * span * i / (n - 1) for i in range(n)]
    d = torch.tensor(grid, dtype=torch.float64, requires_grad=True)
    value = _torch_term(base, d, term)
    (grad,) = torch.autograd.grad(value.sum(), d)
    plain = Term(**{**asdict(term), "value_clamp": None, "log_ratio_clamp": None})
    d2 = d.detach().clone().requires_grad_(True)
    plain_value = _torch_term(base, d2, plain)
    (plain_grad,) = torch.autograd.grad(plain_value.sum(), d2)
    binds = ((value.detach() != plain_value.detach()) | (grad != plain_grad)).tolist()
    zero = ((grad == 0) & (plain_grad != 0)).tolist()
    return {"binds": _intervals(binds, grid), "zero_gradient": _intervals(zero, grid)}


def _intervals(flags: list[bool], grid: list[float]) -> list[list[float]]:
    """``[lo, hi]`` of each run of True in ``flags``, by ``itertools.groupby`` (not the report's
    own loop, so the oracle shares none of its code)."""
    out, i = [], 0
    for holds, run in itertools.groupby(flags):
        n = len(list(run))
        if holds:
            out.append([grid[i], grid[i + n - 1]])
        i += n
    return out


TERMS = [
    ("low_var_kl", (-10.0, 10.0), (-20.0, 20.0)),  # verl's
    ("k3", (-10.0, 10.0), None),
    ("k3", None, (-20.0, 20.0)),
    ("k1", (-1.0, 1.0), None),
    ("k2", (0.0, 2.0), None),
    ("abs", (None, 3.0), None),
    ("k3+", (-10.0, 10.0), (-20.0, 20.0)),  # straight-through: k2's gradient everywhere
    ("k1+", None, (-5.0, 5.0)),
]


@pytest.mark.parametrize(("estimator", "value_clamp", "log_ratio_clamp"), TERMS)
def test_clamp_regions_equal_autograds_of_the_clamped_term(
    estimator, value_clamp, log_ratio_clamp
) -> None:
    term = Term("x", estimator, estimator, "loss", 1.0, "b", "token-mean", value_clamp,
                log_ratio_clamp)  # fmt: skip
    got = report.clamp_regions(term)
    want = _oracle(term)
    assert got["binds"] == want["binds"] and got["zero_gradient"] == want["zero_gradient"]


def test_the_reports_gradient_facts_come_from_the_shipped_table(monkeypatch) -> None:
    from klpo import registry

    def no_derivation(*_a, **_k):
        raise AssertionError("derived at the call: the shipped table was not read")

    monkeypatch.setattr("klpo.kl.explain", no_derivation)
    (term,) = diagnose(FIXTURES / "trl_grpo_kl.json")["terms"]  # TRL's beta: k3 in the loss
    assert (term["estimator"], term["placement"]) == ("k3", "loss")
    assert term["on_policy"]["gradient"] == registry.GRAD_REF_THETA
    off = registry.explanation("k3", "loss", on_policy=False)  # num_iterations 2, not weighted
    assert off is not None and term["off_policy"] == off.to_dict()
    monkeypatch.undo()
    new = replace(registry.SPECS["k3"], equation="e^-d - 1 + d, registered again")
    monkeypatch.setitem(registry.SPECS, "k3", new)  # not the table's row: derived (torch)
    from klpo import kl

    derived = []
    real = kl.explain
    monkeypatch.setattr(kl, "explain", lambda *a, **k: derived.append(a) or real(*a, **k))
    (term,) = diagnose(FIXTURES / "trl_grpo_kl.json")["terms"]
    assert derived and term["on_policy"]["gradient"] == registry.GRAD_REF_THETA


def test_klpo_doctor_on_a_config_loads_no_torch() -> None:
    code = (
        "import sys, runpy\n"
        "sys.argv = ['klpo', 'doctor', 'configs/grpo.yaml']\n"
        "try:\n    runpy.run_module('klpo', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'}))\n"
    )
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:] + out.stderr[-500:]


def test_klpos_own_config_is_read_as_this_klpo_and_said_compactly() -> None:
    """klpo's own config printed 139 lines (both configs written out key by key, klpo's
    defaults included) and "version not named: assumed" (klpo is the version that runs)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from klpo import __version__
    from klpo.cli import app

    root = Path(__file__).resolve().parents[2]
    result = CliRunner().invoke(app, ["doctor", str(root / "configs/grpo.yaml")])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "version not named" not in out and "assumed" not in out
    assert f"framework: klpo; read by this klpo ({__version__}), its own defaults" in out
    assert "klpo config that does the same thing: the file itself (klpo train -c " in out
    assert "most likely meant: the same\n" in out and "--format json)" in out
    assert len(out.splitlines()) <= 20, out
    # a change it would make is said by its key alone; the JSON keeps the configs whole
    k3 = CliRunner().invoke(app, ["doctor", str(root / "configs/grpo-k3-loss.yaml")]).output
    assert "the file with these changes:\n  kl.estimator: 'k3' -> 'k3+'\n" in k3, k3
    full = CliRunner().invoke(app, ["doctor", str(root / "configs/grpo.yaml"), "--json"])
    record = json.loads(full.output)
    assert record["equivalent"]["config"]["kl"]["estimator"] == "full"
