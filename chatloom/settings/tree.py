"""The settings tree: every default of the service, defined once, grouped by concern.

Each group is a pydantic model; `Settings` is their root. Engine sizing and sampling defaults live
here too, and the engine's own config objects take their defaults from these groups, so a default
changed here changes everywhere (CLI, REST API, OpenAI API, engine).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and concisely."


class Group(BaseModel):
    """A settings group: unknown keys are refused, values are checked strictly on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)


class ServerSettings(Group):
    """Where the gateway listens and keeps its data."""

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port of the HTTP server.")
    data_dir: str = Field("./data", description="Folder for the SQLite database, the JWT secret and uploaded files (blobs/).")
    db_url: str | None = Field(None, description="Database URL; default: SQLite at data_dir/chatloom.db. "
                                                 "postgresql+asyncpg://... for PostgreSQL.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field("info", description="Log level.")
    max_body_bytes: int = Field(1_000_000, gt=0, description="Larger request bodies get 413 before parsing.")
    metrics_public: bool = Field(True, description="Serve GET /metrics without a token (as vLLM does).")


class ModelSettings(Group):
    """Which model the local engine loads, and how its weights multiply."""

    name: str = Field(DEFAULT_MODEL, description="Registry id (see `chatloom models`), a GGUF file or a "
                                                  "Hugging Face folder.")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Weights and KV cache dtype.")
    int8_matmul: bool = Field(False, description="Multiply quantized GGUF weights with int8 activations: "
                                                 "faster, slightly less exact.")
    bf16_matmul: bool = Field(False, description="Keep float weights in bfloat16 for the matmuls "
                                                 "(commands with --bf16-matmul).")


class EngineSettings(Group):
    """The local engine's sizing: the KV pool, the per-step budget, speculative decoding."""

    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    kv_cache_gb: float = Field(1.0, gt=0, description="KV-cache memory in GiB (ignored when num_blocks is set).")
    num_blocks: int | None = Field(None, gt=0, description="KV-cache blocks; overrides kv_cache_gb.")
    max_num_seqs: int = Field(64, gt=0, description="Most sequences running in one step.")
    max_num_batched_tokens: int = Field(512, gt=0, description="Token budget of one step: decodes first, "
                                                               "then prefill chunks.")
    kv_cache_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="What the KV cache holds: auto (the model's dtype; fp16 with int8 matmuls) or a "
                            "16-bit pool (half the memory, not bit-exact).")
    context_window: int | None = Field(None, gt=0, description="Cap below the model's own context window "
                                                               "(default: the model's, at most 8192).")
    enable_prefix_caching: bool = Field(True, description="Share the KV blocks of identical prompt prefixes.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off", description="Speculative decoding: off, ngram (prompt lookup) or draft (speculative_model).")
    num_speculative_tokens: int = Field(4, ge=1, description="Most tokens proposed per sequence and step.")
    speculative_model: str | None = Field(None, description="With speculative = draft: a registry id, a path, "
                                                            "or self-int8 / self-layers:N.")
    speculative_adaptive: bool = Field(True, description="Choose the proposal length per step from acceptance "
                                                         "and measured step cost.")

    @model_validator(mode="after")
    def _draft_needs_a_model(self) -> "EngineSettings":
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError("speculative = draft needs speculative_model (e.g. self-int8 or self-layers:8)")
        return self


class SamplingSettings(Group):
    """What a request that leaves them out gets, on every front (CLI, REST, OpenAI API, engine)."""

    temperature: float = Field(0.7, ge=0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Sample among the K likeliest tokens (0: off).")
    max_tokens: int = Field(512, gt=0, description="Answer length when a request does not say.")
    max_tokens_limit: int = Field(4096, gt=0, description="The most max_tokens a request may ask for.")


class AccountSettings(Group):
    """Sign-up, passwords and tokens."""

    jwt_secret: str | None = Field(None, description="JWT signing key; default: generated once and kept in "
                                                     "data_dir/jwt_secret.")
    token_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="Lifetime of a session token.")
    argon2_time_cost: int = Field(3, ge=1, description="Argon2 password hashing: iterations.")
    argon2_memory_kib: int = Field(65536, ge=8, description="Argon2 password hashing: memory in KiB.")
    allow_signup: bool = Field(True, description="Anyone may create an account.")
    auth_cache_s: float = Field(5.0, ge=0, description="A caller authenticated this recently is not looked up "
                                                       "again (0: always); a tier change or revoked key reaches "
                                                       "other gateways within this time.")


class ChatSettings(Group):
    """Conversations: the system prompt, summaries, titles, the chat's tools."""

    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="System prompt of every conversation.")
    max_message_chars: int = Field(32_000, gt=0, description="Longest user message.")
    summary_max_tokens: int = Field(200, gt=0, description="Length of a summary of older turns.")
    summary_keep_fraction: float = Field(0.5, gt=0, le=1, description="After summarizing, the most of the "
                                                                      "history budget kept as verbatim turns.")
    event_log_retention_s: float = Field(600.0, gt=0, description="How long a finished answer's stream events "
                                                                  "stay resumable.")
    title_chars: int = Field(60, gt=0, description="Length of a conversation's automatic title.")
    tools: str = Field("calculator,time,search,remember", description="Built-in tools the chat's model may call "
                                                             "(comma-separated; empty for none).")
    max_tool_calls_per_answer: int = Field(4, ge=0, description="Tool calls one answer may make before it must "
                                                                "answer in text.")
    tool_rounds_reserved: int = Field(1, ge=0, description="Rounds after the first (a tool's result read back) "
                                                           "an answer with tools reserves quota for before it "
                                                           "starts, each twice the first round; 0: all rounds "
                                                           "share the first round's reservation.")


class TrafficSettings(Group):
    """Tiers, admission, reasoning effort and the service-level objectives."""

    tiers_file: str | None = Field(None, description="TOML file of tiers; default: built-in free/plus/pro.")
    default_tier: str = Field("free", description="Tier of a new account.")
    queue_max_wait_s: float = Field(30.0, gt=0, description="Longer in the admission queue: 503 with Retry-After.")
    admission_max_running: int | None = Field(None, gt=0, description="Generations admitted at once "
                                                                      "(default: engine.max_num_seqs).")
    reasoning_share: float = Field(0.5, ge=0, le=1, description="Most of the running slots reasoning requests "
                                                                "may hold.")
    reasoning_max_effort: Literal["low", "medium", "high"] = Field("high", description="Cap on the reasoning "
                                                                                     "effort dial.")
    slo_ttft_s: float | None = Field(2.0, gt=0, description="Time-to-first-token target behind goodput.")
    slo_tpot_s: float | None = Field(0.2, gt=0, description="Time-per-output-token target behind goodput.")
    cached_input_discount: float = Field(0.5, ge=0, le=1, description="Share taken off the quota cost of "
                                         "prompt tokens served from the prefix cache (0: full price; "
                                         "1: free).")


class ModerationSettings(Group):
    """Input and streaming output moderation."""

    mode: Literal["lexicon", "openai", "off"] = Field("lexicon", description="lexicon (built in), openai (an "
                                                                             "OpenAI-compatible /v1/moderations) or off.")
    url: str | None = Field(None, description="With mode = openai: the server's base URL (.../v1).")
    model: str | None = Field(None, description="The moderation model to ask for (default: the server's).")
    api_key: str | None = Field(None, description="Bearer token for the moderation server.")
    timeout_s: float = Field(5.0, gt=0, description="Timeout of one moderation call.")
    holdback_tokens: int = Field(4, ge=0, description="Pieces of output held back for the output check.")


class FleetSettings(Group):
    """Several models or replicas behind the router."""

    models: list[dict] | None = Field(None, description="[[fleet.models]] tables: one per served model.")
    replicas: list[str] | None = Field(None, description="Replica URLs serving model.name.")
    router_policy: Literal["round_robin", "least_load", "prefix_aware"] = Field(
        "prefix_aware", description="How the router places a request.")
    router_weights: dict[str, float] | None = Field(None, description="prefix_aware weights: prefix, kv_usage, "
                                                                      "waiting, min_prefix_fraction.")


class RecoverySettings(Group):
    """Crash recovery and shutdown."""

    stale_s: float = Field(5.0, gt=0, description="An answer in progress with no writer id (begun by an older "
                                                  "version) and not saved for this long was left by a dead "
                                                  "process: interrupted. Answers with a writer id are judged "
                                                  "by their writer.")
    shutdown_drain_s: float = Field(20.0, ge=0, description="On SIGTERM, running answers get this long to finish.")


class SharedStateSettings(Group):
    """Several gateways: what is hot lives in Redis when url is set."""

    redis_url: str | None = Field(None, description="redis://host:port/db; none: quotas, stream logs and stops "
                                                    "live in this process.")
    prefix: str = Field("chatloom", description="Key prefix, so several services can share one Redis.")
    gateway_id: str | None = Field(None, description="This gateway's name in the fleet (default: host-pid-random).")
    job_lease_s: float = Field(3.0, gt=0, description="A dead gateway's answers are taken over this long after "
                                                      "its last renewal.")
    shutdown_grace_s: float = Field(20.0, ge=0, description="On SIGTERM, running answers get this long before they "
                                                            "are handed over.")


class RuntimeSettings(Group):
    """Process-level switches of the engine's machinery, read from the environment by the lower layers."""

    kernels: bool = Field(True, description="Use the C++ kernels (compiled on first use); off: the PyTorch path.")
    kernel_cache: str | None = Field(None, description="Folder for the compiled kernels "
                                                       "(default: ~/.cache/chatloom/kernels).")
    work_pool: bool = Field(True, description="Run the kernels' parallel loops on chatloom's work pool (a stalled "
                                              "thread's share is taken by the others); off: OpenMP's static split, "
                                              "for comparisons. Read by the C++ kernels when they load.")
    skip_memory_check: bool = Field(False, description="Load a model even when weights and KV cache look larger "
                                                       "than the available memory.")


class PortabilitySettings(Group):
    """Export and import of conversations (our own JSON format and ChatGPT's conversations.json)."""

    import_max_bytes: int = Field(50_000_000, gt=0, description="Largest import file; a larger one gets 413 "
                                                                "(this route alone may exceed server.max_body_bytes).")
    import_max_messages: int = Field(200_000, gt=0, description="Most messages one import may hold.")


class MemorySettings(Group):
    """Custom instructions and remembered facts, placed in the system prompt of the user's conversations."""

    enabled: bool = Field(True, description="Add the user's instructions and memories to the system prompt, and "
                                            "let the model propose memories (the `remember` tool).")
    prompt_budget_tokens: int = Field(400, ge=0, description="Most tokens the instructions and memories may add to "
                                                             "the system prompt; the newest memories that fit go in.")
    max_memories: int = Field(200, gt=0, description="Most memories (confirmed or proposed) one user may keep.")
    max_memory_chars: int = Field(500, gt=0, description="Longest memory.")
    max_instructions_chars: int = Field(3000, gt=0, description="Longest custom instructions.")


class SsoSettings(Group):
    """Single sign-on: OpenID Connect (authorization code with PKCE) against one identity provider."""

    enabled: bool = Field(False, description="Offer 'Sign in with' the provider below on the login screen.")
    issuer: str | None = Field(None, description="The provider's issuer URL; its /.well-known/openid-configuration "
                                                 "is read for the endpoints.")
    client_id: str | None = Field(None, description="This server's client id at the provider.")
    client_secret: str | None = Field(None, description="Its client secret (none: a public client, PKCE alone).")
    scopes: str = Field("openid email profile", description="Scopes asked for (space-separated; openid is needed).")
    redirect_url: str | None = Field(None, description="The callback URL registered at the provider; default: this "
                                                       "server's own /auth/sso/callback as the browser reached it.")
    button_label: str = Field("Sign in with SSO", description="Text of the login screen's single sign-on button.")
    local_login: bool = Field(True, description="Keep username/password sign-in and sign-up; off: SSO only.")
    create_users: bool = Field(True, description="A person the server does not know gets an account on first "
                                                 "sign-in; off: only existing accounts (by email) may sign in.")
    link_by_email: bool = Field(True, description="A first sign-in whose verified email belongs to an account "
                                                  "signs in to that account (linked, not duplicated).")
    role_claim: str | None = Field(None, description="ID-token or userinfo claim (a string or a list of strings, "
                                                     "e.g. groups) mapped to admin and tier below.")
    admin_values: list[str] = Field(default_factory=list, description="Values of role_claim that make the user an "
                                                                      "admin (set at every sign-in).")
    tier_values: dict[str, str] = Field(default_factory=dict, description="Value of role_claim -> tier name; the "
                                                                          "first match sets the tier at every "
                                                                          "sign-in (none: the tier is left alone).")
    state_ttl_s: int = Field(600, gt=0, description="How long a sign-in may take between leaving for the provider "
                                                    "and coming back.")
