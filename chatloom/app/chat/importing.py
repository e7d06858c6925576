"""Import: chatloom's own export (exporting.py) or ChatGPT's data export (conversations.json), each
conversation's tree kept with its roles and timestamps. A file is checked whole before anything is
stored; a file that is not what it claims is refused with the first problem found, and the import
is one transaction, so a failure stores nothing."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.exporting import EXPORT_FORMAT, EXPORT_VERSION
from chatloom.app.core.errors import ApiError
from chatloom.app.files.extract import binary_kind
from chatloom.store import Conversation, Message, new_id

ROLES = ("user", "assistant")
TITLE_CHARS = 200
# What no database column can hold: lone surrogates (not UTF-8) and NUL (PostgreSQL text refuses it).
_UNSTORABLE = re.compile("[\ud800-\udfff\x00]")


def clean(text: str) -> str:
    """The text as it can be stored; other control characters stay, as they do in answers."""
    return _UNSTORABLE.sub("\ufffd", text)


@dataclass
class Node:
    key: str  # its id in the file
    parent: str | None
    role: str
    text: str
    created: datetime
    model: str | None = None
    tokens: int = 0  # filled in by count_tokens before storing

    def __post_init__(self) -> None:  # what neither the tokenizer nor a column takes is replaced at once
        self.text = clean(self.text)
        self.model = clean(self.model)[:200] if self.model else None


@dataclass
class Imported:
    title: str
    created: datetime
    updated: datetime
    nodes: list[Node] = field(default_factory=list)  # parents before children, siblings oldest first
    current: str | None = None  # the key of the node the conversation was left at

    def __post_init__(self) -> None:
        self.title = clean(self.title)


def refuse(problem: str) -> ApiError:
    return ApiError(400, f"not an import file this server reads: {problem}", "invalid_import", "file")


def parse(raw: bytes, max_messages: int) -> tuple[str, list[Imported]]:
    """(the format found: chatloom | chatgpt, its conversations)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        what = binary_kind(raw)
        if what == "a ZIP archive":  # most likely ChatGPT's data export as downloaded
            what += " (ChatGPT's data export is one: import the conversations.json inside it)"
        raise refuse(f"the file is {what}, not JSON" if what else f"the file is not JSON ({exc})") from None
    if isinstance(data, dict) and data.get("format") == EXPORT_FORMAT:
        found, convs = "chatloom", _ours(data)
    elif isinstance(data, list) and all(isinstance(c, dict) and "mapping" in c for c in data):
        found, convs = "chatgpt", [_chatgpt(c, f"conversations[{i}]") for i, c in enumerate(data)]
    else:
        raise refuse("expected chatloom's export (an object with \"format\": \"chatloom.conversations\") or "
                     "ChatGPT's conversations.json (a list of conversations, each with a \"mapping\")")
    if not convs:
        raise refuse("the file holds no conversations")
    total = sum(len(c.nodes) for c in convs)
    if total > max_messages:
        raise ApiError(413, f"the file holds {total} messages; at most {max_messages} are imported at once",
                       "import_too_large", "file")
    return found, convs


# -- checking values -------------------------------------------------------------------------------

KIND_NAMES = {str: "a string", list: "a list", dict: "an object", int: "a number", float: "a number"}


def _get(obj: Any, key: str, where: str, kind: type | tuple, optional: bool = False) -> Any:
    if not isinstance(obj, dict):
        raise refuse(f"{where} must be an object")
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise refuse(f"{where}.{key} must be {' or '.join(KIND_NAMES.get(k, k.__name__) for k in kinds)}")
    return value


def _iso_time(value: Any, where: str) -> datetime:
    if not isinstance(value, str):
        raise refuse(f"{where} must be an ISO 8601 time")
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise refuse(f"{where} is not an ISO 8601 time: {value[:40]!r}") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _unix_time(value: Any, where: str, default: datetime) -> datetime:
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise refuse(f"{where} must be a Unix time in seconds")
    try:
        return datetime.fromtimestamp(value, timezone.utc)
    except (OverflowError, OSError, ValueError):
        raise refuse(f"{where} is out of range: {value}") from None


def _ordered(nodes: dict[str, Node], where: str) -> list[Node]:
    """Parents before children (siblings oldest first); refuses missing parents and cycles."""
    children: dict[str | None, list[Node]] = {}
    for node in nodes.values():
        if node.parent is not None and node.parent not in nodes:
            raise refuse(f"{where}: the parent {node.parent!r} of message {node.key!r} is not in the conversation")
        children.setdefault(node.parent, []).append(node)
    out: list[Node] = []
    stack = sorted(children.get(None, []), key=lambda n: n.created, reverse=True)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(sorted(children.get(node.key, []), key=lambda n: n.created, reverse=True))
    if len(out) != len(nodes):
        raise refuse(f"{where}: its messages' parents form a cycle")
    return out


# -- chatloom's own format -------------------------------------------------------------------------

def _ours(data: dict) -> list[Imported]:
    if data.get("version") != EXPORT_VERSION:
        raise refuse(f"version {data.get('version')!r} of chatloom's export is not known (this server reads "
                     f"version {EXPORT_VERSION})")
    out = []
    for i, conv in enumerate(_get(data, "conversations", "the file", list)):
        where = f"conversations[{i}]"
        title = _get(conv, "title", where, str, optional=True) or "Imported chat"
        created = _iso_time(_get(conv, "created", where, str), f"{where}.created")
        updated = _iso_time(conv.get("updated") or conv["created"], f"{where}.updated")
        nodes: dict[str, Node] = {}
        for j, m in enumerate(_get(conv, "messages", where, list)):
            here = f"{where}.messages[{j}]"
            key = _get(m, "id", here, str)
            if key in nodes:
                raise refuse(f"{here}.id {key!r} appears twice")
            role = _get(m, "role", here, str)
            if role not in ROLES:
                raise refuse(f"{here}.role must be user or assistant, not {role[:20]!r}")
            nodes[key] = Node(key, _get(m, "parent_id", here, str, optional=True), role, _get(m, "text", here, str),
                              _iso_time(m.get("created"), f"{here}.created"),
                              _get(m, "model", here, str, optional=True))
        current = _get(conv, "current_leaf_id", where, str, optional=True)
        out.append(Imported(title[:TITLE_CHARS], created, updated, _ordered(nodes, where),
                            current if current in nodes else None))
    return out


# -- ChatGPT's conversations.json ------------------------------------------------------------------

def _text_of(message: dict, where: str) -> str:
    content = _get(message, "content", where, dict)
    parts = content.get("parts")
    if parts is None:  # code, execution output...: their text, when they carry one
        return content.get("text") if isinstance(content.get("text"), str) else ""
    if not isinstance(parts, list):
        raise refuse(f"{where}.content.parts must be a list")
    # Strings are the text; objects are attachments (images, files), which are not imported.
    return "\n".join(p for p in parts if isinstance(p, str))


def _chatgpt(conv: dict, where: str) -> Imported:
    mapping = _get(conv, "mapping", where, dict)
    created = _unix_time(conv.get("create_time"), f"{where}.create_time", datetime.now(timezone.utc))
    updated = _unix_time(conv.get("update_time"), f"{where}.update_time", created)
    raw: dict[str, tuple[str | None, dict | None]] = {}
    for key, node in mapping.items():
        here = f"{where}.mapping[{key!r}]"
        parent = _get(node, "parent", here, str, optional=True)
        message = node.get("message")
        if message is not None and not isinstance(message, dict):
            raise refuse(f"{here}.message must be an object or null")
        raw[key] = (parent, message)
    for key, (parent, _) in raw.items():
        if parent is not None and parent not in raw:
            raise refuse(f"{where}: the parent {parent!r} of node {key!r} is not in the mapping")

    kept: dict[str, Node] = {}

    def nearest_kept(key: str | None) -> str | None:
        # System, tool and empty nodes are left out; their children hang from the nearest kept ancestor.
        seen = 0
        while key is not None and key not in kept:
            key = raw[key][0]
            seen += 1
            if seen > len(raw):
                raise refuse(f"{where}: the mapping's parents form a cycle")
        return key

    # Walk parents first, so each node's nearest kept ancestor is known when it is reached.
    order = _ordered({k: Node(k, p, "", "", created) for k, (p, _) in raw.items()}, where)
    for stub in order:
        parent, message = raw[stub.key]
        if message is None:
            continue
        here = f"{where}.mapping[{stub.key!r}].message"
        author = _get(message, "author", here, dict)
        role = _get(author, "role", f"{here}.author", str)
        text = _text_of(message, here)
        if role not in ROLES or not text.strip():
            continue
        meta = message.get("metadata") if isinstance(message.get("metadata"), dict) else {}
        model = meta.get("model_slug") if isinstance(meta.get("model_slug"), str) else None
        kept[stub.key] = Node(stub.key, nearest_kept(parent), role, text,
                              _unix_time(message.get("create_time"), f"{here}.create_time", created), model)
    current = conv.get("current_node")
    title = conv.get("title") if isinstance(conv.get("title"), str) and conv.get("title") else "Imported chat"
    return Imported(title[:TITLE_CHARS], created, updated, _ordered(kept, where),
                    nearest_kept(current) if isinstance(current, str) and current in raw else None)


# -- storing ----------------------------------------------------------------------------------------

def count_tokens(convs: list[Imported], count: Callable[[str], int]) -> None:
    """Each message's token count, which prompt assembly needs (slow for a large file: run it off the loop)."""
    for imp in convs:
        for node in imp.nodes:
            node.tokens = count(node.text)


async def store(session: AsyncSession, user_id: str, convs: list[Imported]) -> list[str]:
    """Add the conversations under new ids (the caller commits once: all or nothing). Returns their ids."""
    ids = []
    for imp in convs:
        conv = Conversation(id=new_id("conv"), user_id=user_id, title=imp.title, created=imp.created,
                            updated=imp.updated)
        session.add(conv)
        new_ids: dict[str, str] = {}
        rows = []
        for node in imp.nodes:  # in order, so new ids sort as the file's siblings did
            new_ids[node.key] = new_id("msg")
            rows.append(Message(id=new_ids[node.key], conversation_id=conv.id,
                                parent_id=new_ids[node.parent] if node.parent else None, role=node.role,
                                text=node.text, tokens=node.tokens, model=node.model,
                                status="complete", created=node.created))
        conv.current_leaf_id = new_ids.get(imp.current) if imp.current else (rows[-1].id if rows else None)
        await session.flush()  # the conversation row before its messages
        session.add_all(rows)
        await session.flush()
        ids.append(conv.id)
    return ids
