"""The tests mirror the modules: every module of ``src/klpo`` has a test file named after it
(``test_<module>.py``, without the module's leading underscore; a package's ``__init__.py`` is
named after the package) in the module's folder under ``tests/`` or a folder above it; or a line
of :data:`COVERED_BY` says which test covers it instead; or it holds no code (a docstring,
``from __future__``, ``__all__``).

The reasons are kept honest both ways: a reason must name a test file that exists, and a module
that gains its own test file or goes away must leave the table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

COVERED_BY: dict[str, str] = {
    # The library.
    "klpo/__init__.py": "tests/test_packaging.py: the version, `import klpo` loading no torch, "
    "the submodules imported on first use",
    "klpo/__main__.py": "tests/doctor/test_distillation.py: `python -m klpo doctor` as a process",
    "klpo/_extras.py": "tests/test_packaging.py: the extras table against pyproject, what a "
    "missing package's error names",
    "klpo/_lazy.py": "tests/test_registry.py: a row's function named by module (Ref), resolved "
    "on the first call; its doctests in tests/test_doctests.py",
    "klpo/_logits.py": "tests/test_logprobs.py: the logit transforms and the kernels' shared "
    "arithmetic against the naive forms",
    "klpo/estimators.py": "tests/test_kl.py: every estimator against its closed form and "
    "enumeration (through klpo.kl, its face)",
    "klpo/explain.py": "tests/test_registry.py: klpo explain's answers regenerated unchanged",
    "klpo/fused_kernel.py": "tests/test_logprobs.py: fused against the naive log-softmax, values "
    "and gradients",
    "klpo/fused_loss_kernel.py": "tests/test_logprobs.py: fused_loss's value and gradient against "
    "the unfused loss",
    "klpo/teacher_kernel.py": "tests/test_teacher.py: from_hidden and from_hidden_loss (through "
    "klpo.teacher, their face) against float64 naive divergences, values and gradients",
    "klpo/loss_metrics.py": "tests/test_losses.py: policy_metrics, value_metrics and kl_metrics "
    "against hand values",
    "klpo/trust_region.py": "tests/test_offpolicy.py: the effective sample size and the "
    "trust-region metrics, pooled over shares",
    # The command line.
    "klpo/cli/compare.py": "tests/study/test_compare.py: klpo compare's runs, report and lines; "
    "tests/test_cli.py",
    "klpo/cli/__main__.py": "tests/test_cli.py: `python -m klpo.cli explain` as a process",
    "klpo/cli/common.py": "tests/test_packaging.py: a command without its install says which to "
    "install, in one line",
    "klpo/cli/doctor.py": "tests/doctor/test_doctor_cli.py: klpo doctor's options and exit codes",
    "klpo/cli/probe.py": "tests/measure/test_probe.py: klpo probe's table, --json and exit codes",
    "klpo/cli/explain.py": "tests/test_cli.py: klpo explain's tables and --json",
    "klpo/cli/lab.py": "tests/lab/test_lab_cli.py: klpo lab gaussian, categorical, sequence",
    "klpo/cli/tools.py": "tests/train/models/test_reference.py: klpo make-reference; "
    "tests/train/tools/test_docs.py: klpo docs",
    "klpo/cli/train.py": "tests/train/test_train_cli.py: klpo train's options, printed, checked "
    "or run",
    # The doctor.
    "klpo/doctor/__init__.py": "tests/doctor/test_readers.py: detect, read and diagnose on every "
    "framework's files",
    "klpo/doctor/advice.py": "tests/doctor/test_examples.py: the equivalent klpo configs built "
    "and validated",
    "klpo/doctor/command.py": "tests/doctor/test_doctor_cli.py: klpo doctor's body, text and JSON",
    "klpo/doctor/distill.py": "tests/doctor/test_distillation.py: the distillation terms and traps",
    "klpo/doctor/document.py": "tests/doctor/test_peers.py: files read as Documents",
    "klpo/doctor/frameworks/__init__.py": "tests/doctor/test_registry.py: the table, a row added "
    "and removed",
    "klpo/doctor/frameworks/areal.py": "tests/doctor/test_evidence.py: AReaL's configs read line "
    "by line",
    "klpo/doctor/frameworks/klpo_config.py": "tests/doctor/test_readers.py: klpo's own configs "
    "detected and read",
    "klpo/doctor/frameworks/nemo_rl.py": "tests/doctor/test_evidence.py: NeMo-RL's configs",
    "klpo/doctor/frameworks/openrlhf.py": "tests/doctor/test_readers.py: OpenRLHF's launch scripts",
    "klpo/doctor/frameworks/prime_rl.py": "tests/doctor/test_evidence.py: prime-rl's TOML configs",
    "klpo/doctor/frameworks/roll.py": "tests/doctor/test_field.py: ROLL's example configs",
    "klpo/doctor/frameworks/skyrl.py": "tests/doctor/test_evidence.py: SkyRL's launch scripts",
    "klpo/doctor/frameworks/slime.py": "tests/doctor/test_evidence.py: slime's launch scripts",
    "klpo/doctor/frameworks/trl_distill.py": "tests/doctor/test_distillation.py: TRL's "
    "distillation configs",
    "klpo/doctor/frameworks/trl.py": "tests/doctor/test_readers.py: TRL's GRPOConfig and "
    "RLOOConfig files; tests/doctor/test_trl_parser.py against the installed TRL",
    "klpo/doctor/frameworks/verl.py": "tests/doctor/test_readers.py: verl's YAML and launch "
    "scripts; tests/doctor/test_verl_hydra.py",
    "klpo/doctor/keys.py": "tests/doctor/test_rules.py: unknown keys under each key policy",
    "klpo/doctor/launch.py": "tests/doctor/test_launchers.py: entry points of launch scripts",
    "klpo/doctor/nemo_rl_distill.py": "tests/doctor/test_distillation.py: NeMo-RL's distillation",
    "klpo/doctor/pyscript.py": "tests/doctor/test_field.py: TRL config calls in Python scripts "
    "(the Unsloth notebooks)",
    "klpo/doctor/reading.py": "tests/doctor/test_rules.py: settings, findings, refusals",
    "klpo/doctor/tables.py": "tests/doctor/test_tables_source.py: the shipped tables against "
    "the frameworks' source",
    "klpo/doctor/trl_config.py": "tests/doctor/test_trl_parser.py: TRL's config classes against "
    "the installed TRL",
    "klpo/doctor/verl_distill.py": "tests/doctor/test_distillation.py: verl's distillation",
    # The lab.
    "klpo/lab/__init__.py": "tests/lab/test_lab_names.py: its names are its modules' objects, "
    "its docstring lists every module",
    "klpo/lab/claims.py": "tests/lab/test_report.py: the verdicts follow the numbers",
    "klpo/lab/experiments.py": "tests/lab/test_report.py: the quick suite end to end",
    "klpo/lab/plots.py": "tests/lab/test_report.py: the report's PNG figures written",
    "klpo/lab/sections.py": "tests/lab/test_report.py: report.md's content",
    "klpo/lab/stats.py": "tests/lab/test_montecarlo.py: ValueStats, RunningStats and cosine "
    "against numpy",
    "klpo/lab/summaries.py": "tests/lab/test_lab_cli.py: the JSON records of klpo lab",
    "klpo/lab/training.py": "tests/lab/test_training_claim.py: the training claim judged",
    # The measurement (klpo doctor --model).
    "klpo/measure/__init__.py": "tests/doctor/test_measure.py: the measurement's names in use",
    "klpo/measure/errors.py": "tests/doctor/test_measure.py: the refusals (MeasureError)",
    "klpo/measure/intervals.py": "tests/doctor/test_measure.py: jackknife intervals, the verdict",
    "klpo/measure/models.py": "tests/doctor/test_measure.py: the pair loaded, tokenizers compared",
    "klpo/measure/objectives.py": "tests/doctor/test_measure.py: per-token terms, objectives",
    "klpo/measure/prompts.py": "tests/doctor/test_measure.py: --data read and rendered",
    "klpo/measure/render.py": "tests/doctor/test_measure.py: the measurement for people",
    "klpo/measure/run.py": "tests/doctor/test_measure.py: the measurement end to end",
    "klpo/measure/sketch.py": "tests/doctor/test_measure.py: sketched gradients against exact ones",
    # The studies.
    "klpo/study/grid.py": "tests/study/test_compare.py: the grid of a study",
    "klpo/study/report.py": "tests/study/test_compare.py: results.csv, plots and report.md of a "
    "study",
    "klpo/study/runner.py": "tests/study/test_compare.py: a study run as klpo train processes",
    "klpo/study/spec.py": "tests/study/test_real_study.py: presets and study files loaded",
    "klpo/study/summary.py": "tests/study/test_verdicts.py: results.csv rows from metrics",
    # The trainer.
    "klpo/train/algorithm_fns.py": "tests/train/test_loop.py: the advantages each row computes",
    "klpo/train/algorithms.py": "tests/train/test_where_to_add.py: an algorithm and a policy loss "
    "added as rows",
    "klpo/train/choices.py": "tests/train/test_where_to_add.py: an engine added as a row",
    "klpo/train/config/algo.py": "tests/train/config/test_config.py: algo.* validated",
    "klpo/train/config/common.py": "tests/train/config/test_config.py: table-checked choices, "
    "errors naming the key",
    "klpo/train/config/data.py": "tests/train/config/test_config.py: data.* and rewards validated",
    "klpo/train/config/files.py": "tests/train/config/test_config.py: YAML and --set into a "
    "TrainConfig, written back",
    "klpo/train/config/model.py": "tests/train/config/test_config.py: model.* validated",
    "klpo/train/config/rollout.py": "tests/train/config/test_config.py: rollout.* validated",
    "klpo/train/config/run.py": "tests/train/config/test_config.py: optim.*, run.*, dist.* "
    "validated",
    "klpo/train/config/train.py": "tests/train/config/test_config.py: the checks across sections",
    "klpo/train/config_files.py": "tests/train/config/test_config_files.py: files merged in "
    "order, each key's source",
    "klpo/train/data/load.py": "tests/train/data/test_chat_task.py: the examples of data.source",
    "klpo/train/data/markers.py": "tests/train/data/test_chat_markers.py: rendered chat refused",
    "klpo/train/data/sources.py": "tests/train/data/test_data_formats.py: JSONL and datasets",
    "klpo/train/evaluate.py": "tests/train/test_eval_cache.py: held-out accuracy, cached",
    "klpo/train/models/backbone.py": "tests/train/models/test_logits_path.py: hidden states "
    "against the model's own logits",
    "klpo/train/models/build.py": "tests/train/models/test_model_kinds.py: each kind of model built",
    "klpo/train/models/cache.py": "tests/train/models/test_model_kinds.py: cache support per model",
    "klpo/train/models/describe.py": "tests/train/test_first_lines.py: the run's first lines",
    "klpo/train/models/load.py": "tests/train/rollout/test_sampler.py: models and tokenizers "
    "loaded; tests/train/models/test_gguf.py: .gguf sources",
    "klpo/train/outdir.py": "tests/train/behaviour/test_nothing_lost.py: output directories "
    "claimed and locked, nothing overwritten",
    "klpo/train/resume.py": "tests/train/behaviour/test_nothing_lost.py: resumed runs, the "
    "config's changes recorded",
    "klpo/train/rewards/decimals.py": "tests/test_doctests.py: numbers_in's examples; "
    "tests/train/rewards/test_rewards.py: the numeric reward",
    "klpo/train/rewards/functions.py": "tests/train/rewards/test_rewards.py: reward functions, "
    "weighted and summed",
    "klpo/train/rewards/gold.py": "tests/train/rewards/test_overopt.py: the gold reward logged",
    "klpo/train/rewards/model.py": "tests/train/rewards/test_reward_model.py: a learned reward",
    "klpo/train/rollout/reward_batch.py": "tests/train/rewards/test_reward_forms.py: the batch "
    "the reward functions get",
    "klpo/train/rollout/samplers.py": "tests/train/rollout/test_sampler.py: sampling and layout",
    "klpo/train/rollout/versions.py": "tests/train/behaviour/test_staleness.py: the ring and the "
    "behaviour pass",
    "klpo/train/runtime/dist.py": "tests/train/step/test_step_metrics.py: one and two processes "
    "give the same metrics",
    "klpo/train/runtime/metrics.py": "tests/train/step/test_step_metrics.py: every metric "
    "documented and emitted, Tally's invariance",
    "klpo/train/runtime/plots.py": "tests/train/runtime/test_run_report.py: smoothed curves, "
    "nothing drawn for a constant",
    "klpo/train/runtime/report.py": "tests/train/runtime/test_run_report.py: a run's report.md "
    "and plots",
    "klpo/train/runtime/samples.py": "tests/train/runtime/test_report_prompts.py: samples.jsonl",
    "klpo/train/runtime/stop.py": "tests/train/runtime/test_stop_command.py: stopping on a signal",
    "klpo/train/runtime/trackers.py": "tests/train/runtime/test_run_outputs.py: the trackers",
    "klpo/train/setup.py": "tests/train/runtime/test_run_outputs.py: setup, save and restore",
    "klpo/train/step/after_step.py": "tests/train/step/test_kl_options.py: the controllers after "
    "each step",
    "klpo/train/step/dynamic.py": "tests/train/step/test_dynamic_sampling.py: dynamic sampling",
    "klpo/train/step/fused.py": "tests/train/test_loop.py: when the gradient is taken in the "
    "head's forward",
    "klpo/train/step/kl_term.py": "tests/train/rollout/test_ref_samples.py: the KL term with the "
    "reference's samples; tests/train/step/test_step_one_exact.py",
    "klpo/train/step/microbatch.py": "tests/train/step/test_precision.py: micro-batch splits",
    "klpo/train/step/sample_records.py": "tests/train/runtime/test_run_outputs.py: the records "
    "of samples.jsonl",
    "klpo/train/step/sampling.py": "tests/train/behaviour/test_staleness.py: each way of sampling",
    "klpo/train/step/score.py": "tests/train/step/test_step_one_exact.py: step one's values exact",
    "klpo/train/step/types.py": "tests/train/test_loop.py: who fills the sampling pass",
    "klpo/train/step/update.py": "tests/train/test_loop.py: the update's micro-steps",
    "klpo/train/tools/export.py": "tests/train/models/test_gguf.py: a run exported",
    "klpo/train/tools/make_reference.py": "tests/train/models/test_reference.py: the reference "
    "made by seeded SFT",
    "klpo/train/tools/make_reward_model.py": "tests/train/rewards/test_reward_model.py: the "
    "reward model made",
    "klpo/train/tools/real_models.py": "tests/train/models/test_gguf.py: the real models' sources",
    "klpo/train/tools/scaffold.py": "tests/train/models/test_reference.py: make-reference trains "
    "and saves through it",
}
"""Modules without a test file of their own name: the test that covers each, and how."""

_TEST_PATH = re.compile(r"tests/[\w/]+\.py")


def _modules(src: Path) -> dict[str, Path]:
    """Each module of ``src/klpo`` by its path under ``src`` (``klpo/train/config/kl.py``)."""
    return {p.relative_to(src).as_posix(): p for p in sorted((src / "klpo").rglob("*.py"))}


def _test_name(rel: str) -> str:
    """The name of the test file a module is mirrored by: ``test_<stem>.py`` (``_io.py``:
    ``test_io.py``), a package's by its folder."""
    path = Path(rel)
    return f"test_{(path.parent.name if path.name == '__init__.py' else path.stem).strip('_')}.py"


def _mirrored(rel: str, tests: Path) -> bool:
    """A test file of the module's name in the module's folder under ``tests/`` or one above it:
    ``klpo/train/config/files.py`` by ``tests/train/config/test_files.py``, ``tests/train/`` or
    ``tests/``, never by ``tests/lab/test_files.py`` (which mirrors ``klpo/lab/files.py``); a
    package's ``__init__.py`` by ``test_<package>.py`` in the package's folder or above it."""
    folder = Path(rel).parent.relative_to("klpo").parts
    name = _test_name(rel)
    return any((tests.joinpath(*folder[:i]) / name).is_file() for i in range(len(folder) + 1))


def _holds_no_code(path: Path) -> bool:
    """Only a docstring, ``from __future__`` imports and ``__all__``."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if targets and all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        return False
    return True


def unmirrored(src: Path, tests: Path, covered: dict[str, str]) -> dict[str, list[str]]:
    """What breaks the mirror: modules with no test file and no reason, reasons naming no
    existing test file, reasons for modules that are gone or have their own test file now."""
    modules = _modules(src)
    root = tests.parent
    return {
        "no test file and no reason": [
            rel
            for rel, path in modules.items()
            if not _mirrored(rel, tests) and rel not in covered and not _holds_no_code(path)
        ],
        "reason names no test file that exists": [
            rel
            for rel, why in covered.items()
            if not (paths := _TEST_PATH.findall(why))
            or not all((root / p).is_file() for p in paths)
        ],
        "reason for a module that is gone": sorted(set(covered) - set(modules)),
        "reason for a module with its own test file": [
            rel for rel in covered if rel in modules and _mirrored(rel, tests)
        ],
    }


def test_every_module_has_a_test_named_after_it_or_a_reason():
    broken = {k: v for k, v in unmirrored(SRC, ROOT / "tests", COVERED_BY).items() if v}
    assert not broken, broken


def test_the_check_sees_each_way_the_mirror_breaks(tmp_path):
    """A made-up tree: a module with no test, a reason naming a missing test, a stale reason, a
    reason beside a test of the module's own name, and a package with no code."""
    src, tests = tmp_path / "src", tmp_path / "tests"
    (src / "klpo" / "rooms").mkdir(parents=True)
    (tests / "rooms").mkdir(parents=True)
    (src / "klpo" / "__init__.py").write_text('"""A package."""\n\n__all__: list[str] = []\n')
    (src / "klpo" / "rooms" / "__init__.py").write_text("X = 1\n")
    for name in ("bare", "tested", "reasoned", "badly"):
        (src / "klpo" / f"{name}.py").write_text("def f():\n    return 1\n")
    (tests / "test_tested.py").write_text("")
    (tests / "rooms" / "test_rooms.py").write_text("")
    (tests / "test_other.py").write_text("")
    # A test of the same name in another folder mirrors that folder's module, not this one.
    (src / "klpo" / "cli").mkdir()
    (src / "klpo" / "cli" / "lab.py").write_text("X = 1\n")
    (tests / "lab").mkdir()
    (tests / "lab" / "test_lab.py").write_text("")
    covered = {
        "klpo/reasoned.py": "tests/test_other.py: covers it",
        "klpo/badly.py": "tests/test_missing.py: gone",
        "klpo/tested.py": "tests/test_other.py: it has its own now",
        "klpo/gone.py": "tests/test_other.py: was here",
    }
    assert unmirrored(src, tests, covered) == {
        # rooms/__init__.py is mirrored by tests/rooms/test_rooms.py, klpo/__init__.py holds no code
        "no test file and no reason": ["klpo/bare.py", "klpo/cli/lab.py"],
        "reason names no test file that exists": ["klpo/badly.py"],
        "reason for a module that is gone": ["klpo/gone.py"],
        "reason for a module with its own test file": ["klpo/tested.py"],
    }
