"""A conversation is a tree of messages linked by parent_id; a branch is the path from the root to a leaf."""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from chatloom.store import Message


class Tree:
    def __init__(self, messages: Iterable[Message]) -> None:
        self.by_id: dict[str, Message] = {}
        self.children: dict[str | None, list[Message]] = defaultdict(list)
        for m in sorted(messages, key=lambda m: m.id):  # ids sort by creation
            self.by_id[m.id] = m
            self.children[m.parent_id].append(m)

    def __contains__(self, message_id: object) -> bool:
        return message_id in self.by_id

    def siblings(self, message: Message) -> list[Message]:
        return self.children[message.parent_id]

    def path_to(self, message_id: str) -> list[Message]:
        """Root first, ending at message_id."""
        path = []
        node = self.by_id.get(message_id)
        while node is not None:
            path.append(node)
            node = self.by_id.get(node.parent_id) if node.parent_id else None
        path.reverse()
        return path

    def newest_descendant_leaf(self, message_id: str) -> str:
        """Follow the newest child down to a leaf: the branch a user last worked on below a message."""
        node = self.by_id[message_id]
        while self.children.get(node.id):
            node = self.children[node.id][-1]
        return node.id

    def default_leaf(self, current_leaf_id: str | None) -> str | None:
        if current_leaf_id in self.by_id:
            return self.newest_descendant_leaf(current_leaf_id)
        if not self.by_id:
            return None
        return self.newest_descendant_leaf(max(self.by_id))

    def branch(self, leaf_id: str | None) -> list[Message]:
        """The active branch through leaf_id (extended down to a leaf)."""
        if leaf_id is None:
            return []
        return self.path_to(self.newest_descendant_leaf(leaf_id))
