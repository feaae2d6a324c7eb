"""`klpo lab report --quick` end to end, and the logic of the verdicts on "K2" and "K3"."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpo.cli import app
from klpo.lab.report import PRESETS, verdicts

runner = CliRunner()


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab")
    result = runner.invoke(app, ["lab", "report", "--out", str(out), "--quick"])
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.mark.slow
def test_report_writes_every_file(quick_report):
    out, output = quick_report
    names = {p.name for p in out.iterdir()}
    assert {"report.md", "results.json", "mu_sweep.png", "gradient_cosines.png",
            "ref_is_variants.png", "drift.png"} <= names  # fmt: skip
    assert not [n for n in names if n.endswith(".tmp")]  # atomic writes leave nothing behind
    for png in ("mu_sweep.png", "drift.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'Claims about "K2" and "K3": which hold' in output and "report.md" in output


@pytest.mark.slow
def test_report_progress_is_plain_lines_without_a_terminal(quick_report):
    """Piped, the progress is plain lines: one as each experiment starts (so a long one is seen
    to start), with the elapsed time and an ETA, and one at the end."""
    _, output = quick_report
    lines = [x for x in output.splitlines() if x.startswith("lab report ")]
    units = PRESETS["quick"].units
    parts = [x.split("  ")[1] for x in lines]
    assert list(dict.fromkeys(parts)) == [
        "Schulman's table", "mu sweep", "categorical oracle", "sequence oracle",
        "gradient cosines", "ref_is variants", "drift", "plots", "report.md",
    ]  # fmt: skip
    assert all(" elapsed, ETA " in x for x in lines[:-1])
    assert lines[-1].startswith(f"lab report {units}/{units} (100%)") and "done in" in lines[-1]
    assert len(lines) < units  # a log's rate, not a line per unit


@pytest.mark.slow
def test_report_content(quick_report):
    out, _ = quick_report
    text = (out / "report.md").read_text()
    for heading in ("Schulman's table", "Gradient table", "ref_is variants", "Drift", "which hold"):
        assert heading in text
    results = json.loads((out / "results.json").read_text())
    assert results["preset"]["name"] == "quick"
    assert all(row["within_4se"] for row in results["schulman"])
    for key in ("categorical_oracle", "sequence_oracle"):
        mc = results[key]["monte_carlo"]
        assert mc["value_failures"] == 0 and mc["gradient_failures"] == 0
    v = {i + 1: x["verdict"] for i, x in enumerate(results["verdicts"])}
    assert v[1] == "holds"  # k1 unbiased
    assert v[2] == "does not hold"  # unclipped ref_is is unbiased
    assert v[10] == "does not hold"  # gamma > 0 favours ref_is at small KL
    assert "K2" in text and "`ref_is`" in text
    assert "k2 (ref_is" not in text and "k3 (adaptive_mix" not in text  # never called k2, k3
    assert '"K2" (= ref_is' in text


@pytest.mark.slow
def test_verdicts_follow_the_numbers(quick_report):
    """Change the numbers and the verdicts change: they are computed, not typed in."""
    out, _ = quick_report
    results = json.loads((out / "results.json").read_text())
    altered = copy.deepcopy(results)
    altered["categorical_oracle"]["values"]["ref_is"]["bias"] = 0.01
    assert verdicts(altered)[1]["verdict"] == "holds"
    altered = copy.deepcopy(results)
    w = altered["drift"]["mix_weight_on_k1"]
    w["adaptive_mix (gamma = +10, as written)"] = [1.0] * len(
        w["adaptive_mix (gamma = +10, as written)"]
    )
    assert verdicts(altered)[9]["verdict"] == "holds"


@pytest.mark.slow
def test_claims_page_quotes_every_claim_judged(quick_report):
    """docs/claims.md quotes the text of every claim the verdicts judge, in the report's order."""
    out, _ = quick_report
    results = json.loads((out / "results.json").read_text())
    page = (Path(__file__).resolve().parents[2] / "docs" / "claims.md").read_text()
    at = -1
    for v in results["verdicts"]:
        pieces = [p.strip() for p in v["quote"].split("…") if p.strip()]
        for piece in pieces:
            assert piece in page, f"docs/claims.md does not quote {piece!r} ({v['claim']})"
        first = page.index(pieces[0], at + 1)  # numbered in the same order as the report
        assert first > at, v["claim"]
        at = first
    assert f"{len(results['verdicts'])}. **" in page


def test_presets_count_their_progress_units():
    p = PRESETS["quick"]
    assert p.units == 2 + 4 + 2 + 3 * 1 + 3 + 31 + 1 + 1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_unit_weighs_what_its_part_costs(name):
    """One weight per unit, in the order the suite reports them: each part's cost per unit
    repeated over its units."""
    from klpo.lab.report import PARTS, UNIT_SECONDS

    p = PRESETS[name]
    w = p.unit_weights()
    assert len(w) == p.units
    cost = UNIT_SECONDS[name]
    parts = [*PARTS, "plots", "report.md"]
    assert list(cost) == parts
    runs = [w[0]] + [b for a, b in itertools.pairwise(w) if a != b]
    assert runs == [cost[k] for k in parts]
    assert w.count(cost["drift"]) == p.drift_steps + 1


@pytest.mark.slow
def test_the_training_claim_is_judged_on_a_study_when_given(quick_report):
    out, _ = quick_report
    results = json.loads((out / "results.json").read_text())
    last = verdicts(results)[-1]
    assert last["verdict"] == "not testable here" and "--training" in last["evidence"]
    results["training"] = {"verdict": "does not hold", "evidence": "ratio 22.52 at this scale."}
    last = verdicts(results)[-1]
    assert last["verdict"] == "does not hold" and "ratio 22.52 at this scale." in last["evidence"]
