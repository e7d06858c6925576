"""Service settings: embedded defaults, overridden by a TOML file, then by command-line flags."""
from __future__ import annotations

import dataclasses
import os
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

from chatloom.models.registry import DEFAULT_MODEL

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely."


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = "./data"
    db_url: str | None = None  # default: SQLite file under data_dir
    model: str = DEFAULT_MODEL  # registry id or a path to a GGUF file / Hugging Face folder
    dtype: str = "fp32"
    int8_matmul: bool | None = None  # quantized GGUF layers multiply with int8 activations (None: $CHATLOOM_INT8_MATMUL)

    # Engine sizing (the local backend).
    kv_cache_gb: float = 0.5
    num_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # per engine step: decodes first, then prefill chunks
    context_window: int | None = None  # cap below the model's own window (tests use a tiny one)

    # Accounts.
    jwt_secret: str | None = None  # default: generated once and kept in data_dir/jwt_secret
    token_ttl_s: int = 7 * 24 * 3600
    argon2_time_cost: int = 3
    argon2_memory_kib: int = 65536
    allow_signup: bool = True

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

    # Traffic control (tiers, quotas, admission, moderation): see chatloom/app/traffic.py.
    tiers_file: str | None = None  # TOML of tiers; default: built-in free/plus/pro (+ CHATLOOM_TIER_* env)
    default_tier: str = "free"
    queue_max_wait_s: float = 30.0  # longer in the admission queue: 503 with Retry-After
    admission_max_running: int | None = None  # generations admitted at once (default: max_num_seqs)
    reasoning_share: float = 0.5  # most of the running slots reasoning requests may hold
    reasoning_max_effort: str = "high"  # cap on the effort dial (low | medium | high)
    moderation: str = "lexicon"  # lexicon | off
    moderation_holdback_tokens: int = 4  # pieces of output held back for the output check
    metrics_public: bool = True  # GET /metrics without a token (as vLLM serves it)

    # Several gateways (see README, "Several gateways"): what is hot lives in Redis when redis_url is set.
    redis_url: str | None = None  # redis://host:port/db; None: quotas, stream logs, stops in this process
    redis_prefix: str = "chatloom"  # key prefix, so several services can share one Redis
    gateway_id: str | None = None  # this gateway's name in the fleet (default: host-pid-random)
    job_lease_s: float = 3.0  # a dead gateway's answers are taken over this long after its last renewal
    shutdown_grace_s: float = 20.0  # on SIGTERM, running answers get this long before they are handed over

    log_level: str = "info"

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

    def updated(self, **changes) -> "Settings":
        """A copy with the non-None changes applied."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_file(cls, path: str | Path) -> "Settings":
        """Read a TOML file of top-level keys named like the fields above."""
        with open(path, "rb") as f:
            data = tomllib.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown setting(s): {', '.join(unknown)}")
        return cls(**data)
