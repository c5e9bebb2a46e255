"""The run configuration: one YAML file, typed sections, ``key.sub=value`` overrides.

>>> cfg = load_config(None, ["rollout.group_size=8", "model.path=/models/tiny"])
>>> cfg.rollout.group_size, cfg.model.path
(8, '/models/tiny')

Every section forbids unknown keys, so a typo fails with the key's full dotted name and the
keys that are allowed there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """The policy model."""

    path: str | None = Field(None, description="local HF directory or .gguf file")
    name: str | None = Field(
        None, description="a named model from the registry, e.g. smollm2-135m-instruct"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tokenizer: str | None = Field(
        None, description="tokenizer directory, if not beside the weights"
    )
    served_name: str = Field("policy", description="the name GET /v1/models lists")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and self.name is not None:
            raise ValueError("set model.path or model.name, not both")
        return self


class AgentConfig(Section):
    """The user's agent: a ``@areal.trace`` function and the keyword arguments it gets."""

    entry: str | None = Field(
        None,
        description="module:function, e.g. agent:solve (the module is looked up beside the "
        "config file first)",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)
    reward: str | None = Field(
        None, description="a registered reward function applied to the final answer"
    )
    framework_telemetry: bool = Field(
        False,
        description="let the agent's frameworks export traces of rollouts (Agents SDK "
        "tracing, LangSmith, CAMEL's Langfuse); off, nothing of a trajectory leaves the machine",
    )

    @model_validator(mode="after")
    def _entry_shape(self) -> AgentConfig:
        if self.entry is not None and (":" not in self.entry or self.entry.count(":") != 1):
            raise ValueError(
                f"agent.entry must look like 'package.module:function', got {self.entry!r}"
            )
        return self


class DataConfig(Section):
    """Tasks: a JSONL file, one task (a JSON object) per line."""

    path: str | None = None
    eval_path: str | None = None
    id_field: str = "id"
    limit: int | None = Field(None, ge=1)
    eval_limit: int | None = Field(None, ge=1)
    shuffle: bool = True


class RolloutConfig(Section):
    """Running agents over tasks."""

    group_size: int = Field(4, ge=1, description="samples per task (GRPO group)")
    concurrency: int = Field(8, ge=1, description="agent calls in flight")
    batch_size: int = Field(8, ge=1, description="episodes per training step")
    timeout_s: float = Field(300.0, gt=0)
    retries: int = Field(0, ge=0)
    max_staleness: int = Field(1, ge=0, description="0 is the synchronous baseline")
    workers: int = Field(
        2,
        ge=1,
        description="run.placement=processes or ray: processes that run the agents (each runs up "
        "to concurrency / workers episodes at once)",
    )

    @model_validator(mode="after")
    def _whole_groups(self) -> RolloutConfig:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"rollout.batch_size ({self.batch_size}) must be a multiple of "
                f"rollout.group_size ({self.group_size}): a step trains whole groups"
            )
        return self


class InferenceConfig(Section):
    """The inference engine behind the gateway."""

    backend: str = Field("embedded", description="a registered inference backend")
    servers: int = Field(
        1,
        ge=1,
        description="run.placement=processes or ray: engine servers, each a process of its own, "
        "behind the gateway's router (an episode's turns stay on one server)",
    )
    device: str = "cpu"
    max_batch_size: int = Field(32, ge=1)
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="tokens per request, prompt and completion (default: the model's "
        "max_position_embeddings, at most 4096; more than the model's is an error)",
    )
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    urls: list[str] = Field(default_factory=list, description="attach to running SGLang servers")
    tool_parser: str | None = None
    session_idle_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="gateway: a session with no call for this long is ended as a failed "
        "episode (null: never)",
    )
    temperature: float = Field(1.0, ge=0.0)
    max_new_tokens: int = Field(512, ge=1)
    prefill_chunk: int | None = Field(
        None,
        ge=1,
        description="embedded engine: prompt tokens per step (default 2048 on CPU, 512 on CUDA)",
    )
    idle_prefill_chunk: int | None = Field(
        None,
        ge=1,
        description="embedded engine: prompt tokens in a step where no request decodes, e.g. "
        "keys recomputed after a push (default 8192 on CUDA, else prefill_chunk)",
    )
    cuda_graphs: bool | None = Field(None, description="embedded engine: decode CUDA graphs")
    prompt_hold_steps: int | None = Field(
        None,
        ge=0,
        description="embedded engine: while every running request decodes, new prompts wait up "
        "to this many steps (or until an eighth of the slots wait) and prefill together, "
        "outside the decode graphs once instead of once each (default 16 with CUDA graphs, "
        "else 0)",
    )
    overlap_decode: bool | None = Field(
        None,
        description="embedded engine: queue each decode step before reading the previous "
        "one's tokens, so host bookkeeping overlaps the GPU (default on with CUDA graphs)",
    )
    recompute_kv_on_update: bool = Field(
        True,
        description="embedded engine: after a weight push, in-flight requests recompute their "
        "keys and values under the new weights (exact, as AReaL's interruptible rollouts); "
        "false keeps the old ones, which saves a prefill of every running request per push "
        "(the decoupled loss weighs by the logprobs actually sampled with)",
    )
    reuse_prefixes: bool = Field(
        True,
        description="embedded engine: a request copies the cached keys and values of its "
        "longest prefix another request computed (a group's shared prompt, an agent's earlier "
        "turns) instead of prefilling them again",
    )
    sglang_python: str | None = Field(
        None, description="sglang: python of the SGLang environment (default: this one)"
    )
    sglang_args: list[str] = Field(
        default_factory=list, description="sglang: extra sglang.launch_server arguments"
    )
    sglang_servers: int = Field(1, ge=1, description="sglang: servers launched without urls")
    router_url: str | None = Field(None, description="sglang: generate through sglang-router")
    request_timeout_s: float = Field(600.0, gt=0, description="sglang: per HTTP call")
    retries: int = Field(3, ge=0, description="sglang: retries of a call, with backoff")
    launch_timeout_s: float = Field(600.0, gt=0, description="sglang: wait for /health")


class LoraConfig(Section):
    """Low-rank adapters (``peft``): only the adapters train; the base weights stay frozen."""

    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="module names (or name suffixes) that get adapters, or all-linear: every "
        "linear layer of the decoder",
    )


class TrainConfig(Section):
    """The train backend (``torch``: one process; ``deepspeed``: ZeRO 0-3 over ranks)."""

    backend: str = Field("torch", description="a registered train backend")
    device: str = Field("cpu", description="cpu | cuda | cuda:N (deepspeed: cpu or cuda)")
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, gt=0)
    optimizer_state_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="torch backend: the dtype AdamW stores its two moments in (the update "
        "runs in float32 either way); bfloat16 halves their memory, stored with stochastic "
        "rounding (the quickstart uses it). auto: float32",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=16,
        description="tokens per packed micro-batch (default: 8192 on a CPU; on CUDA as many "
        "as the card holds beside the weights, gradients, AdamW moments and, on a shared "
        "card, the engine; backends/train/defaults.py)",
    )
    share_prefixes: bool | None = Field(
        None,
        description="pack a group's common prompt once per micro-batch, each member attending "
        "to it (same logprobs and update; a GRPO group of 8 short answers to one prompt packs "
        "in about a quarter of the tokens). Default: on with varlen attention, which it needs",
    )
    gradient_checkpointing: bool = False
    compile: bool | None = Field(
        None,
        description="torch.compile each decoder layer (dynamic shapes): fuses the norms, "
        "rotary and MLP elementwise work around the GEMMs; the first step pays the compile "
        "(15-60 s on a GPU). Measured 1.45x on an H100 and an H200 (benchmarks/README.md). "
        "Default: on for CUDA, off on a CPU",
    )
    zero_stage: Literal[0, 1, 2, 3] = 0
    bf16: bool | None = Field(
        None,
        description="torch: autocast; deepspeed: bf16 weights, fp32 master. Default: on for "
        "CUDA; off on a CPU (set it where the CPU has native bf16, AVX512-BF16 or AMX, as the "
        "quickstart does)",
    )
    attn_implementation: str = Field(
        "varlen",
        description="varlen (per-sequence attention from the packing, flash varlen on CUDA) "
        "| sdpa (block-diagonal mask over the packed row) | eager | flash_attention_2",
    )
    varlen_kernel: Literal["auto", "flash", "cudnn"] = Field(
        "auto",
        description="varlen attention on CUDA: flash (torch's flash-attention varlen over the "
        "packed row), cudnn (cuDNN's fused attention over the sequences as a right-padded "
        "batch; faster per token on Hopper, but pays for the padding) or auto (cudnn when "
        "the padding adds at most 40% to the attention's cost, else flash)",
    )
    logprob_chunk_size: int = Field(1024, ge=1, description="rows per vocab-projection chunk")
    padded_attention: bool = Field(
        False,
        description="run a micro-batch's sequences as a right-padded batch instead of one "
        "packed row with a block-diagonal attention mask (benchmarks/attention_layout.py)",
    )
    logprob_backend: Literal["auto", "torch", "triton", "stored"] = Field(
        "auto",
        description="token logprobs: auto (Triton on CUDA, else torch), torch, triton, stored "
        "(the softmax kept for backward: T x V more memory, one product less)",
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="DeepSpeed JSON config merged over the generated one"
    )
    lora: LoraConfig | None = Field(
        None, description="train low-rank adapters instead of every weight (None: full fine-tuning)"
    )
    separate_process: bool | None = Field(
        None,
        description="run the train backend in a child process of its own, so the engine, "
        "gateway and agents of this process do not hold the GIL between its kernel launches "
        "(one trainer rank; weights reach the engine through shared memory, CUDA IPC on a "
        "GPU). Default: on for a trainer on CUDA that is not one rank of several",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"train.betas must each be in [0, 1), got {list(value)}")
        return value

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise ValueError(f"train.device must be cpu, cuda or cuda:N, got {value!r}")
        return value

    @model_validator(mode="after")
    def _state_dtype_is_torchs(self) -> TrainConfig:
        if self.backend == "deepspeed" and self.optimizer_state_dtype == "bfloat16":
            raise ValueError(
                "train.optimizer_state_dtype: bfloat16 is the torch backend's; DeepSpeed keeps "
                "its optimizer state as train.deepspeed says"
            )
        return self

    @model_validator(mode="after")
    def _shared_prefixes_need_varlen(self) -> TrainConfig:
        if self.share_prefixes and self.attn_implementation != "varlen":
            raise ValueError(
                "train.share_prefixes needs train.attn_implementation: varlen (got "
                f"{self.attn_implementation}): only it lets a member attend to a prefix packed once"
            )
        return self


class TokenMaskConfig(Section):
    """Mask tokens whose behaviour/proximal mismatch lies outside [lower, upper] (IcePop/KPop).

    - ``metric="ratio"``: the importance weight pi_proximal / pi_behaviour of the sampled token
      (IcePop keeps roughly [0.5, 2]).
    - ``metric="kl"``: the binary KL between behaviour and proximal, treating "sampled this
      token or not" as a Bernoulli; computable from the sampled token's two probabilities and a
      lower bound of the full-vocabulary KL (KPop-style; typically lower=0, upper~0.1).
    - ``metric="none"``: keep every token.

    Masked tokens contribute no gradient but still count in the loss denominator.
    """

    metric: Literal["none", "ratio", "kl"] = "none"
    lower: float = Field(0.0, ge=0.0, description="both metrics are non-negative")
    upper: float = Field(float("inf"), gt=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> TokenMaskConfig:
        if self.lower > self.upper:
            raise ValueError(
                f"algorithm.token_mask.lower ({self.lower}) exceeds upper ({self.upper})"
            )
        return self


class AlgorithmConfig(Section):
    """The RL objective (``areal_sdk.algorithms``).

    Advantages: ``grpo`` (group mean and std), ``dr_grpo`` (group mean only), ``rloo``
    (leave-one-out mean). Policy loss: PPO clipped ratio with clip-higher (``clip_high >
    clip_low``) and optional dual-clip for negative advantages. ``decoupled`` takes the ratio
    against the proximal policy and weights each token by pi_proximal / pi_behaviour.
    ``kl_coef`` adds a k3 KL to a reference model, ``entropy_coef`` an entropy bonus.
    ``loss_agg``: ``token_mean`` (every token counts once), ``seq_mean_token_mean`` (every
    sequence counts once), ``seq_mean_token_sum`` (sequence sums averaged over sequences).
    """

    name: Literal["grpo", "ppo"] = "grpo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    clip_low: float = Field(0.2, ge=0, lt=1.0, description="ratio floor is 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="> clip_low is clip-higher")
    dual_clip: float | None = Field(None, gt=1.0)
    decoupled: bool = True
    separate_proximal_pass: bool = Field(
        False,
        description="decoupled: a no-grad forward for the proximal logprobs before the "
        "update; off, the update's own forward gives them (detached), the same numbers "
        "since a step makes one optimizer update, at one forward less",
    )
    kl_coef: float = Field(0.0, ge=0)
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    token_mask: TokenMaskConfig = Field(default_factory=TokenMaskConfig)
    dynamic_filter: bool = Field(False, description="drop groups whose rewards are all equal")


class WeightsConfig(Section):
    """Pushing trained weights into the engine."""

    method: str = Field("in_process", description="in_process | disk | broadcast | cuda_ipc")
    dir: str | None = Field(None, description="disk: version directories (default run.dir/weights)")
    keep_last: int = Field(2, ge=1, description="disk: version directories kept")
    timeout_s: float = Field(120.0, gt=0, description="a sync not done by then fails loudly")
    bucket_mb: int = Field(256, ge=1, description="tensors per transfer (and per ZeRO-3 gather)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype sent to the engine; auto keeps the trainer's"
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="broadcast/cuda_ipc: the trainer's address (under run.placement=ray a "
        "loopback one becomes this node's IP)",
    )
    master_port: int = Field(0, ge=0, le=65535, description="broadcast/cuda_ipc: 0 picks one")
    engine_ranks: int = Field(1, ge=1, description="broadcast: engine processes in the group")
    group_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="broadcast: nccl when the trainer is on CUDA, else gloo"
    )
    pause_mode: Literal["retract", "in_place", "abort"] = Field(
        "retract",
        description="engine pause around a push: retract re-runs in-flight requests under the "
        "new weights, in_place keeps their KV, abort ends them",
    )


class EvalConfig(Section):
    """Held-out reward before and after training (tasks from ``data.eval_path``)."""

    before: bool = Field(True, description="evaluate the initial policy")
    after: bool = Field(True, description="evaluate the trained policy")
    samples: int = Field(1, ge=1, description="episodes per held-out task")
    agent_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="merged over agent.kwargs for evaluation episodes"
    )


class RunConfig(Section):
    """Where a run writes, and how long it goes."""

    dir: str = "runs/default"
    name: str | None = None
    seed: int = 0
    steps: int = Field(10, ge=0)
    checkpoint_every: int = Field(0, ge=0, description="0 saves only at the end")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept (the newest)")
    keep_optimizer_state: Literal["latest", "all"] = Field(
        "latest", description="optimizer state in the newest checkpoint only, or in all kept"
    )
    metric_sinks: list[str] = Field(default_factory=lambda: ["jsonl"])
    metric_sink_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="keyword options per sink: {wandb: {project: ...}, mlflow: {...}}",
    )
    trajectory_samples: int = Field(
        4, ge=0, description="episodes per step logged as a table by sinks that keep tables"
    )
    placement: Literal["auto", "inprocess", "processes", "ray"] = Field(
        "auto",
        description="where the services run: inprocess (one interpreter), processes (engine "
        "servers, gateway, rollout workers and trainer each a process), ray (actors on a Ray "
        "cluster). auto: processes on CUDA, inprocess on CPU (the faster one on each)",
    )
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="a service silent this long is stalled, and is restarted"
    )
    max_restarts: int = Field(
        3, ge=0, description="restarts of one service within restart_window_s before the run stops"
    )
    restart_window_s: float = Field(300.0, gt=0)


class RayResources(Section):
    """What one service of a kind asks of the Ray cluster (``run.placement: ray``)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float | None = Field(
        None,
        ge=0,
        description="a fraction shares one card (0.5: two on a GPU); default: 1 for an engine "
        "whose inference.device is CUDA, else 0",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources, e.g. {engine_node: 1} to pin the kind to nodes that "
        "declared it (ray start --resources)",
    )

    @field_validator("num_gpus")
    @classmethod
    def _whole_above_one(cls, value: float | None) -> float | None:
        if value is not None and value > 1 and value != int(value):
            raise ValueError(f"{value:g} GPUs: above 1, Ray needs a whole number")
        return value

    @field_validator("resources")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if amount < 0:
                raise ValueError(f"resource {name!r}: {amount:g} is negative")
        return value


class RayTrainerResources(RayResources):
    """What each trainer rank asks of the Ray cluster, and how many ranks there are."""

    num_gpus: float | None = Field(
        None,
        ge=0,
        description="per rank; default: 1 when train.device is CUDA, else 0 (ranks of one "
        "group need a card each: NCCL refuses two ranks on one card)",
    )
    ranks: int = Field(
        1, ge=1, description="trainer ranks, each an actor, together one torch.distributed group"
    )


class RayConfig(Section):
    """``run.placement: ray``: the cluster, and where each kind of service goes.

    Engine servers, rollout workers and trainer ranks are Ray actors; the gateway runs
    beside the run's own process (docs/cluster.md)."""

    address: str | None = Field(
        None,
        description="the cluster (auto, or host:port of its head); default: the one `ray "
        "start` made on this machine (or RAY_ADDRESS), else a local one started by the run",
    )
    namespace: str | None = Field(None, description="the Ray namespace of the run's actors")
    strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD"] | None = Field(
        None,
        description="reserve every engine and rollout worker in one placement group with "
        "this strategy (each bundle: the kind's resources); default: no placement group",
    )
    engine: RayResources = Field(default_factory=RayResources)
    worker: RayResources = Field(default_factory=RayResources)
    trainer: RayTrainerResources = Field(default_factory=RayTrainerResources)

    @model_validator(mode="after")
    def _bundles_not_empty(self) -> RayConfig:
        if self.strategy is None:
            return self
        for kind in ("engine", "worker"):
            ask = getattr(self, kind)
            if not (ask.num_cpus or ask.num_gpus or any(ask.resources.values())):
                raise ValueError(
                    f"ray.strategy={self.strategy} reserves a bundle per service, and "
                    f"ray.{kind} asks for nothing: give it num_cpus, num_gpus or resources"
                )
        return self


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="after")
    def _trainer_ranks_need_deepspeed(self) -> Config:
        ranks = self.ray.trainer.ranks
        if ranks > 1 and self.train.backend != "deepspeed":
            raise ValueError(
                f"ray.trainer.ranks={ranks} runs one model over several ranks, which "
                f"train.backend={self.train.backend} cannot: set train.backend=deepspeed"
            )
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _allowed_keys(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    """The field names allowed at ``path`` inside ``model``."""
    current: Any = model
    for part in path:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return []
        annotation = fields[part].annotation
        current = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
        if current is None:
            return []
    return sorted(current.model_fields)


def _format_errors(exc: ValidationError, origin: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        if not loc:  # a check across sections: its message names the keys
            lines.append(err["msg"].removeprefix("Value error, "))
        elif err["type"] == "extra_forbidden":
            allowed = _allowed_keys(Config, loc[:-1])
            where = ".".join(str(p) for p in loc[:-1]) or "the top level"
            lines.append(f"{key}: unknown key; allowed in {where}: {', '.join(allowed)}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key}: {msg}{shown}")
    return f"invalid config ({origin}):\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"rollout.group_size=8"`` -> (["rollout", "group_size"], 8). Values parse as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: {exc}") from exc
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {text!r}: {'.'.join(parts[: i + 1])} is a value, not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply overrides, validate. Raises ``ConfigError``."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        path = Path(path)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path} must hold a mapping of sections, got {type(loaded).__name__}"
            )
        data = loaded
    if overrides:
        data = apply_overrides(data, overrides)
        origin += " + overrides"
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None
    if path is not None:
        _resolve_relative_paths(cfg, Path(path).parent)
    return cfg


# What a run reads: relative to the config file, so a config runs from any directory. What a
# run writes (run.dir, weights.dir) stays relative to the current directory, like any
# command's output; agent.entry's module is looked up beside the config file first.
_INPUT_PATHS = (("data", "path"), ("data", "eval_path"), ("model", "path"), ("model", "tokenizer"))


def _resolve_relative_paths(cfg: Config, base: Path) -> None:
    """Input paths in a config file are relative to the file, so examples run from anywhere.

    A path that exists only relative to the current directory (an override typed there) is
    taken from there. Either way it becomes absolute, so the copy of the config that a run
    directory keeps still points at it from anywhere.
    """
    for section, key in _INPUT_PATHS:
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        if value and not Path(value).is_absolute():
            candidate = (base / value).resolve()
            here = Path(value).resolve()
            setattr(obj, key, str(here if here.exists() and not candidate.exists() else candidate))
