"""Service settings: embedded defaults, overridden by a TOML file, then by command-line flags."""
from __future__ import annotations

import dataclasses
import os
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

from chatloom.engine import EngineConfig
from chatloom.engine.config import KV_CACHE_DTYPES
from chatloom.models.registry import DEFAULT_MODEL

ENGINE_DEFAULTS = EngineConfig()  # engine sizing is defined once, by the engine's own config
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely."


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = "./data"
    db_url: str | None = None  # default: SQLite file under data_dir
    model: str = DEFAULT_MODEL  # registry id or a path to a GGUF file / Hugging Face folder
    dtype: str = "fp32"
    int8_matmul: bool | None = None  # quantized GGUF layers use int8 activations (None: $CHATLOOM_INT8_MATMUL, see model_args)

    # Engine sizing (the local backend); the defaults are EngineConfig's.
    kv_cache_gb: float = ENGINE_DEFAULTS.kv_cache_gb
    num_blocks: int | None = ENGINE_DEFAULTS.num_blocks
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = ENGINE_DEFAULTS.max_num_batched_tokens  # per step: decodes, then prefill chunks
    kv_cache_dtype: str = ENGINE_DEFAULTS.kv_cache_dtype  # auto | fp32 | bf16 | fp16 (see engine/config.py)
    context_window: int | None = None  # cap below the model's own window (tests use a tiny one)
    # Speculative decoding: off | ngram (prompt lookup) | draft (speculative_model proposes).
    speculative: str = ENGINE_DEFAULTS.speculative
    num_speculative_tokens: int = ENGINE_DEFAULTS.num_speculative_tokens
    speculative_model: str | None = None  # registry id, path, or self-int8 / self-layers:N

    # Accounts.
    jwt_secret: str | None = None  # default: generated once and kept in data_dir/jwt_secret
    token_ttl_s: int = 7 * 24 * 3600
    argon2_time_cost: int = 3
    argon2_memory_kib: int = 65536
    allow_signup: bool = True
    # A caller authenticated this recently is not looked up in the database again (0: always look up);
    # a tier change or a revoked API key reaches other gateways within this time (this one at once).
    auth_cache_s: float = 5.0

    # Conversations.
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_message_chars: int = 32_000
    default_max_tokens: int = 512
    max_tokens_limit: int = 4096
    default_temperature: float = 0.7
    default_top_p: float = 0.95
    summary_max_tokens: int = 200
    # After summarizing, keep at most this share of the history budget as verbatim turns,
    # so the next few turns fit without summarizing again.
    summary_keep_fraction: float = 0.5
    event_log_retention_s: float = 600.0
    title_chars: int = 60
    # Tools the chat's model may call (comma-separated built-ins: calculator, time, search; "" for none),
    # and how many calls one answer may make before it must answer in text.
    chat_tools: str = "calculator,time,search"
    max_tool_calls_per_answer: int = 4

    # Traffic control (tiers, quotas, admission, moderation): see chatloom/app/traffic/control.py.
    tiers_file: str | None = None  # TOML of tiers; default: built-in free/plus/pro (+ CHATLOOM_TIER_* env)
    default_tier: str = "free"
    queue_max_wait_s: float = 30.0  # longer in the admission queue: 503 with Retry-After
    admission_max_running: int | None = None  # generations admitted at once (default: max_num_seqs)
    reasoning_share: float = 0.5  # most of the running slots reasoning requests may hold
    reasoning_max_effort: str = "high"  # cap on the effort dial (low | medium | high)
    moderation: str = "lexicon"  # lexicon | openai (an OpenAI-compatible /v1/moderations) | off
    moderation_url: str | None = None  # with moderation = "openai": the server's base URL (…/v1)
    moderation_model: str | None = None  # the moderation model to ask for (None: the server's default)
    moderation_api_key: str | None = None  # Bearer token for it (None: $CHATLOOM_MODERATION_API_KEY)
    moderation_timeout_s: float = 5.0
    moderation_holdback_tokens: int = 4  # pieces of output held back for the output check
    metrics_public: bool = True  # GET /metrics without a token (as vLLM serves it)
    # The SLO behind the goodput figures on /metrics: a request counts when it meets both (None: no target).
    slo_ttft_s: float | None = 2.0
    slo_tpot_s: float | None = 0.2

    # The fleet (chatloom/app/core/fleet_settings.py): [[models]] tables, or replica URLs for `model`.
    models: list | None = None
    replicas: list | None = None
    router_policy: str = "prefix_aware"  # round_robin | least_load | prefix_aware
    router_weights: dict | None = None  # { prefix, kv_usage, waiting, min_prefix_fraction }

    # Robustness: edge limits, crash recovery, shutdown (see chatloom/app/core/validation.py, recovery.py).
    max_body_bytes: int = 1_000_000  # larger request bodies: 413 before parsing
    checkpoint_interval_s: float = 0.5  # an answer's text so far is saved this often while it streams
    recovery_stale_s: float = 5.0  # an answer not saved for this long was left by a dead process: interrupted
    shutdown_drain_s: float = 20.0  # on SIGTERM, running answers get this long to finish, then are interrupted

    # Several gateways (see README, "Several gateways"): what is hot lives in Redis when redis_url is set.
    redis_url: str | None = None  # redis://host:port/db; None: quotas, stream logs, stops in this process
    redis_prefix: str = "chatloom"  # key prefix, so several services can share one Redis
    gateway_id: str | None = None  # this gateway's name in the fleet (default: host-pid-random)
    job_lease_s: float = 3.0  # a dead gateway's answers are taken over this long after its last renewal
    shutdown_grace_s: float = 20.0  # on SIGTERM, running answers get this long before they are handed over

    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype must be auto, {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.speculative not in ("off", "ngram", "draft"):
            raise ValueError(f"speculative must be off, ngram or draft, not {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative = draft needs speculative_model (e.g. self-int8 or self-layers:8)")

    @property
    def database_url(self) -> str:
        if self.db_url:
            return self.db_url
        return f"sqlite+aiosqlite:///{Path(self.data_dir) / 'chatloom.db'}"

    def secret(self) -> str:
        """The JWT signing key; generated and kept on disk so tokens survive restarts."""
        if self.jwt_secret:
            return self.jwt_secret
        path = Path(self.data_dir) / "jwt_secret"
        if path.is_file():
            self.jwt_secret = path.read_text().strip()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.jwt_secret = secrets.token_urlsafe(48)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.jwt_secret)
        return self.jwt_secret

    def engine_config(self) -> EngineConfig:
        """The local backend's engine sizing."""
        return EngineConfig(kv_cache_gb=self.kv_cache_gb, num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                            max_model_len=self.context_window, max_num_batched_tokens=self.max_num_batched_tokens,
                            kv_cache_dtype=self.kv_cache_dtype,
                            speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
                            speculative_model=self.speculative_model)

    def updated(self, **changes) -> "Settings":
        """A copy with the non-None changes applied."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_file(cls, path: str | Path) -> "Settings":
        """Read a TOML file of top-level keys named like the fields above."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML: {exc}") from None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{path}: unknown setting(s): {', '.join(unknown)}")
        for name, value in data.items():
            _check_type(path, name, fields[name].type, value)
        return cls(**data)


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _check_type(path: str | Path, name: str, annotation: str, value: object) -> None:
    """One line naming the setting when a TOML value has the wrong type (`model = [...]`, `port = "80"`)."""
    kinds = [k.strip() for k in str(annotation).split("|")]
    allowed = tuple(t for k in kinds for t in _TYPES.get(k, ()))
    if not allowed:
        return
    ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
    if not ok:
        wanted = " or ".join(k for k in kinds if k != "None")
        raise ValueError(f"{path}: setting {name!r} must be {wanted}, not {type(value).__name__} {value!r}")
