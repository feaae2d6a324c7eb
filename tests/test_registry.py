"""The torch-free registry: its shipped explain table is klpo.explain's own answers, regenerated
unchanged, and a row registered anew is never answered from the table."""

from __future__ import annotations

from importlib import resources

import pytest

from klpo import explain, kl, registry


def test_the_shipped_table_is_regenerated_unchanged() -> None:
    shipped = resources.files("klpo").joinpath("assets", registry.EXPLAIN_TABLE).read_text("utf-8")
    assert explain.table_text() == shipped, "run `python -m klpo.lab.tables` and commit the table"


@pytest.mark.parametrize("on_policy", [True, False])
def test_the_table_answers_every_row_as_explain_derives_it(on_policy: bool) -> None:
    rows = [(n, p) for n in kl.ESTIMATORS for p in kl.PLACEMENTS]
    rows += [(n, "loss") for n in kl.REF_SAMPLED] if on_policy else []
    for name, placement in rows:
        assert registry.explanation(name, placement, on_policy=on_policy) == kl.explain(
            name, placement, on_policy=on_policy
        ), (name, placement)
    # the answers that matter most, by hand (DESIGN's table)
    e = registry.explanation
    assert e("k3", "loss").gradient == registry.GRAD_REF_THETA and e("k3", "loss").mismatch
    assert e("k1", "loss").gradient == registry.GRAD_ZERO
    assert e("k1", "reward").gradient == registry.GRAD_THETA_REF
    assert e("full", "loss").gradient == registry.GRAD_THETA_REF


def test_a_row_registered_anew_is_not_answered_from_the_table(scratch_registry) -> None:
    assert registry.explanation("k3", "loss") is not None
    other = kl.Spec(kl.k2, kl.THETA_REF, "d²/2, under k3's name", "weighted", "k2")
    kl.register("k3", other, replace=True)
    assert registry.explanation("k3", "loss") is None  # derive it with kl.explain instead
    assert kl.explain("k3", "loss").gradient == registry.GRAD_THETA_REF  # k2's, derived afresh
    assert registry.explanation("no-such-estimator", "loss") is None


def test_a_row_names_its_function_and_imports_it_when_called() -> None:
    ref = registry.SPECS["k3"].fn
    assert repr(ref) == "Ref('klpo.estimators.k3')" and callable(ref)
    assert ref.resolve() is kl.k3 and kl.function("k3") is kl.k3
    assert registry.SPECS["ref_is"].fn is None  # a reference-sampled row has no function
