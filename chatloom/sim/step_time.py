"""How long one engine step takes, as a function of what the step holds.

The simulator never runs a model: each step's duration comes from a step-time model. Two kinds:

- `linear`: fitted by least squares to steps timed on the real engine (`chatloom bench calibrate`):
  t = c0 + c_decode*decode tokens + c_prefill*prefill tokens + c_decode_ctx*context read by decodes
      + c_prefill_attn*(query x key pairs of prefill chunks) + c_prefill_seq*prefill chunks
      + c_mixed_decode*decodes in a step that also holds a prefill chunk,
  and the spread of the timed steps around it, which the simulator draws each step's factor from.
- `roofline`: written from published figures for hardware we do not have: a step costs the larger of
  its FLOPs over (peak FLOP/s x compute efficiency) and its bytes (weights once, plus the KV read)
  over (bandwidth x memory efficiency), plus a fixed per-step overhead (launches, all-reduce).

Both are saved as small JSON files, so a plan names the model it used.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

LINEAR_FEATURES = ("const", "decode_tokens", "prefill_tokens", "decode_ctx", "prefill_attn", "prefill_seqs",
                   "mixed_decode_tokens")
# Coefficients a model file written before they existed may lack (read as 0).
OPTIONAL_FEATURES = ("mixed_decode_tokens",)


@dataclass(frozen=True)
class BatchShape:
    """What one step computes, in the numbers a step's cost depends on."""

    decode_tokens: int = 0       # sequences taking one token each
    prefill_tokens: int = 0      # prompt tokens computed this step
    decode_ctx: int = 0          # sum over decodes of the context each one attends to
    prefill_attn: float = 0.0    # sum over prefill chunks of n * (start + (n + 1) / 2)
    prefill_seqs: int = 0        # number of prefill chunks
    # Decodes in a step that also holds a prefill chunk: the engine runs such a step through the general
    # PyTorch path, where a decode-only step takes the native decode stack, and there each decode row
    # costs several times more (on this machine's CPU about 4x).
    mixed_decode_tokens: int = 0

    def features(self) -> list[float]:
        return [1.0, self.decode_tokens, self.prefill_tokens, self.decode_ctx, self.prefill_attn, self.prefill_seqs,
                self.mixed_decode_tokens]


class StepTimeModel:
    """Seconds per step. `decode_run` gives k successive pure-decode steps at once (fast-forward)."""

    kind: str = ""

    def step_time(self, shape: BatchShape) -> float:
        raise NotImplementedError

    def decode_run(self, num_decode: int, ctx0: int, k: int) -> np.ndarray:
        """Durations of k pure-decode steps of `num_decode` sequences whose summed context is ctx0 at
        the first step and grows by num_decode each step."""
        raise NotImplementedError

    def jitter(self, rng: random.Random, k: int) -> list[float] | None:
        """Factors for the durations of k steps, drawn from how much timed steps varied around the model;
        None where the model carries no such spread (every step takes exactly its predicted time)."""
        return None

    def to_dict(self) -> dict:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class LinearStepTime(StepTimeModel):
    coef: dict[str, float]
    source: str = ""
    fit: dict = field(default_factory=dict)  # residuals and sample count, for the record
    kind: str = "linear"

    def __post_init__(self) -> None:
        self.coef = {**dict.fromkeys(OPTIONAL_FEATURES, 0.0), **self.coef}
        missing = [f for f in LINEAR_FEATURES if f not in self.coef]
        if missing:
            raise ValueError(f"linear step-time model lacks coefficients: {', '.join(missing)}")
        self._c = [float(self.coef[f]) for f in LINEAR_FEATURES]
        q = [float(x) for x in self.fit.get("ratio_quantiles") or ()]
        if q and (len(q) < 2 or any(b < a for a, b in zip(q, q[1:])) or q[0] <= 0):
            raise ValueError("linear step-time model: fit.ratio_quantiles must rise and be positive")
        # A spread that is no spread (a fit through its points) costs a draw per step for nothing.
        self._ratios = q if q and q[-1] - q[0] > 1e-6 else None

    def jitter(self, rng: random.Random, k: int) -> list[float] | None:
        q = self._ratios
        if q is None:
            return None
        n = len(q)  # each stored ratio is the middle of an equally likely slice of the timed steps
        return [q[int(rng.random() * n)] for _ in range(k)]

    def step_time(self, shape: BatchShape) -> float:
        c = self._c
        return (c[0] + c[1] * shape.decode_tokens + c[2] * shape.prefill_tokens + c[3] * shape.decode_ctx
                + c[4] * shape.prefill_attn + c[5] * shape.prefill_seqs + c[6] * shape.mixed_decode_tokens)

    def decode_run(self, num_decode: int, ctx0: int, k: int) -> np.ndarray:
        c = self._c
        ctx = ctx0 + num_decode * np.arange(k, dtype=np.float64)
        return c[0] + c[1] * num_decode + c[3] * ctx

    def to_dict(self) -> dict:
        return {"kind": self.kind, "coef": self.coef, "source": self.source, "fit": self.fit}


@dataclass
class RooflineStepTime(StepTimeModel):
    """A node of `num_gpus` GPUs running one model replica with tensor parallelism."""

    params: float                # model parameters
    weight_bytes: float          # bytes of weights read per step (the whole model, once)
    kv_bytes_per_token: float    # K and V, all layers
    attn_flops_per_pair: float   # FLOPs per (query, key) pair, all layers: 4 * layers * heads * head_dim
    peak_flops: float            # per GPU, dense, in the weights' dtype
    mem_bandwidth: float         # bytes/s per GPU
    num_gpus: int = 1
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    overhead_s: float = 0.002    # per step: kernel launches, tensor-parallel all-reduces, sampling
    source: str = ""
    kind: str = "roofline"

    def __post_init__(self) -> None:
        for name in ("params", "weight_bytes", "kv_bytes_per_token", "peak_flops", "mem_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"roofline step-time model: {name} must be positive")
        if not (0 < self.compute_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise ValueError("roofline step-time model: efficiencies must be in (0, 1]")
        self._flops = self.peak_flops * self.num_gpus * self.compute_efficiency
        self._bw = self.mem_bandwidth * self.num_gpus * self.memory_efficiency

    def _time(self, tokens, pairs, kv_read):
        compute = (2.0 * self.params * tokens + self.attn_flops_per_pair * pairs) / self._flops
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_read) / self._bw
        return np.maximum(compute, memory) + self.overhead_s

    def step_time(self, shape: BatchShape) -> float:
        tokens = shape.decode_tokens + shape.prefill_tokens
        pairs = shape.decode_ctx + shape.prefill_attn
        # Prefill chunks read their earlier context once per chunk; decodes read their whole context.
        kv_read = shape.decode_ctx + shape.prefill_tokens
        return float(self._time(tokens, pairs, kv_read))

    def decode_run(self, num_decode: int, ctx0: int, k: int) -> np.ndarray:
        ctx = ctx0 + num_decode * np.arange(k, dtype=np.float64)
        return self._time(num_decode, ctx, ctx)

    def to_dict(self) -> dict:
        d = asdict(self)
        return d


def load_step_time(path: str | Path) -> StepTimeModel:
    """Read a step-time model JSON (as written by `chatloom bench calibrate` or by hand)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"step-time model {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"step-time model {path}: not JSON ({exc.msg})") from None
    return step_time_from_dict(data, str(path))


def step_time_from_dict(data: dict, where: str = "step-time model") -> StepTimeModel:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    kind = data.get("kind")
    try:
        if kind == "linear":
            return LinearStepTime(coef=dict(data["coef"]), source=data.get("source", ""), fit=data.get("fit", {}))
        if kind == "roofline":
            fields = {k: v for k, v in data.items() if k != "kind"}
            return RooflineStepTime(**fields)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{where}: bad or missing field ({exc})") from None
    raise ValueError(f"{where}: kind must be 'linear' or 'roofline', got {kind!r}")


def fit_linear(shapes: list[BatchShape], seconds: list[float], source: str = "") -> LinearStepTime:
    """Least squares on the relative error, with every coefficient kept non-negative (a step never
    gets faster with more work): fit, drop features whose coefficient came out negative, refit.

    Relative, because steps span 100x (a 10 ms decode of one sequence, a 1 s prefill of 512 tokens)
    and a plain fit would spend its accuracy on the big ones: it fitted batch-1 decode steps 40% short
    on this machine (a CPU reads every weight whatever the batch), and the simulated TTFTs came out
    22-31% early."""
    if len(shapes) != len(seconds) or len(shapes) < len(LINEAR_FEATURES):
        raise ValueError(f"need at least {len(LINEAR_FEATURES)} timed steps to fit, got {len(shapes)}")
    y_abs = np.array(seconds, dtype=np.float64)
    weight = 1.0 / np.maximum(y_abs, 1e-9)  # each step's error counts relative to its own length
    X = np.array([s.features() for s in shapes], dtype=np.float64) * weight[:, None]
    y = y_abs * weight
    active = [i for i in range(X.shape[1]) if X[:, i].any()]
    while True:
        # Scale columns so the solver treats counts in the thousands and a constant alike.
        scale = np.abs(X[:, active]).max(axis=0)
        sol, *_ = np.linalg.lstsq(X[:, active] / scale, y, rcond=None)
        sol = sol / scale
        negative = [a for a, c in zip(active, sol) if c < 0 and a != 0]
        if not negative:
            break
        active = [a for a in active if a not in negative]
    coef = dict.fromkeys(LINEAR_FEATURES, 0.0)
    for a, c in zip(active, sol):
        coef[LINEAR_FEATURES[a]] = float(max(c, 0.0))
    model = LinearStepTime(coef=coef, source=source)
    pred = np.array([model.step_time(s) for s in shapes])
    rel = np.abs(pred - y_abs) / np.maximum(y_abs, 1e-9)
    # The spread of the timed steps around the model (timed / predicted): the simulator draws each step's
    # factor from it, since a step's time is not a function of its shape alone (the allocator, the OS,
    # other processes) and queueing turns that spread into the latency tail. Twenty slices of 5%, each
    # kept as its middle ratio, so one stalled step (61x, once) weighs as one step, not as the end of a
    # line that 5% of the draws run along.
    ratios = y_abs / np.maximum(pred, 1e-9)
    fit = {"samples": len(shapes), "median_rel_error": round(float(np.median(rel)), 4),
                 "p90_rel_error": round(float(np.quantile(rel, 0.9)), 4),
                 "ratio_quantiles": [round(float(x), 4) for x in np.quantile(ratios, (np.arange(20) + 0.5) / 20)],
                 "r2": round(float(1 - ((pred - y_abs) ** 2).sum()
                                   / max(((y_abs - y_abs.mean()) ** 2).sum(), 1e-30)), 4)}
    return LinearStepTime(coef=coef, source=source, fit=fit)


def shape_of(batch) -> BatchShape:
    """The BatchShape of a scheduler's plan (an engine ScheduledBatch), read before the step runs."""
    decode_ctx = sum(s.num_computed_tokens + 1 for s in batch.decodes)
    pre_tokens, attn = 0, 0.0
    for seq, n in batch.prefills:
        pre_tokens += n
        attn += n * (seq.num_computed_tokens + (n + 1) / 2)
    # A short mixed step runs on the native decode stack like a decode-only one: no mixed-step cost.
    mixed = len(batch.decodes) if batch.prefills and not batch.short_mixed else 0
    return BatchShape(len(batch.decodes), pre_tokens, decode_ctx, attn, len(batch.prefills), mixed)
