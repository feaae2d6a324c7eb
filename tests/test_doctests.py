"""The library's docstring examples run as doctests (optax's habit): each public estimator and
loss shows a small call with a value that can be checked by hand, and the suite runs it."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

# The library modules whose examples run here: quick, no files, no network.
MODULES = (
    "klpo.kl",
    "klpo.registry",
    "klpo.estimators",
    "klpo.explain",
    "klpo._lazy",
    "klpo.losses",
    "klpo.ref_kl",
    "klpo.offpolicy",
    "klpo.trust_region",
    "klpo.teacher",
    "klpo.vocab_parallel",
    "klpo.loss_metrics",
    "klpo._names",
    "klpo._threads",
    "klpo.doctor.advice",
    "klpo.train.rewards.decimals",
    "klpo.train.rewards.overopt",
    "klpo.train.data.chat_task",
    "klpo.train.rollout.versions",
    "klpo.train.rollout.samplers",
    "klpo.train.models.packing",
    "klpo.train.rollout.worker",
    "klpo.measure.render",
    "klpo.measure.probe",
    "klpo.lab.stats",
    "klpo.lab.teacher",
    "klpo.train.data.sources",
)
# Where every public function must carry an example.
EVERY_FUNCTION = ("klpo.kl", "klpo.registry", "klpo.teacher", "klpo.losses", "klpo.ref_kl")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name, scratch_registry):
    # kl.register's example registers and removes an estimator: put back, whatever happens.
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} has no docstring examples"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


@pytest.mark.parametrize("name", EVERY_FUNCTION)
def test_every_public_function_has_an_example(name):
    module = importlib.import_module(name)
    missing = [
        f
        for f in module.__all__
        if inspect.isfunction(getattr(module, f))
        and ">>>" not in (inspect.getdoc(getattr(module, f)) or "")
    ]
    assert missing == [], f"{name}: public functions without a runnable example: {missing}"


def test_a_wrong_example_fails():
    """The runner above does fail on a wrong value (the test has power)."""
    bad = doctest.DocTestParser().get_doctest(
        ">>> import torch\n>>> torch.tensor([0.5]) * 2\ntensor([2.])\n", {}, "bad", None, 0
    )
    runner = doctest.DocTestRunner()
    runner.run(bad, out=lambda _: None)
    assert runner.summarize(verbose=False).failed == 1
