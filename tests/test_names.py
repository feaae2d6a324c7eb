"""klpo._names.LiveNames: a view computed when read, as the registry's name lists use it."""

from __future__ import annotations

import pytest

from klpo import registry
from klpo._names import LiveNames


def test_the_view_is_the_tuple_of_now():
    table = {"a": 1, "b": 2}
    view = LiveNames(lambda: tuple(table), "the keys")
    assert view == ("a", "b") and view == ["a", "b"] and view != ("a",)
    assert view[1] == "b" and view[-1] == "b" and view[:1] == ("a",)
    assert list(view) == ["a", "b"] and len(view) == 2 and "a" in view
    assert view.index("b") == 1 and view.count("a") == 1  # Sequence's mixins, on the names now
    table["c"] = 3
    del table["a"]
    assert view == ("b", "c") and "a" not in view and repr(view) == "('b', 'c')"
    assert view.__doc__ == "the keys" and view != "bc"
    with pytest.raises(TypeError):
        hash(view)  # not a constant: no hash


def test_the_registrys_lists_see_a_row_added_after_import(scratch_registry):
    """ESTIMATORS and LOGPROB_ESTIMATORS were built at import; a row registered now is in them
    (a copy of k2's traits under a new name), and REF_SAMPLED is unchanged."""
    before = registry.REF_SAMPLED.now()
    spec = scratch_registry["k2"]
    registry.register("k2_again", spec)
    assert registry.ESTIMATORS[-1] == "k2_again" and "k2_again" in registry.LOGPROB_ESTIMATORS
    assert before == registry.REF_SAMPLED
