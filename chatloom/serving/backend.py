"""What the product needs from a model server, whatever runs it.

The app talks only to `Backend`. `LocalBackend` runs the chatloom engine in this
process; a remote OpenAI-compatible server (vLLM, SGLang, another chatloom replica)
can implement the same interface without the app noticing.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import AsyncIterator

from chatloom.settings import DEFAULTS

from chatloom.engine.kv_holds import HoldStats
from chatloom.engine.spec_decode.decoder import SpecDecodeStats
from chatloom.engine.structured.constraint import Constraint


class BackendError(Exception):
    """The backend failed while serving a request (crashed engine, lost connection)."""


class BackendNotReady(BackendError):
    """The model is still loading (or failed to load)."""


class ModelLoadFailed(BackendNotReady):
    """An in-process model cannot load (missing file, unsupported architecture, too big): trying again
    will not help, so a server that meets this at start exits instead of waiting to be ready."""


class BadGenerationRequest(BackendError):
    """The backend refuses the request itself (prompt too long, bad sampling values)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class UnknownModel(BadGenerationRequest):
    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(f"unknown model {model!r}; available: {', '.join(known)}", "model_not_found", "model")


@dataclass
class GenerationRequest:
    """One generation. Give chat `messages` ([{"role", "content"}]), a raw `prompt` string, or
    `prompt_token_ids` (already tokenized, as /v1/completions accepts)."""

    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    model: str | None = None  # None: the backend's default model
    max_tokens: int = DEFAULTS.sampling.max_tokens  # sampling defaults: the settings tree's
    temperature: float = DEFAULTS.sampling.temperature
    top_p: float = DEFAULTS.sampling.top_p
    top_k: int = DEFAULTS.sampling.top_k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    request_id: str | None = None  # lets the caller abort() it later
    priority: int = 0
    # Seconds its traffic class's time-to-first-token target leaves; a router prefers replicas expected
    # to meet it (serving/routing.py). None: no target.
    ttft_target_s: float | None = None
    # The last message is an unfinished assistant turn to continue (not closed, no new turn opened),
    # as vLLM's continue_final_message: how an interrupted answer resumes from its saved text.
    continue_final: bool = False

    # Continue an answer another process began (a dead gateway's or replica's): the token ids it
    # produced and the text the user already has. The backend generates only the rest (what is left of
    # max_tokens) and streams only new text; the final counts cover the whole answer.
    resume_token_ids: list[int] = field(default_factory=list)
    resume_text: str = ""

    # Output limited to a grammar (JSON mode, a schema, a regex, choices, forced tool calls).
    constraint: Constraint | None = None

    # n answers to the prompt (deltas tell them apart by index), computed from one prefill where the
    # backend can; each choice's random stream is seed + index where a seed is given.
    n: int = 1
    # Log probabilities of each answer token and of its `logprobs` likeliest alternatives (0: its own
    # only); `prompt_logprobs` the same for the prompt's tokens (a completion's echo). None: not asked.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    # A round of an answer that may call tools: when it ends, the backend keeps its KV cache until told to
    # hold or evict it (hold_kv) or let it go (release_kv). `resume_of`: the request id of the round this
    # request resumes (its prompt repeats that round's and adds the tool results), whose KV it adopts.
    keep_kv: bool = False
    resume_of: str | None = None


@dataclass(frozen=True)
class TextLogprob:
    """One token's log probability as the APIs show it: its text, its bytes (None where the server does
    not say) and, where asked, the likeliest tokens at its place, best first. The logprob is None for a
    prompt's first token (nothing precedes it)."""

    token: str
    logprob: float | None
    bytes: list[int] | None = None
    top: tuple["TextLogprob", ...] = ()


@dataclass(frozen=True)
class Usage:
    """Tokens one request (or several, added up) used; what quotas settle and metering records."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those found in the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens,
                     self.cached_tokens + other.cached_tokens)


@dataclass(frozen=True)
class Embeddings:
    """One unit vector per input, in input order, and the tokens the inputs took."""

    vectors: list[list[float]]
    prompt_tokens: int


# What an embedding input may be: text, or token ids already (as OpenAI's /v1/embeddings takes them).
EmbedInput = str | list[int]


@dataclass(frozen=True)
class Timings:
    """One request's latencies in seconds, vLLM's definitions; None where not measured."""

    queue_time: float | None = None  # waiting inside the engine before the first step
    ttft: float | None = None  # time to first token
    tpot: float | None = None  # (latency - ttft) / (output tokens - 1)
    e2e: float | None = None  # end to end, inside the engine


@dataclass
class Delta:
    """New text since the previous delta; the last one has finished=True and final counts."""

    text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # On the last delta, where the backend measures them.
    metrics: Timings | None = None
    # The answer's token ids new in this delta, where the backend knows them (a stream log keeps them
    # so that another process can resume the answer; see resume_token_ids).
    token_ids: list[int] | None = None
    failovers: int = 0  # on the last delta from a router: replicas the answer moved off mid-way
    # On the last delta, with finish_reason 'stop': the stop sequence that ended the answer, where the
    # backend tells (None: an end-of-text token, or a backend that does not say).
    stop_sequence: str | None = None
    index: int = 0  # the choice this delta belongs to (requests with n > 1); each choice has its last delta
    # Where the request asks: the log probabilities of this delta's tokens, and on a choice's first delta
    # those of the prompt's tokens.
    logprobs: list[TextLogprob] | None = None
    prompt_logprobs: list[TextLogprob] | None = None

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass(frozen=True)
class BackendStats:
    """Load figures of a backend (vLLM's names), read by /metrics, /admin/stats and routing.
    A figure a backend cannot tell is None."""

    ready: bool
    model: str | None = None
    context_window: int | None = None
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    kv_cache_usage_perc: float | None = None
    kv_cache_blocks: int | None = None
    kv_cache_free_blocks: int | None = None
    block_size: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    num_preemptions: int | None = None
    interrupted_steps: int | None = None  # batch steps stopped part-way for interactive work (a local engine)
    # Seconds of engine steps by what they carried: foreground, background (batch alone), interrupted.
    step_seconds: dict[str, float] | None = None
    generation_tokens_per_s: float | None = None
    spec_decode: SpecDecodeStats | None = None  # speculative decoding counters, where it is on
    kv_holds: HoldStats | None = None  # the KV cache of answers waiting for their tools, where it is kept
    # A router's view of its replicas, and a multi-model backend's figures per model.
    policy: str | None = None
    failovers: int | None = None
    replicas: list[ReplicaStatus] | None = None
    models: dict[str, BackendStats] | None = None


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as its router sees it."""

    url: str
    healthy: bool
    draining: bool
    inflight: int
    served: int
    exact_prefix_feed: bool  # the replica publishes its prefix-cache events
    cached_blocks: int  # blocks the router believes the replica holds
    error: str | None = None
    load: BackendStats | None = None  # last figures read from its /metrics


class Backend(abc.ABC):
    """A model server as seen by the product."""

    # -- lifecycle ----------------------------------------------------------------
    def check(self) -> None:
        """Find, before the server starts, what would make start() fail for good (a model file that is
        missing, an architecture chatloom cannot run), without loading weights; raises ModelError."""

    async def start(self) -> None:
        """Get ready to serve (load weights, connect). Called once in the background at app start."""

    async def close(self) -> None:
        """Release what start() acquired."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """True once stream() can serve requests."""

    @property
    def load_error(self) -> str | None:
        """Why start() failed, if it did."""
        return None

    # -- models -------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def model_ids(self) -> list[str]:
        """The model ids this backend serves; the first is the default."""

    @property
    def default_model(self) -> str:
        return self.model_ids[0]

    def resolve_model(self, model: str | None) -> str:
        """The model id to use for `model` (None: the default); raises UnknownModel."""
        if model is None or model == "":
            return self.default_model
        if model not in self.model_ids:
            raise UnknownModel(model, self.model_ids)
        return model

    @property
    @abc.abstractmethod
    def context_window(self) -> int:
        """Tokens of prompt plus answer one request may use."""

    @property
    def kv_pool_tokens(self) -> int | None:
        """Tokens the whole KV pool holds, where the backend knows (a request needing more can never run)."""
        return None

    # -- tokens -------------------------------------------------------------------
    @property
    def tokenizer(self) -> object | None:
        """The tokenizer, where the backend has one locally (None for a remote server)."""
        return None

    @abc.abstractmethod
    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes as message content (no template, no special tokens)."""

    def takes_images(self, model: str | None = None) -> bool:
        """Whether `model` (None: the default) reads images in chat messages (serving/images.py)."""
        return False

    @abc.abstractmethod
    def count_prompt_tokens(self, messages: list[dict]) -> int:
        """Tokens the rendered chat prompt for `messages` takes, generation prompt included."""

    # -- generation -----------------------------------------------------------------
    @abc.abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Yield deltas as tokens arrive; the last has finished=True.
        Raises BadGenerationRequest, BackendNotReady or BackendError. Closing or cancelling
        the iterator aborts the request and frees its resources."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a running request now; its stream ends with finish_reason 'abort'."""

    async def complete(self, request: GenerationRequest) -> Delta:
        """Run a request (of one choice) to its end; the returned delta carries the whole text."""
        parts: list[str] = []
        last = Delta("")
        async for delta in self.stream(request):
            parts.append(delta.text)
            last = delta
        return Delta("".join(parts), True, last.finish_reason, last.prompt_tokens,
                     last.completion_tokens, last.cached_tokens)

    # -- embeddings -------------------------------------------------------------------
    def embedding_tokens(self, inputs: list[EmbedInput], model: str | None = None) -> int:
        """Tokens the inputs take when embedded (exact with a local tokenizer, else an estimate)."""
        return sum(len(x) if isinstance(x, list) else self.count_tokens(x) for x in inputs)

    def embedding_size(self, model: str | None = None) -> int | None:
        """Components of the model's embeddings, where known before asking (None: unknown)."""
        return None

    async def embed(self, inputs: list[EmbedInput], model: str | None = None) -> Embeddings:
        """Each input's pooled, L2-normalized hidden state. Raises BadGenerationRequest where the
        backend does not serve embeddings, BackendNotReady or BackendError as stream() does."""
        raise BadGenerationRequest(f"model {self.resolve_model(model)!r} does not serve embeddings",
                                   "embeddings_unsupported", "model")

    def hold_kv(self, request_id: str, tools: list[str], policy: str, timeout_s: float) -> None:
        """The round `request_id` (sent with keep_kv) ended in calls to `tools`: hold its KV cache for the
        resume or evict it, as `policy` (hold | evict | auto) says. A backend that keeps nothing ignores it."""

    def release_kv(self, request_id: str) -> None:
        """Free the KV cache kept for the round `request_id` (no resume is coming)."""

    def hold_background(self, held: bool) -> None:
        """While held, background (batch) generations sit out the engine's steps; the gateway holds them
        while an interactive request is on its way to its first output. A backend whose engine is out of
        this process ignores it."""

    def stats(self) -> BackendStats:
        """Load figures for health pages and routing (KV usage, queue lengths)."""
        return BackendStats(ready=self.ready)

    def has_room(self, prompt_tokens: int) -> bool:
        """Whether a new request of `prompt_tokens` would start at once (free KV blocks, nothing queued
        inside the server). The gateway's admission queue holds requests back until this is true.
        A backend that cannot tell says yes and lets its own queue absorb the load."""
        return True
