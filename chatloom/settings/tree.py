"""The settings tree: every default of the service, defined once, grouped by concern.

Each group is a pydantic model; `Settings` is their root. Engine sizing and sampling defaults live
here too, and the engine's own config objects take their defaults from these groups, so a default
changed here changes everywhere (CLI, REST API, OpenAI API, engine).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"
# The static embedding model shipped in the wordllama package (chatloom/models/static_embeddings.py).
DEFAULT_EMBEDDING_MODEL = "wordllama-l2-supercat-256"
# Its ranking's weight in the fusion with full-text search: at 1 its near misses push answers out of the
# top 5; at 0.1 it adds what full-text search misses and keeps what it finds (docs/files.md).
STATIC_VECTOR_WEIGHT = 0.1
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
    db_start_wait_s: float = Field(60.0, ge=0, description="How long a starting gateway waits for a database "
                                                          "it cannot reach yet (PostgreSQL restarting, say), "
                                                          "retrying, before it gives up.")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field("info", description="Log level.")
    max_body_bytes: int = Field(1_000_000, gt=0, description="Larger request bodies get 413 before parsing.")
    metrics_public: bool = Field(True, description="Serve GET /metrics without a token (as vLLM does).")
    cors_origins: list[str] = Field(default_factory=list, description="Web origins (scheme://host[:port]) whose "
                                                                    "pages may call the API from a browser; "
                                                                    "empty: none (the app's own pages need none).")
    hsts_max_age_s: int = Field(31_536_000, ge=0, description="Strict-Transport-Security max-age sent on HTTPS "
                                                              "responses (0: not sent).")

    @model_validator(mode="after")
    def _origins(self) -> "ServerSettings":
        for origin in self.cors_origins:
            scheme, sep, rest = origin.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "/" in rest or "*" in rest:
                raise ValueError(f"server.cors_origins: {origin!r} is not an origin such as "
                                 "'https://chat.example.com' (a scheme and a host, no path, no wildcard)")
        return self


class ModelSettings(Group):
    """Which model the local engine loads, and how its weights multiply."""

    name: str = Field(DEFAULT_MODEL, description="Registry id (see `chatloom models`), a GGUF file or a "
                                                  "Hugging Face folder.")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="Weights and KV cache dtype.")
    int8_matmul: bool | None = Field(None, description="Multiply quantized GGUF weights with int8 activations: "
                                                        "faster, slightly less exact. Unset: on for K-quant "
                                                        "files (Q4_K_M and the like, multiplied the way "
                                                        "llama.cpp does) where the CPU has AVX-512 VNNI, "
                                                        "or AVX2 without AVX-512; off otherwise; false "
                                                        "keeps every file exact.")
    bf16_matmul: bool = Field(False, description="Keep float weights in bfloat16 for the matmuls "
                                                 "(commands with --bf16-matmul).")
    weight_cache: str = Field("auto", description="Folder that keeps a GGUF file's K-quant layers in the "
                                                  "kernels' packed layout, so that later starts map them "
                                                  "instead of packing them again (docs/models.md): `auto` is "
                                                  "$XDG_CACHE_HOME/chatloom/weights, else "
                                                  "~/.cache/chatloom/weights; empty or `off` packs at every start.")
    mmproj: str | None = Field(None, description="A LLaVA or SmolVLM image encoder and projector as llama.cpp's "
                                                 "`mmproj` GGUF file, for a GGUF decoder (docs/vision-and-voice.md).")


class EngineSettings(Group):
    """The local engine's sizing: the KV pool, the per-step budget, speculative decoding."""

    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    kv_cache_gb: float | None = Field(None, gt=0, description="KV-cache memory in GiB (ignored when num_blocks is "
                                                             "set). Default: room for 4 sequences at the full "
                                                             "context window, at most half the memory available "
                                                             "after loading (see docs/speed.md).")
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
    encoder_cache_mb: float = Field(256.0, ge=0, description="Memory for image embeddings kept by image hash "
                                                             "(vision models), so a second question about the "
                                                             "same image runs no encoder, and for the encoder "
                                                             "state of tiles part-way through its layers; 0 "
                                                             "keeps none.")
    encoder_max_slowdown: float = Field(0.1, ge=0, description="While other requests share the engine, image "
                                                               "encoder work gets at most this fraction of the "
                                                               "time of the steps they share, so their time per "
                                                               "output token rises by about that on average "
                                                               "(0.1: 10%); 0 encodes only in steps with "
                                                               "nothing else to run.")
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off", description="Speculative decoding: off, ngram (prompt lookup) or draft (speculative_model).")
    num_speculative_tokens: int = Field(4, ge=1, description="Most tokens proposed per sequence and step.")
    speculative_model: str | None = Field(None, description="With speculative = draft: a registry id, a path, "
                                                            "or self-int8 / self-layers:N.")
    speculative_adaptive: bool = Field(True, description="Choose the proposal length per step from acceptance "
                                                         "and measured step cost.")
    background_priority: int | None = Field(1000, description="Sequences of this engine priority or above (batch "
                                                           "requests: batch.engine_priority) sit out every "
                                                           "step that carries a prompt chunk of a higher-"
                                                           "priority one, so a batch never lengthens an "
                                                           "interactive request's time to first token; unset: "
                                                           "they always run.")
    background_yield: Literal["auto", "prefill", "step"] = Field(
        "auto", description="Which steps background sequences sit out: prefill (those reading a higher-priority "
                            "prompt), step (every step carrying a higher-priority sequence: they use only idle "
                            "steps, for an engine whose step time grows with each sequence, as on a CPU), or auto "
                            "(step on a CPU, prefill on a GPU).")
    background_step_tokens: int | None = Field(
        None, gt=0, description="Most tokens (decodes and prompt chunks) in a step that carries only background "
                                "sequences, so an interactive request that arrives during it waits for a short "
                                "step; unset: 32 on a CPU (where a step's time grows with its tokens), the whole "
                                "step budget on a GPU.")
    background_interrupt: bool = Field(
        True, description="Stop a step that carries only background sequences between two layers when an "
                          "interactive request reaches the engine, so it waits for one layer rather than the "
                          "whole step; the step runs again later (the local engine's native decode path).")

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
    max_n: int = Field(8, ge=1, description="The most choices (n) one OpenAI-API request may ask for; "
                                            "above it the request is refused with a 400.")


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
    login_failures_per_account: int = Field(5, ge=1, description="Failed sign-ins to one username within "
                                                                  "login_window_s before further tries get 429.")
    login_failures_per_address: int = Field(30, ge=1, description="Failed sign-ins from one client address within "
                                                                  "login_window_s before further tries get 429.")
    login_window_s: float = Field(900.0, gt=0, description="The window the sign-in failures are counted in, from "
                                                           "the first failure.")
    signups_per_address: int = Field(10, ge=1, description="Sign-up attempts from one client address within "
                                                           "signup_window_s before further ones get 429.")
    signup_window_s: float = Field(3600.0, gt=0, description="The window sign-up attempts are counted in.")
    api_key_max_days: int | None = Field(None, gt=0, description="Longest lifetime an API key may be given, in "
                                                                 "days; also the lifetime of a key asked for "
                                                                 "without one. Unset: keys may never expire.")


class ChatSettings(Group):
    """Conversations: the system prompt, summaries, titles, the chat's tools."""

    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="System prompt of every conversation.")
    max_message_chars: int = Field(32_000, gt=0, description="Longest user message.")
    summary_max_tokens: int = Field(200, gt=0, description="Length of a summary of older turns.")
    summary_keep_fraction: float = Field(0.5, gt=0, le=1, description="After summarizing, the most of the "
                                                                      "history budget kept as verbatim turns.")
    older_turns: Literal["summary", "retrieved", "both"] = Field(
        "both", description="What stands in the prompt for the turns of a long conversation that no longer fit: "
                            "'summary' (one the model writes and keeps up to date), 'retrieved' (the older turns "
                            "most relevant to the new message, found by full-text search, verbatim), or 'both'.")
    retrieved_turns_tokens: int = Field(400, ge=0, description="Most prompt tokens the retrieved older turns may "
                                                               "take (at most a quarter of the context window); "
                                                               "their room comes out of the verbatim turns'.")
    event_log_retention_s: float = Field(600.0, gt=0, description="How long a finished answer's stream events "
                                                                  "stay resumable.")
    title_chars: int = Field(60, gt=0, description="Length of a conversation's automatic title.")
    tools: str = Field("calculator,time,search,remember", description="Built-in tools the chat's model may call "
                                                                      "(comma-separated; empty for none): "
                                                                      "calculator, time, search, remember, python, "
                                                                      "web_search, fetch_page.")
    max_tool_calls_per_answer: int = Field(4, ge=0, description="Tool calls one answer may make before it must "
                                                                "answer in text.")
    tool_rounds_reserved: int = Field(1, ge=0, description="Rounds after the first (a tool's result read back) "
                                                           "an answer with tools reserves quota for before it "
                                                           "starts, each twice the first round; 0: all rounds "
                                                           "share the first round's reservation.")


class McpServerSettings(Group):
    """One MCP server whose tools the chat's model may call: a command run over stdio, or a URL."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$", description="Short name; the model sees its tools as "
                                                                    "NAME__TOOL.")
    command: list[str] | None = Field(None, description="Program and arguments of a stdio server, started for "
                                                        "each call and each listing of its tools.")
    url: str | None = Field(None, description="Streamable HTTP endpoint of the server, e.g. http://host:8000/mcp.")
    headers: dict[str, str] = Field({}, description="HTTP headers sent with every request (tokens, API keys).")
    env: dict[str, str] = Field({}, description="Environment of a stdio server, over a minimal default "
                                                "(never the gateway's own environment).")

    @model_validator(mode="after")
    def _one_way_in(self) -> "McpServerSettings":
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r} needs either command or url")
        if self.command is not None and not self.command:
            raise ValueError(f"MCP server {self.name!r} has an empty command")
        return self


class ToolsSettings(Group):
    """The chat's acting tools: the code interpreter's sandbox, web search and the page fetcher."""

    code_python: str | None = Field(None, description="Python interpreter the code interpreter runs inside the "
                                                      "sandbox (default: the server's own); what it has "
                                                      "installed (numpy, pandas, matplotlib) is what the code "
                                                      "can import.")
    code_cpu_s: int = Field(10, gt=0, description="CPU seconds one run of the code interpreter may use.")
    code_wall_s: float = Field(30.0, gt=0, description="Wall-clock seconds one run may take before it is killed.")
    code_memory_mb: int = Field(1024, ge=64, description="Address space of each process of a run, in MiB.")
    code_processes: int = Field(32, gt=0, description="Processes and threads a run may have at once.")
    code_output_chars: int = Field(4000, ge=100, description="Characters of stdout and stderr each kept from a "
                                                             "run; a run that prints far more is stopped.")
    code_file_mb: int = Field(20, gt=0, description="Largest file a run may write, in MiB.")
    code_scratch_mb: int = Field(100, gt=0, description="Most a conversation's scratch folder may hold, in MiB.")
    code_max_files: int = Field(10, ge=0, description="Files (and plots) one run may hand back for download.")
    code_concurrency: int = Field(4, gt=0, description="Runs of the code interpreter at once per gateway.")
    code_uid: int = Field(61000, gt=0, description="When the server runs as root: runs use the user ids from this "
                                                   "one up (one per concurrent run), never root's.")
    search_url: str | None = Field(None, description="SearXNG base URL for the web_search tool (its JSON API, "
                                                     "format=json, must be enabled).")
    search_results: int = Field(5, gt=0, le=20, description="Results web_search gives the model.")
    fetch_timeout_s: float = Field(10.0, gt=0, description="Time a page fetch (or a search) may take in all.")
    fetch_max_bytes: int = Field(2_000_000, gt=0, description="Largest response body the fetcher reads.")
    fetch_max_redirects: int = Field(3, ge=0, description="Redirects a fetch follows, each checked again.")
    fetch_text_chars: int = Field(3500, ge=200, description="Characters of a fetched page's text the model reads.")
    fetch_allow: list[str] = Field([], description="Hosts or networks (CIDR) fetch_page may reach although they are "
                                                   "private, loopback or link-local, e.g. [\"intranet.example\", "
                                                   "\"10.1.0.0/16\"] (the search_url's host is always reached).")
    mcp_servers: list[McpServerSettings] = Field([], description="MCP servers whose tools the chat's model may "
                                                                 "call (TOML: [[tools.mcp_servers]] tables).")
    mcp_user_servers: bool = Field(False, description="Let each user add MCP servers of their own (streamable "
                                                      "HTTP URLs, held to the fetch rules: no private addresses "
                                                      "unless fetch_allow names them).")
    mcp_user_max_servers: int = Field(5, ge=0, description="MCP servers one user may add.")
    api_tools: list[Literal["web_search", "file_search", "code_interpreter", "mcp"]] = Field(
        ["web_search", "file_search", "code_interpreter", "mcp"],
        description="Built-in tool types the Responses API (and, for web_search, Chat Completions' "
                    "web_search_options) runs on the server; a request naming one left out is a 400. Each also "
                    "needs what it runs on: web_search a search_url, code_interpreter a working bubblewrap, "
                    "mcp mcp_user_servers.")
    mcp_timeout_s: float = Field(30.0, gt=0, description="Time an MCP tool call (or a listing of a server's "
                                                         "tools) may take before it is a tool error.")
    mcp_list_ttl_s: float = Field(60.0, ge=0, description="How long a server's tool list is reused before it is "
                                                          "asked again (a server that failed: a sixth of it).")
    kv_policy: Literal["hold", "evict", "auto"] = Field(
        "auto", description="The KV cache of an answer while its tools run: hold (pinned until the resume, "
                            "which prefills only the tool results), evict (freed; the resume re-prefills "
                            "through the prefix cache) or auto (hold where the prefix cache would lose the "
                            "blocks during the tool's call, judged by its long calls; evict otherwise; "
                            "docs/tools.md). "
                            "Any hold gives way to a request short of blocks. The Responses API's built-in "
                            "tools follow it too.")
    kv_hold_timeout_s: float = Field(60.0, gt=0, description="Longest a held KV cache waits for its tools "
                                                             "before it is freed.")


class SloTarget(Group):
    """A class's latency targets; unset: no target on that figure."""

    ttft_s: float | None = Field(None, gt=0, description="Time to first token target.")
    tpot_s: float | None = Field(None, gt=0, description="Time per output token target.")


class TrafficSettings(Group):
    """Tiers, admission, reasoning effort and the service-level objectives."""

    tiers_file: str | None = Field(None, description="TOML file of tiers; default: built-in free/plus/pro.")
    default_tier: str = Field("free", description="Tier of a new account.")
    queue_max_wait_s: float = Field(30.0, gt=0, description="Longer in the admission queue: 503 with Retry-After.")
    admission_max_running: int | None = Field(None, gt=0, description="Generations admitted at once "
                                                                      "(default: engine.max_num_seqs, times "
                                                                      "the local replicas serving).")
    reasoning_share: float = Field(0.5, ge=0, le=1, description="Most of the running slots reasoning requests "
                                                                "may hold.")
    reasoning_max_effort: Literal["low", "medium", "high"] = Field("high", description="Cap on the reasoning "
                                                                                     "effort dial.")
    slo_ttft_s: float | None = Field(2.0, gt=0, description="Time-to-first-token target behind goodput.")
    slo_tpot_s: float | None = Field(0.2, gt=0, description="Time-per-output-token target behind goodput.")
    cached_input_discount: float = Field(0.5, ge=0, le=1, description="Share taken off the quota cost of "
                                         "prompt tokens served from the prefix cache (0: full price; "
                                         "1: free).")
    metering_flush_gap_ms: float = Field(50.0, ge=0, description="Least time between the starts of two "
                                         "metering writes that follow each other back to back: answers "
                                         "ending together share a transaction. A record in a quiet moment "
                                         "is written at once.")
    slo_classes: dict[str, SloTarget] = Field(
        default_factory=lambda: {"reasoning": SloTarget(ttft_s=10.0, tpot_s=0.2)},
        description="Targets per traffic class, overriding slo_ttft_s/slo_tpot_s: 'reasoning', 'interactive', "
                    "'interactive:<tier>' (a tier's interactive requests), 'batch'. TOML: "
                    "[traffic.slo_classes.reasoning] ttft_s = 10.")

    @model_validator(mode="after")
    def _known_classes(self) -> "TrafficSettings":
        for name in self.slo_classes:
            kind, _, tier = name.partition(":")
            if kind not in ("interactive", "reasoning", "batch") or (tier and kind != "interactive") \
                    or (":" in name and not tier):
                raise ValueError(f"unknown SLO class {name!r} (use interactive, interactive:<tier>, reasoning "
                                 "or batch)")
        return self


class AutoscaleSettings(Group):
    """The predictive autoscaler (serving/autoscale.py): with --local-replicas auto it starts and drains
    local replicas; otherwise it reports the replicas it wants on /metrics for an external autoscaler."""

    enabled: bool = Field(False, description="Run the autoscaler (--local-replicas auto turns it on).")
    min_replicas: int = Field(1, ge=1, description="Fewest replicas.")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    capacity_rps: float | None = Field(None, gt=0, description="Requests per second one replica serves within "
                                                               "its SLO (required when enabled).")
    startup_s: float | None = Field(None, ge=0, description="Seconds from starting a replica to ready (unset: "
                                                            "measured on the first local replicas, else 120).")
    interval_s: float = Field(60.0, gt=0, description="How often arrivals are counted and the fleet sized.")
    headroom: float = Field(1.2, ge=1, description="Provision this much above the forecast.")
    scale_down_hold_s: float = Field(600.0, ge=0, description="How long the need must stay lower before "
                                                              "replicas are drained.")

    @model_validator(mode="after")
    def _consistent(self) -> "AutoscaleSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscale.min_replicas ({self.min_replicas}) is above autoscale.max_replicas "
                             f"({self.max_replicas})")
        if self.enabled and self.capacity_rps is None:
            raise ValueError("autoscale.capacity_rps is needed when the autoscaler is on: the requests per "
                             "second one replica serves within its SLO")
        return self


class DegradeSettings(Group):
    """The ladder of cheaper answers taken before the admission queue refuses (serving/degrade.py)."""

    enabled: bool = Field(True, description="Take the degrade steps under load.")
    effort_queue_wait_share: float = Field(0.1, gt=0, lt=1, description="Queue wait, as a share of "
                                           "traffic.queue_max_wait_s, that caps reasoning effort.")
    effort_kv_usage: float = Field(0.90, gt=0, le=1, description="KV-cache occupancy that caps reasoning effort.")
    effort_cap: Literal["low", "medium"] = Field("low", description="Reasoning effort allowed at that step.")
    small_model_queue_wait_share: float = Field(0.2, gt=0, lt=1, description="Queue wait share that moves "
                                                "the chosen tiers to the small model.")
    small_model_kv_usage: float = Field(0.95, gt=0, le=1, description="KV-cache occupancy that moves the "
                                                                      "chosen tiers to the small model.")
    small_model: str | None = Field(None, description="A served model for that step (unset: the step "
                                                      "changes nothing).")
    small_model_tiers: list[str] = Field(["free"], description="Tiers moved to the small model.")
    max_tokens_queue_wait_share: float = Field(0.4, gt=0, lt=1, description="Queue wait share that shortens "
                                               "the chosen tiers' answers.")
    max_tokens_kv_usage: float = Field(0.98, gt=0, le=1, description="KV-cache occupancy that shortens the "
                                                                     "chosen tiers' answers.")
    max_tokens_cap: int = Field(256, gt=0, description="Longest answer of those tiers at that step.")
    max_tokens_tiers: list[str] = Field(["free"], description="Tiers whose answers are shortened.")
    clear_queue_wait_share: float = Field(0.5, gt=0, lt=1, description="A step is undone once the queue wait "
                                                                       "is below this share of its threshold...")
    clear_kv_margin: float = Field(0.05, ge=0, lt=1, description="...and KV occupancy this far below its "
                                                                "threshold...")
    hold_s: float = Field(10.0, ge=0, description="...for this long.")
    check_interval_s: float = Field(0.25, ge=0, description="Least time between two readings of the signals.")

    @model_validator(mode="after")
    def _ascending(self) -> "DegradeSettings":
        for what in ("queue_wait_share", "kv_usage"):
            values = [getattr(self, f"{step}_{what}") for step in ("effort", "small_model", "max_tokens")]
            if values != sorted(values):
                raise ValueError(f"the degrade thresholds on {what} must rise step by step (effort <= "
                                 f"small_model <= max_tokens), not {values}")
        return self


class ModerationSettings(Group):
    """Input and streaming output moderation."""

    mode: Literal["lexicon", "openai", "off"] = Field("lexicon", description="lexicon (built in), openai (an "
                                                                             "OpenAI-compatible /v1/moderations) or off.")
    url: str | None = Field(None, description="With mode = openai: the server's base URL (.../v1).")
    model: str | None = Field(None, description="The moderation model to ask for (default: the server's).")
    api_key: str | None = Field(None, description="Bearer token for the moderation server.")
    timeout_s: float = Field(5.0, gt=0, description="Timeout of one moderation call.")
    holdback_tokens: int = Field(4, ge=0, description="Pieces of output held back for the output check.")


class VisionSettings(Group):
    """Images in chat messages, for models that read them (Idefics3 / SmolVLM, LLaVA), and fetching image URLs."""

    max_images_per_request: int = Field(8, ge=0, description="Most images one request may carry, all its "
                                                             "messages together.")
    max_image_bytes: int = Field(10 * 2**20, gt=0, description="Largest image file accepted, in bytes.")
    max_image_pixels: int = Field(25_000_000, gt=0, description="Most pixels (width x height) an image may "
                                                                "have; larger ones, decompression bombs "
                                                                "among them, are refused before decoding.")
    fetch_urls: bool = Field(False, description="Fetch http(s) image URLs (otherwise only data URLs and base64 "
                                                "are taken); private, loopback and link-local addresses are "
                                                "refused unless fetch_allow names them.")
    fetch_allow: list[str] = Field(default_factory=list, description="Host names or networks (CIDR) that image "
                                                                     "URLs may reach although not public.")
    fetch_timeout_s: float = Field(10.0, gt=0, description="Time limit for fetching one image URL, "
                                                           "redirects included.")


class SpeechSettings(Group):
    """Speech to text (POST /v1/audio/transcriptions) with a Whisper model run in this process."""

    model: str | None = Field(None, description="A Whisper Hugging Face folder (e.g. whisper-small); unset, "
                                                "the transcription endpoint answers 404.")
    max_audio_bytes: int = Field(25 * 2**20, gt=0, description="Largest audio file accepted, in bytes.")
    max_audio_seconds: float = Field(3600.0, gt=0, description="Longest audio accepted, in seconds.")
    max_batch: int = Field(8, gt=0, description="Most 30-second windows transcribed together, from any "
                                                "number of requests.")


class FleetSettings(Group):
    """Several models or replicas behind the router."""

    models: list[dict] | None = Field(None, description="[[fleet.models]] tables: one per served model.")
    replicas: list[str] | None = Field(None, description="Replica URLs serving model.name.")
    router_policy: Literal["round_robin", "least_load", "prefix_aware"] = Field(
        "prefix_aware", description="How the router places a request.")
    router_weights: dict[str, float] | None = Field(None, description="prefix_aware weights: prefix, kv_usage, "
                                                                      "waiting, min_prefix_fraction.")
    router_class_targets: bool = Field(False, description="Send a request away from a replica expected to miss its "
                                                          "class's time-to-first-token target (least_load and "
                                                          "prefix_aware). Off: in the simulator it helped some "
                                                          "runs near saturation and tipped others into overload.")
    router_opening_limit: int = Field(2, ge=0, description="Most requests a router places at once (tokenizing "
                                                           "the prompt at a replica, choosing one, sending it); "
                                                           "the rest wait their turn, so that a burst of new "
                                                           "requests does not hold up the answers streaming. 0: "
                                                           "no limit.")
    router_opening_hold_ms: float = Field(50.0, gt=0, description="Longest one request keeps its place while it "
                                                                  "waits on a replica during placement.")


class EmbeddingsSettings(Group):
    """Embeddings (/v1/embeddings, and the vectors of file retrieval)."""

    pooling: Literal["mean", "last"] = Field("last", description="How a model served in this process pools its "
                                                                 "final hidden states into one vector: the last "
                                                                 "token's, or the mean of every token (a "
                                                                 "[[fleet.models]] entry's pooling overrides it).")
    max_inputs: int = Field(2048, gt=0, description="Most inputs in one embeddings request.")
    max_request_tokens: int = Field(65_536, gt=0, description="Most tokens of all inputs of one embeddings "
                                                              "request together.")


class FilesSettings(Group):
    """Uploaded files: limits, text extraction, chunking and retrieval into the chat prompt."""

    max_bytes: dict[str, int] = Field(
        {"batch": 100_000_000, "default": 25_000_000},
        description="Largest upload to the OpenAI-shaped /v1/files per purpose, in bytes ('default' for the "
                    "purposes not named); larger is a 413 and nothing is stored.")
    max_file_bytes: int = Field(10_000_000, gt=0, description="Largest upload to the product's /files, for "
                                                              "retrieval (413 past it).")
    max_user_bytes: int = Field(200_000_000, gt=0, description="Most bytes of files one user may keep (413 past it).")
    max_extracted_chars: int = Field(2_000_000, gt=0, description="Most text extracted from one file; more is "
                                                                  "refused as a decompression bomb (413).")
    max_archive_ratio: float = Field(100.0, gt=1, description="A DOCX whose parts, or a PDF whose pages' drawing "
                                                              "operators, unpack to more than this many times its "
                                                              "size (and over 1 MB) is refused as a decompression "
                                                              "bomb.")
    chunk_chars: int = Field(1000, ge=200, description="Length of one indexed passage, in characters.")
    chunk_overlap_chars: int = Field(100, ge=0, description="Characters a passage repeats from the one before.")
    embeddings: bool = Field(False, description="Index passages with embeddings too (embedding_model) and fuse "
                                                "vector search with full-text search; off: full-text search only, "
                                                "which ranks best when questions use the documents' words; vectors "
                                                "add passages that say it in other words (docs/files.md has the "
                                                "figures).")
    embedding_model: str = Field(DEFAULT_EMBEDDING_MODEL,
                                 description="What embeds passages and questions: the default, a static "
                                             "embedding model shipped in the wordllama package and run in the "
                                             "gateway (no engine time, no quota); or the name of a served model "
                                             "(its pooled hidden states, through quota and admission); with "
                                             "embeddings_url, the remote server's model name (required).")
    embeddings_url: str | None = Field(None, description="An OpenAI-compatible embeddings endpoint, the whole URL "
                                                         "(http://host:8080/v1/embeddings), that embeds passages "
                                                         "and questions instead of the served model; when it "
                                                         "fails, retrieval falls back to full-text search.")
    embeddings_api_key: str | None = Field(None, description="Bearer token for embeddings_url.")
    embeddings_timeout_s: float = Field(10.0, gt=0, description="How long one request to embeddings_url may take.")
    top_k: int = Field(4, ge=1, description="Passages retrieved for one message.")
    prompt_tokens: int = Field(1024, ge=0, description="Most prompt tokens the retrieved passages may take; the "
                                                       "conversation's history gets the rest of the budget.")
    rrf_k: int = Field(60, gt=0, description="The constant of reciprocal rank fusion (full-text and vector ranks).")
    vector_weight: float | None = Field(None, ge=0, le=1,
                                        description="How much the vector ranking counts in the fusion, against 1 "
                                                    "for the full-text ranking: 1 is plain reciprocal rank fusion, "
                                                    "lower suits embeddings weaker than the words. Unset: "
                                                    f"{STATIC_VECTOR_WEIGHT} with the default static embedding "
                                                    "model, 1 with any other (docs/files.md has figures).")
    search_tool: bool = Field(True, description="Offer the chat's model the file_search tool (the user's files "
                                                "and collections searched with a query of its own) once the user "
                                                "has files; its passages are cited like the automatic ones.")

    @model_validator(mode="after")
    def _positive(self) -> "FilesSettings":
        if self.embeddings_url and self.embedding_model == DEFAULT_EMBEDDING_MODEL:
            raise ValueError("embeddings_url needs embedding_model set to the remote server's model name")
        if "default" not in self.max_bytes:
            raise ValueError("max_bytes needs a 'default' entry")
        if any(v <= 0 for v in self.max_bytes.values()):
            raise ValueError("max_bytes values must be positive")
        return self

    def limit(self, purpose: str) -> int:
        return self.max_bytes.get(purpose, self.max_bytes["default"])

    def fusion_weight(self) -> float:
        """The vector ranking's weight in the fusion: vector_weight, or its default for the embedder."""
        if self.vector_weight is not None:
            return self.vector_weight
        static = self.embedding_model == DEFAULT_EMBEDDING_MODEL and not self.embeddings_url
        return STATIC_VECTOR_WEIGHT if static else 1.0


class BatchSettings(Group):
    """The Batch API: work that can wait, run in capacity interactive traffic leaves idle."""

    quota_discount: float = Field(0.5, ge=0, le=1, description="Fraction of a batch request's tokens that counts "
                                                               "against the user's quota (1: full price).")
    slot_share: float = Field(0.5, gt=0, le=1, description="Most of the admission slots batch requests may hold "
                                                           "(the rest stay free for interactive arrivals).")
    busy_slots: int | None = Field(None, ge=1, description="Most slots batch requests may hold while interactive "
                                                          "requests run or wait (none: slot_share alone). On an "
                                                          "engine whose step time grows with the batch (a CPU), a "
                                                          "low number keeps interactive latency.")
    concurrency: int = Field(8, ge=1, description="Requests of one batch a gateway runs at once.")
    lease_s: float = Field(15.0, gt=0, description="A batch whose gateway stopped renewing its lease this long "
                                                   "ago is continued by another gateway.")
    poll_s: float = Field(1.0, gt=0, description="How often a gateway looks for batches to run or take over.")
    engine_priority: int = Field(1000, description="Engine priority of batch requests (lower runs first; "
                                                   "interactive requests use minus their tier's priority), so the "
                                                   "engine preempts batch sequences first when KV blocks run out.")


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
    gc_freeze: bool = Field(True, description="A server (`chatloom serve`, `chatloom replica`) moves the objects "
                                              "its startup and model load built out of the garbage collector's "
                                              "reach, so that no collection walks them again (docs/deployment.md).")
    gc_thresholds: list[int] = Field([700, 10, 2000], min_length=3, max_length=3,
                                     description="A server's `gc.set_threshold()`: Python's defaults but a "
                                                 "full collection after 2,000 middle ones instead of 10 (about a "
                                                 "minute with the young collections' clock), since a full one "
                                                 "stops every stream for as long as it walks the heap.")
    gc_young_interval_ms: float = Field(30.0, ge=0, description="A server collects the two younger generations "
                                                                "this often, from a thread of its own, so that each "
                                                                "collection is short (0: only when Python's "
                                                                "allocation counts say so; then lower "
                                                                "gc_thresholds[2], e.g. to 100).")

    @field_validator("gc_thresholds")
    @classmethod
    def _thresholds(cls, value: list[int]) -> list[int]:
        if value[0] < 1 or min(value) < 0:
            raise ValueError("three counts, the first at least 1 (0 would turn the collector off)")
        return value


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
