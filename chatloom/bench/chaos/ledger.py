"""What the chaos run saw, kept for the checks at the end: every HTTP answer's status, every
acknowledged message, every answer's events as the clients received them, every fault's window.

Times are seconds on the run's monotonic clock (time.monotonic()).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Reply:
    """One HTTP answer (or a transport failure, status 0) a client got."""

    t: float
    gateway: str
    route: str
    status: int
    retry_after: str | None = None
    code: str | None = None
    error: str | None = None  # status 0: the exception's class


@dataclass
class Answer:
    """One conversation answer followed by a client: its events in the order received, over every
    connection it took (the first POST, then each resume with Last-Event-ID)."""

    user: str
    conversation_id: str
    message_id: str
    user_message_id: str
    text_sent: str
    max_tokens: int = 0
    events: list[tuple[int, dict]] = field(default_factory=list)
    end: dict | None = None  # the done (or error) event's data
    connections: int = 1
    cut: bool = False  # the client dropped its connection on purpose mid-stream
    stop_sent: bool = False
    lost: bool = False  # a resume found no stream left (its log gone): the stored answer is what counts
    end_lost: bool = False  # lost so: its log ends, but the events up to its end were lost with Redis's data
    found_after_lost_reply: bool = False  # its POST broke before the reply; the client found it stored

    @property
    def streamed_text(self) -> str:
        return "".join(data.get("token", "") for _, data in self.events)


@dataclass
class Submission:
    """A conversation message whose POST broke after it may have reached a gateway, and whose fate the
    client could not learn (no gateway could show the conversation): stored and answered, or not."""

    user: str
    conversation_id: str
    text: str
    max_tokens: int


@dataclass
class OpenAICall:
    user: str
    kind: str  # plain | stream | tool
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    complete: bool = False  # the client saw the whole answer and its usage


@dataclass
class Upload:
    user: str
    file_id: str
    size: int


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    end: float | None = None  # when the fault's cause was over (process back, disk freed)
    ready: float | None = None  # when every gateway answered /readyz 200 again after `end`
    note: str = ""


@dataclass
class Ledger:
    replies: list[Reply] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    refused_messages: int = 0
    unknown_submissions: list[Submission] = field(default_factory=list)
    openai: list[OpenAICall] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    users: dict[str, str] = field(default_factory=dict)  # username -> tier
    cuts: int = 0

    def reply(self, t: float, gateway: str, route: str, status: int, headers=None, body: dict | None = None) -> None:
        code = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            code = body["error"].get("code")
        self.replies.append(Reply(t, gateway, route, status, headers.get("retry-after") if headers else None, code))

    def no_reply(self, t: float, gateway: str, route: str, exc: BaseException) -> None:
        self.replies.append(Reply(t, gateway, route, 0, error=type(exc).__name__))
