"""klpo's training step, part by part, against the model alone, in one process.

``bench/trainer_vs_trl.py`` times whole runs in their own processes, so its klpo / floor ratio
carries the run-to-run spread of a shared machine. This script builds klpo's models and one
step's batch exactly as that benchmark's workload (a) does, then times, interleaved on the same
batch: the floor's three parts (the bare cached argmax decode, the reference's no-grad forward
with the log-softmax at the completion tokens, the policy's forward + backward of the same) and
klpo's (``generate`` with the lean sampler, ``klpo.train.step.score.score``, the update's
``micro_step`` alone, again with the per-token path forced (``algo.fused_loss=off``: the
log-probs' gradient taken in the backward pass, not the forward), and the whole
``update`` with the optimizer step and the gradient clip). ``--workload b`` builds that
benchmark's 23.5M-parameter model; ``--set`` adds klpo overrides (``kl.estimator=full``: the
default exact KL in the loss, where the update's on-policy pass takes the forward-pass gradient;
the benchmarks' ``k3`` cannot). Median of ``--reps`` rounds (20) after two warm-ups,
milliseconds::

    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false python bench/trainer_parts.py
    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false python bench/trainer_parts.py \
        --workload b --reps 3 --set kl.estimator=full
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer_vs_trl as bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--workload", choices=bench.WORKLOADS, default="a", help="a or b")
    parser.add_argument("--set", action="append", default=[], help="a klpo override, k=v")
    args = parser.parse_args()
    s = bench.Settings.for_workload(args.workload)
    torch.set_num_threads(s.threads)
    tmp = tempfile.mkdtemp()  # the model and prompts of workload b; removed at the end
    try:
        run(args, s, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, s: bench.Settings, tmp: str) -> None:
    from klpo import reduce
    from klpo.train.config import load_config
    from klpo.train.models.backbone import Backbone
    from klpo.train.models.build import build_models
    from klpo.train.rewards.model import build_rewards
    from klpo.train.rollout.samplers import completion_hidden, generate
    from klpo.train.runtime.dist import Dist
    from klpo.train.runtime.metrics import Tally
    from klpo.train.setup import make_optimizers
    from klpo.train.step.score import score
    from klpo.train.step.types import SamplingPass
    from klpo.train.step.update import micro_step, update

    if args.workload == "b":
        import compute_workload

        model_dir = compute_workload.build_model(Path(tmp) / "model-b")
        data = compute_workload.write_prompts(Path(tmp) / "prompts-b.jsonl", 4 * 64, s.seed)
        s = bench.Settings(**{**s.__dict__, "model_dir": str(model_dir), "data_path": str(data)})
    cfg = load_config(None, [*bench.klpo_overrides(s, tmp), *args.set])
    torch.manual_seed(s.seed)
    m = build_models(cfg, Dist(), None)
    order = bench.prompt_order(bench.Settings(**{**s.__dict__, "steps": 1}))
    prompts, answers = [p for p, _ in order], [a for _, a in order]
    model, g = m.policy, s.group_size
    model.eval()
    new = s.max_new_tokens
    ro = generate(model, m.tokenizer, prompts, answers, group_size=g, max_new_tokens=new)
    model.train()
    backbone, weight = Backbone(model), model.get_output_embeddings().weight
    reward_fns = build_rewards(cfg.rewards)
    opt = make_optimizers(cfg, m)
    gen = torch.Generator().manual_seed(s.seed)
    scored = score(cfg, m, ro, reward_fns, s.beta)
    rows = torch.arange(len(ro.prompts))
    n_tokens = reduce.normaliser(ro.mask, cfg.algo.loss_reduction, max_len=new)

    def floor_generate():
        bench.floor_decode(model, ro, g)

    def logp(net, head):
        h = completion_hidden(net, ro)
        return (h @ head.T).float().log_softmax(-1).gather(-1, ro.completion_ids[..., None])

    def floor_reference():
        with torch.no_grad():
            logp(m.reference, m.reference.head()[0])

    def floor_policy():
        model.zero_grad(set_to_none=True)
        (logp(backbone, weight).squeeze(-1) * ro.mask).sum().backward()

    def klpo_generate():
        model.eval()
        with torch.no_grad():
            generate(model, m.tokenizer, prompts, answers, group_size=g, max_new_tokens=new)
        model.train()

    def klpo_score():
        score(cfg, m, ro, reward_fns, s.beta)

    def fresh():  # the update records pi_old from its own forward: start from an empty record
        sc = copy.copy(scored)
        sc.old = SamplingPass.empty(scored.logp_ref)
        return sc

    def klpo_micro_step():
        model.zero_grad(set_to_none=True)
        micro_step(cfg, m, fresh(), rows, s.beta, 1.0, n_tokens, Dist(), sync=True, tally=Tally())

    def klpo_micro_step_per_token():
        mode, cfg.algo.fused_loss = cfg.algo.fused_loss, "off"
        try:
            klpo_micro_step()
        finally:
            cfg.algo.fused_loss = mode

    def klpo_update():
        update(cfg, m, fresh(), opt, s.beta, 1.0, Dist(), gen)

    cases = {
        "floor: generate": floor_generate,
        "klpo: generate": klpo_generate,
        "floor: reference": floor_reference,
        "klpo: score": klpo_score,
        "floor: policy": floor_policy,
        "klpo: micro_step": klpo_micro_step,
        "klpo: micro_step, per-token path": klpo_micro_step_per_token,
        "klpo: update": klpo_update,
    }
    for fn in cases.values():
        fn()
        fn()
    ms = {k: [] for k in cases}
    for _ in range(args.reps):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            ms[k].append(1e3 * (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(bench.cpu_info())
    print("| part | ms, median (min–max) |\n| --- | ---: |")
    for k, v in ms.items():
        print(f"| {k} | {med[k]:.1f} ({min(v):.1f}–{max(v):.1f}) |")
    floor = med["floor: generate"] + med["floor: reference"] + med["floor: policy"]
    step = med["klpo: generate"] + med["klpo: score"] + med["klpo: update"]
    print(
        f"\nklpo generate + score + update {step:.1f} ms, floor {floor:.1f} ms: {step / floor:.2f}x"
    )


if __name__ == "__main__":
    main()
