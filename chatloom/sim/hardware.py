"""GPUs, nodes and what one replica of a model gets on them: a KV pool and a step-time model.

The GPU figures are the vendors' published datasheet numbers (dense BF16 tensor FLOP/s, HBM
bandwidth, memory). Efficiencies turn peaks into what serving engines reach in practice; they are
parameters, printed with every plan, not hidden constants.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatloom.models.config import DTYPE_BYTES, ModelConfig
from chatloom.sim.step_time import RooflineStepTime, StepTimeModel

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float     # dense
    mem_bandwidth: float  # bytes/s
    memory_bytes: float


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("a100", 312e12, 2.039e12, 80e9),
    GPU("h100", 989e12, 3.35e12, 80e9),
    GPU("h200", 989e12, 4.8e12, 141e9),
    GPU("b200", 2250e12, 8.0e12, 192e9),
    GPU("l40s", 362e12, 0.864e12, 48e9),
)}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def model_config(spec: str) -> ModelConfig:
    """A shipped example config by name (llama-70b), or a config.json path."""
    path = EXAMPLES_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec)
    if not path.is_file():
        known = sorted(p.stem for p in EXAMPLES_DIR.glob("*.json"))
        raise ValueError(f"unknown model {spec!r}: not a config.json path nor a shipped example "
                         f"({', '.join(known)})")
    return ModelConfig.from_json_file(path)


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything the simulator needs to stand in for one engine replica."""

    num_blocks: int
    step_time: StepTimeModel
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    model_key: str = "sim"
    kv_bytes_per_token: int = 0  # for KV transfer costs (disaggregation); 0 when unknown
    gpus: int = 1
    description: str = ""

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("the replica's KV pool holds no block: the weights leave no memory for KV cache")

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class NodeSizing:
    weight_bytes: float
    kv_pool_bytes: float
    kv_bytes_per_token: int
    num_blocks: int
    tokens: int


def size_node(cfg: ModelConfig, g: GPU, num_gpus: int, weight_dtype: str = "bf16", kv_dtype: str = "fp16",
              memory_utilization: float = 0.9, activation_reserve_gb: float = 4.0,
              block_size: int = 16) -> NodeSizing:
    """Weights first; what remains of the usable memory (less a reserve for activations) is KV pool."""
    weight_bytes = cfg.num_parameters() * DTYPE_BYTES[weight_dtype]
    usable = g.memory_bytes * num_gpus * memory_utilization
    pool = usable - weight_bytes - activation_reserve_gb * 1e9 * num_gpus
    per_token = cfg.kv_bytes_per_token(kv_dtype)
    blocks = int(pool // (per_token * block_size)) if pool > 0 else 0
    return NodeSizing(weight_bytes, max(pool, 0.0), per_token, blocks, blocks * block_size)


def roofline_replica(model: str, gpu_name: str, num_gpus: int = 8, weight_dtype: str = "bf16",
                     kv_dtype: str = "fp16", compute_efficiency: float = 0.5, memory_efficiency: float = 0.7,
                     overhead_s: float = 0.003, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                     block_size: int = 16, max_model_len: int | None = None) -> ReplicaSpec:
    """A replica of `model` on a node of `num_gpus` x `gpu_name`, from published figures."""
    if num_gpus < 1:
        raise ValueError("--gpus-per-replica must be at least 1")
    if weight_dtype not in DTYPE_BYTES or kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"dtypes must be one of {', '.join(DTYPE_BYTES)}")
    cfg = model_config(model)
    g = gpu(gpu_name)
    sizing = size_node(cfg, g, num_gpus, weight_dtype, kv_dtype, block_size=block_size)
    if sizing.num_blocks < 1:
        raise ValueError(f"{model} in {weight_dtype} ({sizing.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                         f"on {num_gpus} x {g.name} ({g.memory_bytes * num_gpus / 1e9:.0f} GB) with room for KV cache")
    # The weights' dtype sets the peak: FP8 tensor cores run twice as fast as BF16 ones.
    peak = g.bf16_flops * (2 if DTYPE_BYTES[weight_dtype] == 1 else 1)
    st = RooflineStepTime(
        params=float(cfg.num_parameters()), weight_bytes=float(sizing.weight_bytes),
        kv_bytes_per_token=float(sizing.kv_bytes_per_token),
        attn_flops_per_pair=4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
        peak_flops=peak, mem_bandwidth=g.mem_bandwidth, num_gpus=num_gpus,
        compute_efficiency=compute_efficiency, memory_efficiency=memory_efficiency, overhead_s=overhead_s,
        source=f"{cfg.name} {weight_dtype} on {num_gpus}x{g.name}")
    return ReplicaSpec(num_blocks=sizing.num_blocks, step_time=st, block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       max_model_len=max_model_len or min(cfg.max_position, 8192), model_key=model,
                       kv_bytes_per_token=sizing.kv_bytes_per_token, gpus=num_gpus,
                       description=f"{model} ({weight_dtype} weights, {kv_dtype} KV) on {num_gpus}x{g.name}: "
                                   f"{sizing.weight_bytes / 1e9:.0f} GB weights, "
                                   f"{sizing.kv_pool_bytes / 1e9:.0f} GB KV pool = {sizing.tokens:,} tokens")
