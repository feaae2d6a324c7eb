"""The GPU check, one command: klpo on CUDA, side by side with TRL and Liger-Kernel, one table.

    bash bench/gpu_check.sh [--dry-run]     # from the repository root; drives this script

Stages, each in a process of its own with its own time limit, all within ``--budget`` seconds
(560: 9⅓ minutes); a stage that fails or runs out of time is reported as such and the rest run:

1. ``tests/test_cuda.py``: the kernels, the twelve KL estimators and two GRPO steps on the device
   against float64 on the CPU.
2. The model: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 / 2 heads, MLP 4864) with the real
   vocabulary size, 151,936 (``compute_workload.SHAPES["0.5b"]``, ~494M parameters, a word-level
   tokenizer; built locally on the GPU, no download).
3. GRPO on the job of workload (c) of ``bench/trainer_vs_trl.py`` (64-token prompts, 8 completions
   of 128 tokens each, k3 in the loss at beta 0.01, token-mean, clip 0.2, AdamW 2e-4, the same
   prompts and seed) with 16 prompts a step and 4 steps, bf16 (mixed precision: float32 weights,
   bf16 autocast): klpo with LoRA r=16 on one GPU; TRL's ``GRPOTrainer`` on the same job with the
   same LoRA on the same GPU (``trainer_vs_trl.trl_job``); klpo's full fine-tune with FSDP and
   gradient checkpointing on all GPUs; klpo's full fine-tune on one GPU with the exact KL in the
   loss (``kl.estimator=full``), the forward-pass gradient (``klpo.logprobs.fused_loss``) on,
   then off (``algo.fused_loss: on``, ``off``). Tokens/s as ``trainer_vs_trl`` measures it (median
   over steps 2..N of completion tokens over step time) and the peak GPU memory of rank 0.
4. The log-prob kernels, forward + backward of a per-token weighted sum at N = 4096 tokens,
   H = 896, V = 151,936, bf16: naive PyTorch (the float32 logits), ``klpo.logprobs.fused`` and
   ``fused_loss``, and Liger-Kernel's Triton kernels (``LigerFusedLinearCrossEntropyLoss`` with
   per-token outputs for the log-probs; ``LigerFusedLinearJSD`` at ``jsd_beta=1``, KL(policy ‖
   reference), for the KL); median of 5 interleaved rounds after a warm-up (CUDA-synchronised),
   peak memory over the inputs', max |error| against float64 on 64 tokens.
5. The overlap of sampling with the update (docs/async.md): the LoRA run of stage 3 with the
   sampler one version behind (``rollout.staleness=1``), in the trainer's process (the
   deterministic mode: sample, then update) and in the rollout worker's (``rollout.asynchronous``:
   step t+1's batch sampled while step t updates). Both train on the same batches, so their
   metrics agree but for the timings (a digest of them is compared); the ratio of tokens/s is
   what the overlap gains, and ``time/generate`` falls to the wait for the worker's batch.

``--dry-run`` runs the same stages and code paths on the CPU at tiny shapes (a 2-layer model with
4096 vocabulary entries, 2 prompts × 4 completions of 8 tokens, 2 steps, FSDP on 2 processes,
kernels at N = 64, H = 32, V = 4096, the CUDA tests collected, not run): a check of the script
itself, in the test suite. Where TRL or Liger-Kernel is not importable their cells say so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import trainer_vs_trl as bench  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """The shapes and limits of one check: the real one, or the dry run's."""

    shape: str  # compute_workload.SHAPES
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    steps: int
    threads: int
    kernel: tuple[int, int, int]  # N, H, V
    limits: dict[str, float]  # seconds per stage
    budget: float  # seconds for all stages
    fsdp_procs: int | None = None  # None: all GPUs


GPU = Plan(
    "0.5b", 16, 8, 128, 4, 4, (4096, 896, 151936),
    {"tests": 100, "build": 90, "lora": 100, "trl": 130, "kernels": 90, "fsdp": 100,
     "fused on": 80, "fused off": 80, "stale sync": 80, "stale async": 80},
    budget=560,
)  # fmt: skip
DRY = Plan(
    "tiny", 2, 4, 8, 2, 1, (64, 32, 4096),
    dict.fromkeys(["tests", "build", "lora", "trl", "kernels", "fsdp", "fused on", "fused off",
                   "stale sync", "stale async"], 300),
    budget=1800,  # a busy CPU: generous; the stages take ~1 minute together on idle cores
    fsdp_procs=2,
)  # fmt: skip
LORA = ["model.dtype=bfloat16", "model.lora={r: 16, alpha: 32}"]
FUSED = ["model.dtype=bfloat16", "kl.estimator=full"]  # the exact KL: a forward-pass gradient
STAGES = {  # klpo's runs: their overrides
    "lora": LORA,
    "fsdp": ["model.dtype=bfloat16", "dist.strategy=fsdp", "model.gradient_checkpointing=true"],
    "fused on": [*FUSED, "algo.fused_loss=on"],  # at any vocabulary (the dry run's too)
    "fused off": [*FUSED, "algo.fused_loss=off"],  # the per-token path: the backward's gradient
    "stale sync": [*LORA, "rollout.staleness=1"],  # sample with the version one back, then update
    "stale async": [*LORA, "rollout.staleness=1", "rollout.asynchronous=true"],  # overlapped
}


def job(plan: Plan, model_dir: str, data_path: str) -> bench.Settings:
    """Workload (c)'s GRPO job at the plan's size, on the model in ``model_dir``."""
    return bench.Settings.for_workload(
        "c",
        prompts_per_step=plan.prompts_per_step,
        group_size=plan.group_size,
        max_new_tokens=plan.max_new_tokens,
        steps=plan.steps,
        threads=plan.threads,
        model_dir=model_dir,
        data_path=data_path,
    )


# ---------------------------------------------------------------------------------------------
# Workers: each stage's process writes one JSON file.


def _peak_gib():
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def build_worker(plan: Plan, model_dir: str, data_path: str) -> dict:
    """The model (drawn on the GPU where there is one) and the run's prompts."""
    import torch

    import compute_workload

    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute_workload.build_model(Path(model_dir), plan.shape, device=device)
    n = plan.steps * plan.prompts_per_step
    compute_workload.write_prompts(Path(data_path), n, 0, plan.shape)
    shape = compute_workload.SHAPES[plan.shape]
    return {"device": device, "vocab": shape.words + len(compute_workload.SPECIALS)}


def klpo_worker(plan: Plan, s: bench.Settings, run_dir: str, stage: str) -> dict | None:
    """One ``klpo train`` run in this process (under torchrun for FSDP); rank 0's summary."""
    import torch

    import klpo.logprobs as lp
    from klpo.train import loop
    from klpo.train.config import load_config
    from klpo.train.runtime.metrics import read_metrics

    calls = _count_calls(lp, "fused_loss")
    cfg = load_config(None, [*bench.klpo_overrides(s, run_dir), *STAGES[stage]])
    _reset_peak()
    loop.train(cfg, log=lambda *_: None)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "time/step" in r]
    n = s.completions_per_step
    out = bench.summarize(
        [r["time/step"] for r in rows],
        [r["completion/length"] * n for r in rows],
        [r["reward/mean"] for r in rows],
    )
    update = statistics.median(r["time/update"] for r in rows[1:] or rows)  # steps 2..N
    generate = statistics.median(r["time/generate"] for r in rows[1:] or rows)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {**out, "update": update, "generate": generate, "peak_gib": _peak_gib(),
            "world": world, "cuda": torch.cuda.is_available(), "fused_loss_calls": calls[0],
            "digest": metrics_digest(rows)}  # fmt: skip


def metrics_digest(rows: list[dict]) -> str:
    """A hash of every metric but the timings and the memory: two runs of one job on the same
    batches (the stale sampler in the trainer's process or in the worker's) give the same."""
    import hashlib

    kept = [
        {
            k: v
            for k, v in sorted(r.items())
            if not k.startswith(("time/", "memory/", "tokens_per_s"))
        }
        for r in rows
    ]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def _count_calls(module, name: str) -> list[int]:
    """Wrap ``module.name`` to count its calls (which path the update took); the count, live."""
    count, fn = [0], getattr(module, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return fn(*args, **kwargs)

    setattr(module, name, counted)
    return count


def trl_worker(s: bench.Settings) -> dict:
    """TRL's GRPOTrainer on the same job: bf16 mixed precision and the same LoRA as klpo's."""
    import torch

    try:
        import peft
        import trl  # noqa: F401
    except ImportError as err:
        return {"error": f"not importable ({err})"}
    cuda = torch.cuda.is_available()
    lora = peft.LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )  # klpo's model.lora={r: 16, alpha: 32}: all linear layers but the head, no dropout
    _reset_peak()
    raw = bench.trl_job(s, {"use_cpu": not cuda, "bf16": True}, lora)
    out = bench.summarize(raw["step_s"], raw["tokens"], raw["rewards"])
    return {**out, "peak_gib": _peak_gib(), "version": raw["version"]}


def worker(args: argparse.Namespace) -> None:
    plan = DRY if args.dry_run else GPU
    import torch

    torch.set_num_threads(plan.threads)
    if args.worker == "build":
        result = build_worker(plan, args.model, args.data)
    elif args.worker == "kernels":
        import gpu_kernels

        result = gpu_kernels.measure(*plan.kernel)
    else:
        s = job(plan, args.model, args.data)
        if args.worker == "trl":
            result = trl_worker(s)
        else:
            result = klpo_worker(plan, s, args.run_dir, args.worker)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The driver: the stages in order, each in its own process, then one table.


def _run(cmd: list[str], limit: float, log: Path, env: dict) -> tuple[int | None, float]:
    """Run ``cmd`` as a process group, output to ``log``, for at most ``limit`` s: its exit code
    (None if it ran out of time: the whole group is killed) and wall time."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, time.monotonic() - t0
    return proc.returncode, time.monotonic() - t0


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return (lines or ["no output"])[-1].strip()


def run_stage(cmd: list[str], limit: float, out: Path, log: Path, env: dict) -> dict:
    """One worker: its JSON result, or the error (the last line of its output)."""
    rc, wall = _run(cmd, limit, log, env)
    if rc is None:
        return {"error": f"timeout after {limit:.0f} s", "wall_s": wall}
    if rc != 0 or not out.is_file():
        return {"error": _last_line(log)[:200], "wall_s": wall}
    return {**json.loads(out.read_text()), "wall_s": wall}


def tests_stage(dry: bool, limit: float, logs: Path, env: dict) -> dict:
    """``tests/test_cuda.py``; the dry run collects them on the CPU (running them there is
    ``KLPO_TEST_DEVICE=cpu``, minutes on two cores)."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"]
    if dry:
        cmd.append("--collect-only")
        env = {**env, "KLPO_TEST_DEVICE": "cpu"}
    log = logs / "tests.log"
    rc, wall = _run(cmd, limit, log, env)
    if rc is None:
        return {"error": f"timeout after {limit:.0f} s", "wall_s": wall}
    return {"summary": _last_line(log).strip("= "), "ok": rc == 0, "wall_s": wall}


def stages(plan: Plan, dry: bool, work: Path, gpus: int) -> list[tuple[str, list[str]]]:
    """(stage, command) in order: the model first, then the runs and the kernels."""
    py, me = sys.executable, str(HERE / "gpu_check.py")
    common = ["--model", str(work / "model"), "--data", str(work / "prompts.jsonl")]
    common += ["--dry-run"] if dry else []

    def cmd(name: str, runner: list[str] = (py,)) -> list[str]:
        run_dir = str(work / name.replace(" ", "-"))
        out = str(work / f"{name.replace(' ', '-')}.json")
        return [*runner, me, "--worker", name, *common, "--run-dir", run_dir, "--out", out]

    procs = plan.fsdp_procs or gpus
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    return [
        ("build", cmd("build")),
        ("lora", cmd("lora")),
        ("trl", cmd("trl")),
        ("kernels", cmd("kernels")),
        ("fsdp", cmd("fsdp", torchrun)),
        ("fused on", cmd("fused on")),
        ("fused off", cmd("fused off")),
        ("stale sync", cmd("stale sync")),
        ("stale async", cmd("stale async")),
    ]


def drive(args: argparse.Namespace) -> dict:
    import torch

    dry = args.dry_run
    plan = DRY if dry else GPU
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check needs a GPU (--dry-run runs it on the CPU)")
    gpus = torch.cuda.device_count() if not dry else 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE),
           os.environ.get("PYTHONPATH", "")]), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip
    if dry:
        env["OMP_NUM_THREADS"] = "1"
    budget = args.budget or plan.budget
    start = time.monotonic()
    results: dict[str, dict] = {"gpus": gpus, "dry_run": dry}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        logs = Path(args.logs) if args.logs else work
        logs.mkdir(parents=True, exist_ok=True)
        results["tests"] = tests_stage(dry, plan.limits["tests"], logs, env)
        _progress("tests", results["tests"], start)
        for name, cmd in stages(plan, dry, work, gpus):
            left = budget - (time.monotonic() - start)
            if left < 15 or "error" in results.get("build", {}):
                why = "the model was not built" if "error" in results.get("build", {}) else "time"
                results[name] = {"error": f"skipped ({why})"}
                continue
            if name == "trl" and importlib.util.find_spec("trl") is None:
                results[name] = {"error": "absent"}
                continue
            out = work / f"{name.replace(' ', '-')}.json"
            log = logs / f"{name.replace(' ', '-')}.log"
            results[name] = run_stage(cmd, min(plan.limits[name], left), out, log, env)
            _progress(name, results[name], start)
    results["wall_s"] = time.monotonic() - start
    return results


def _progress(name: str, r: dict, start: float) -> None:
    state = r.get("error") or r.get("summary") or "ok"
    print(f"[{time.monotonic() - start:5.0f} s] {name}: {state}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The table.


def _num(r: dict, key: str, spec: str) -> str:
    v = r.get(key)
    return "-" if v is None else format(v, spec)


def _ratio(a: dict, b: dict, key: str) -> str:
    x, y = a.get(key), b.get(key)
    return f"**{x / y:.2f}**" if x is not None and y else "-"


def _cell(r: dict, key: str, spec: str) -> str:
    """The number, or why there is none: "absent", "failed" or "timeout" (details below)."""
    if "error" not in r:
        return _num(r, key, spec)
    e = r["error"]
    return "absent" if e == "absent" else "timeout" if e.startswith("timeout") else "failed"


def table(res: dict) -> str:
    """One table: each check with klpo's number, its reference's and their ratio."""
    rows = ["| check | klpo | reference | klpo / reference |", "| --- | ---: | ---: | ---: |"]
    t = res["tests"]
    rows.append(f"| tests/test_cuda.py | {t.get('summary') or t.get('error')} | | |")
    lora, trl = res["lora"], res["trl"]
    name = f"TRL {trl.get('version', '')}".strip()
    for key, what, spec in (("tokens_per_s", "tokens/s", ".0f"), ("peak_gib", "peak GiB", ".2f")):
        rows.append(
            f"| GRPO bf16 + LoRA r=16, 1 GPU: {what} | {_cell(lora, key, spec)} | "
            f"{name}: {_cell(trl, key, spec)} | {_ratio(lora, trl, key)} |"
        )
    fsdp = res["fsdp"]
    rows.append(
        f"| GRPO bf16 full, FSDP + checkpointing, {fsdp.get('world', res['gpus'])} GPUs: "
        f"tokens/s, peak GiB (rank 0) | {_cell(fsdp, 'tokens_per_s', '.0f')}, "
        f"{_cell(fsdp, 'peak_gib', '.2f')} | | |"
    )
    on, off = res["fused on"], res["fused off"]
    for key, what, spec in (
        ("tokens_per_s", "tokens/s", ".0f"),
        ("update", "update s", ".3f"),
        ("peak_gib", "peak GiB", ".2f"),
    ):
        rows.append(
            f"| forward-pass gradient, bf16 full, exact KL: {what} | on {_cell(on, key, spec)} | "
            f"off {_cell(off, key, spec)} | {_ratio(on, off, key)} |"
        )
    sync, overlap = res["stale sync"], res["stale async"]
    same = sync.get("digest") is not None and sync.get("digest") == overlap.get("digest")
    for key, what, spec in (
        ("tokens_per_s", "tokens/s", ".0f"),
        ("generate", "generate s", ".3f"),
        ("median_step_s", "step s", ".3f"),
    ):
        rows.append(
            f"| sampler one version behind, LoRA: {what} | worker {_cell(overlap, key, spec)} | "
            f"in-process {_cell(sync, key, spec)} | {_ratio(overlap, sync, key)} |"
        )
    rows.append(
        f"| the two on the same batches (metrics digest) | {'same' if same else 'DIFFER'} | | |"
    )
    rows += kernel_rows(res["kernels"])
    return "\n".join(rows)


def kernel_rows(k: dict) -> list[str]:
    """Per case and klpo method: time and peak memory against naive and Liger."""
    if "error" in k:
        return [f"| log-prob kernels | {k['error']} | | |"]
    rows = []
    for case, methods in k["cases"].items():
        naive, liger = methods.get("naive", {}), methods.get("liger", {})
        for m in ("klpo fused", "klpo fused_loss"):
            r = methods.get(m, {})
            for key, what, spec in (("ms", "ms", ".1f"), ("peak_mib", "peak MiB", ".0f")):
                ref = f"naive {_cell(naive, key, spec)}; Liger {_cell(liger, key, spec)}"
                ratio = f"{_ratio(r, naive, key)}; {_ratio(r, liger, key)}"
                rows.append(f"| {case}, {m}: {what} | {_cell(r, key, spec)} | {ref} | {ratio} |")
    return rows


def details(res: dict) -> str:
    """What the table leaves out: each stage's error, every kernel's numbers, the wall times."""
    lines = [f"{n}: {r['error']}" for n, r in res.items() if isinstance(r, dict) and "error" in r]
    for case, methods in res["kernels"].get("cases", {}).items():
        for m, r in methods.items():
            if "error" in r:
                lines.append(f"{case} {m}: {r['error']}")
                continue
            lines.append(
                f"{case} {m}: {r['ms']:.2f} ms [{r['ms_min']:.2f}, {r['ms_max']:.2f}], peak "
                f"{_num(r, 'peak_mib', '.0f')} MiB, err {_num(r, 'err', '.1e')}"
            )
    walls = [
        f"{n} {r['wall_s']:.0f} s" for n, r in res.items() if isinstance(r, dict) and "wall_s" in r
    ]
    lines.append(f"stages: {', '.join(walls)}; total {res['wall_s']:.0f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget", type=float, help="seconds for all stages (560; dry run 1800)")
    parser.add_argument("--logs", help="keep each stage's output in this folder")
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    for hidden in ("--model", "--data", "--run-dir", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    res = drive(args)
    where = "CPU dry run (tiny shapes)" if res["dry_run"] else f"{res['gpus']} GPU(s)"
    print(f"## GPU check: {where}\n")
    print(table(res))
    print("\n" + details(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
