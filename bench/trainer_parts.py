"""klpo's training step, part by part, against the model alone, in one process.

``bench/trainer_vs_trl.py`` times whole runs in their own processes, so its klpo / floor ratio
carries the run-to-run spread of a shared machine. This script builds klpo's models and one
step's batch exactly as that benchmark's workload (a) does, then times, interleaved on the same
batch: the floor's three parts (the bare cached argmax decode, the reference's no-grad forward
with the log-softmax at the completion tokens, the policy's forward + backward of the same) and
klpo's (``generate`` with the lean sampler, ``klpo.train.step.score.score``, the update's
``micro_step`` alone with the forward-pass gradient on (``algo.fused_loss=on``) and again with the
per-token path forced (``algo.fused_loss=off``: the log-probs' gradient taken in the backward
pass, not the forward), and the whole ``update`` with the optimizer step and the gradient clip,
as configured (``auto``: on from ``klpo.train.step.fused.FUSED_LOSS_MIN_VOCAB`` entries) and
again with the per-token path). ``--workload b`` builds that benchmark's 23.5M-parameter model,
``--workload c`` its 104M one with a real vocabulary (151,936 entries), ``--workload d`` and
``e`` the real models (SmolLM2-135M-Instruct with its chat prompts, Gemma 3 270M; ``make
real-models``); ``--vocab N`` gives (b) or (c)'s body a vocabulary of N entries instead (where the forward-pass gradient starts to pay);
``--only TEXT`` times only the parts whose name holds TEXT; ``--packing`` adds scoring and
the micro-step with packed rows (``algo.packing=on``; the batch scored packed once, so its
micro-step keeps that layout) and with padded rows each computing its prompt
(``rollout.share_prompt=false``), on the same batch, and prints the batch's token positions and
pad share in each layout and the reference's packed log-probs against the padded ones (the
models are built with packing off, so the load-time probe is not run); ``--set`` adds klpo overrides
(``kl.estimator=full``: the default exact KL in the loss, where the update's on-policy pass takes
the forward-pass gradient; the benchmarks' ``k3`` cannot). Median of ``--reps`` rounds (20) after
``--warmups`` (2), the parts interleaved within each round, milliseconds of wall time, or with
``--cpu-time`` of this process's CPU time (with ``--threads 1`` what a busy machine's other
processes do not change; each call is then also logged on stderr as it ends)::

    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false python bench/trainer_parts.py
    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false python bench/trainer_parts.py \
        --workload c --reps 3 --set kl.estimator=full
    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false python bench/trainer_parts.py \
        --workload c --vocab 32768 --reps 5 --only micro --set kl.estimator=full
    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false nice -n 19 python bench/trainer_parts.py \
        --workload c --threads 1 --cpu-time --warmups 1 --reps 2 --only micro_step \
        --set kl.estimator=full    # the forward-pass gradient on vs off, on a busy machine
    PYTHONPATH=$PWD/src TOKENIZERS_PARALLELISM=false python bench/trainer_parts.py \
        --workload d --packing --only klpo --reps 5    # packed rows against padded ones
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
    parser.add_argument("--workload", choices=bench.WORKLOADS, default="a", help="a, b, c, d or e")
    parser.add_argument("--vocab", type=int, help="(b), (c): this vocabulary size instead")
    parser.add_argument("--only", default="", help="time only the parts whose name holds this")
    parser.add_argument("--set", action="append", default=[], help="a klpo override, k=v")
    parser.add_argument("--threads", type=int, default=bench.Settings.threads, help="torch threads")
    parser.add_argument(
        "--prompts", type=int, help="the batch's prompts (the workload's: 16, 4, 2)"
    )
    parser.add_argument("--new-tokens", type=int, help="max new tokens (the workload's)")
    parser.add_argument("--warmups", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument(
        "--packing",
        action="store_true",
        help="also score and micro_step with packed rows (algo.packing=on) and with padded rows "
        "each computing its prompt (rollout.share_prompt=false), on the same batch",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time in this process's CPU seconds, not wall seconds (with one thread: insensitive "
        "to other processes on a busy machine); each call's time is also logged on stderr",
    )
    args = parser.parse_args()
    if args.vocab is not None and args.workload not in bench.BUILT:
        parser.error(
            f"--vocab applies to the built models of workloads b and c, not {args.workload}"
        )
    more = {"prompts_per_step": args.prompts} if args.prompts else {}
    if args.new_tokens:
        more["max_new_tokens"] = args.new_tokens
    s = bench.Settings.for_workload(args.workload, threads=args.threads, **more)
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
    from klpo.train.optimizers import make_optimizers
    from klpo.train.rewards.model import build_rewards
    from klpo.train.rollout.samplers import Decoding, completion_hidden, generate
    from klpo.train.runtime.dist import Dist
    from klpo.train.runtime.metrics import Tally
    from klpo.train.step.kl_term import kl_term
    from klpo.train.step.score import score
    from klpo.train.step.types import SamplingPass
    from klpo.train.step.update import MicroBatch, micro_step, update

    if args.workload in bench.REAL:
        s = bench.with_built_model(s, Path(tmp))
    elif args.workload != "a":
        import compute_workload

        w, v = args.workload, args.vocab
        model_dir = compute_workload.build_model(Path(tmp) / f"model-{w}", w, v)
        data = compute_workload.write_prompts(
            Path(tmp) / f"prompts-{w}.jsonl", 4 * 64, s.seed, w, v
        )
        s = bench.Settings(**{**s.__dict__, "model_dir": str(model_dir), "data_path": str(data)})
    cfg = load_config(None, [*bench.klpo_overrides(s, tmp), *args.set])
    torch.manual_seed(s.seed)
    m = build_models(cfg, Dist(), None)
    prompts, answers = bench.rendered_prompts(s, m.tokenizer)  # chat ones rendered
    model, g = m.policy, s.group_size
    model.eval()
    new = s.max_new_tokens
    ro = generate(
        model,
        m.tokenizer,
        prompts,
        answers,
        Decoding(group_size=g, max_new_tokens=new),
        codec=m.codec,
    )
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

    def floor_reference():
        with torch.no_grad():
            hidden = completion_hidden(m.reference, ro)
            bench.floor_head(hidden, m.reference.head()[0], ro, backward=False)

    def floor_policy():
        model.zero_grad(set_to_none=True)
        bench.floor_head(completion_hidden(backbone, ro), weight, ro, backward=True)

    def klpo_generate():
        model.eval()
        with torch.no_grad():
            generate(
                model,
                m.tokenizer,
                prompts,
                answers,
                Decoding(group_size=g, max_new_tokens=new),
                codec=m.codec,
            )
        model.train()

    def klpo_score():
        score(cfg, m, ro, reward_fns, s.beta)

    def fresh():  # the update records pi_old from its own forward: start from an empty record
        sc = copy.copy(scored)
        sc.old = SamplingPass.empty(scored.logp_ref)
        return sc

    def klpo_micro_step():
        model.zero_grad(set_to_none=True)
        micro_step(
            cfg,
            m,
            MicroBatch.of(cfg, fresh(), rows, n_tokens),
            kl_term(cfg, beta=s.beta, beta_old=1.0),
            Dist(),
            sync=True,
            tally=Tally(),
        )

    def with_cfg(fn, key: str, value):  # the same part with cfg's ``section.field`` = value
        section, name = key.split(".")
        part = getattr(cfg, section)

        def run():
            before = getattr(part, name)
            setattr(part, name, value)
            try:
                fn()
            finally:
                setattr(part, name, before)

        return run

    def with_mode(fn, mode: str):  # the same part with algo.fused_loss set to ``mode``
        return with_cfg(fn, "algo.fused_loss", mode)

    # --packing: the batch scored once with packed rows, so that its micro-steps run packed
    # (the layout is planned by scoring and kept by every later pass)
    scored_packed = None
    if args.packing:
        cfg.algo.packing = "on"
        try:
            scored_packed = score(cfg, m, ro, reward_fns, s.beta)
        finally:
            cfg.algo.packing = "off"

    def klpo_micro_step_packed():
        model.zero_grad(set_to_none=True)
        sc = copy.copy(scored_packed)
        sc.old = SamplingPass.empty(scored_packed.logp_ref)
        micro_step(
            cfg,
            m,
            MicroBatch.of(cfg, sc, rows, n_tokens),
            kl_term(cfg, beta=s.beta, beta_old=1.0),
            Dist(),
            sync=True,
            tally=Tally(),
        )

    def klpo_update():
        update(cfg, m, fresh(), opt, kl_term(cfg, beta=s.beta, beta_old=1.0), Dist(), gen)

    cases = {
        "floor: generate": floor_generate,
        "klpo: generate": klpo_generate,
        "floor: reference": floor_reference,
        "klpo: score": klpo_score,
        "floor: policy": floor_policy,
        "klpo: micro_step": with_mode(klpo_micro_step, "on"),
        "klpo: micro_step, per-token path": with_mode(klpo_micro_step, "off"),
        "klpo: update": klpo_update,
        "klpo: update, per-token path": with_mode(klpo_update, "off"),
    }
    if args.packing:
        cases.update(
            {
                "klpo: score, packed": with_cfg(klpo_score, "algo.packing", "on"),
                "klpo: score, prompt per row": with_cfg(klpo_score, "rollout.share_prompt", False),
                "klpo: micro_step, packed": with_cfg(
                    with_mode(klpo_micro_step_packed, "on"), "algo.packing", "on"
                ),
                "klpo: micro_step, prompt per row": with_cfg(
                    with_mode(klpo_micro_step, "on"), "rollout.share_prompt", False
                ),
            }
        )
    cases = {k: fn for k, fn in cases.items() if args.only in k}
    print(f"vocabulary {weight.shape[0]}, {sum(p.numel() for p in model.parameters())} parameters")
    clock = time.process_time if args.cpu_time else time.perf_counter
    ms = {k: [] for k in cases}
    for i in range(args.warmups + args.reps):
        for k, fn in cases.items():
            t0 = clock()
            fn()
            t = 1e3 * (clock() - t0)
            print(f"round {i + 1} ({'warm-up' if i < args.warmups else 'timed'}) {k}: {t:.1f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
            if i >= args.warmups:
                ms[k].append(t)
    print(bench.cpu_info())
    print(f"{'CPU' if args.cpu_time else 'wall'} milliseconds, {args.reps} timed rounds")
    print(parts_table(ms))
    if scored_packed is not None:
        print(packing_lines(bench.layout_record(scored_packed.rollout)))
        gap = (scored_packed.logp_ref - scored.logp_ref).abs().masked_fill(~ro.mask, 0).max()
        print(f"the reference's log-probs, packed against padded: largest difference {gap:.1e}")


def parts_table(ms: dict[str, list[float]]) -> str:
    """The medians (min–max), each klpo part over its floor part, and the whole step's ratio."""
    med = {k: statistics.median(v) for k, v in ms.items()}
    floor_of = {
        "klpo: generate": "floor: generate",
        "klpo: score": "floor: reference",
        "klpo: micro_step": "floor: policy",
        "klpo: micro_step, per-token path": "floor: policy",
        "klpo: update": "floor: policy",
        "klpo: update, per-token path": "floor: policy",
        "klpo: score, packed": "floor: reference",
        "klpo: score, prompt per row": "floor: reference",
        "klpo: micro_step, packed": "floor: policy",
        "klpo: micro_step, prompt per row": "floor: policy",
    }
    rows = ["| part | ms, median (min–max) | / floor part |", "| --- | ---: | ---: |"]
    for k, v in ms.items():
        f = floor_of.get(k)
        ratio = f"{med[k] / med[f]:.2f}" if f in med else ""
        rows.append(f"| {k} | {med[k]:.1f} ({min(v):.1f}–{max(v):.1f}) | {ratio} |")
    out = "\n".join(rows)
    floor_parts = ("floor: generate", "floor: reference", "floor: policy")
    step_parts = ("klpo: generate", "klpo: score", "klpo: update")
    if all(k in med for k in (*floor_parts, *step_parts)):
        floor = sum(med[k] for k in floor_parts)
        step = sum(med[k] for k in step_parts)
        out += f"\n\nklpo generate + score + update {step:.1f} ms, floor {floor:.1f} ms: "
        out += f"{step / floor:.2f}x"
    if "klpo: micro_step" in med and "klpo: micro_step, per-token path" in med:
        on, off = med["klpo: micro_step"], med["klpo: micro_step, per-token path"]
        out += f"\nforward-pass gradient: micro-step {on:.1f} ms on, {off:.1f} off: {on / off:.2f}x"
    for part in ("score", "micro_step"):
        packed, padded = f"klpo: {part}, packed", f"klpo: {part}"
        per_row = f"klpo: {part}, prompt per row"
        if packed in med and padded in med:
            out += (
                f"\npacked rows: {part} {med[packed]:.1f} ms packed, {med[padded]:.1f} padded "
                f"(prompt shared): {med[packed] / med[padded]:.2f}x"
            )
            if per_row in med:
                out += f"; prompt per row {med[per_row]:.1f}: {med[packed] / med[per_row]:.2f}x"
    return out


def packing_lines(rec: dict) -> str:
    """The batch's token positions a forward computes in each layout and their pad share
    (:func:`trainer_vs_trl.layout_slots`), and its completion lengths."""
    slots = bench.layout_slots(rec)
    names = {
        "shared": "padded, prompt shared",
        "rows": "padded, prompt per row",
        "packed": f"packed ({rec['packs']} packs of {rec['width']})",
    }
    parts = [
        f"{names[k]} {slots[k][0]} ({1 - slots[k][1] / slots[k][0]:.1%} pad)"
        for k in names
        if k in slots
    ]
    pads = bench.pad_summary([rec], "packed")
    return (
        f"the batch's completion lengths {bench.lengths_text(rec['completion_len'])}; token "
        f"positions a forward computes: {', '.join(parts)}; packing removes "
        f"{pads['pad_removed']:.1%} of the pad tokens of padded rows with each row's prompt"
    )


if __name__ == "__main__":
    main()
