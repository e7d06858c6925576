"""GET /conversations?q=: the caller's titles and messages on every branch, ranked, with safe snippets."""
from __future__ import annotations

from app_testing import done_of, new_conversation, send, signup


async def _search(client, headers, q: str) -> list[dict]:
    r = await client.get("/conversations", headers=headers, params={"q": q})
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_word_in_the_third_message_finds_its_conversation(client, alice):
    old = await new_conversation(client, alice, title="Groceries")
    await send(client, alice, old, "We need milk and eggs.")
    _, events = await send(client, alice, old, "Also the <b>marmalade</b> from the corner shop & <i>more</i>.")
    done_of(events)
    other = await new_conversation(client, alice, title="Holiday plans")
    await send(client, alice, other, "Trains to Lisbon in May.")
    hits = await _search(client, alice, "marmalade")
    assert [h["id"] for h in hits] == [old]
    assert "<mark>marmalade</mark>" in hits[0]["snippet"]
    # The message's own markup never comes back as markup (escaped; PostgreSQL's headline drops tags).
    assert "<" not in hits[0]["snippet"].replace("<mark>", "").replace("</mark>", "")
    assert hits[0]["message_id"] is not None and hits[0]["title"] == "Groceries"
    # Every word must match; the last may be a prefix of a word (results follow typing).
    assert [h["id"] for h in await _search(client, alice, "corner marma")] == [old]
    assert await _search(client, alice, "marmalade lisbon") == []
    # Stemmed: "trains" matches "train".
    assert [h["id"] for h in await _search(client, alice, "train")] == [other]
    # Without q: the plain list, newest first, no snippets.
    plain = (await client.get("/conversations", headers=alice)).json()
    assert [c["id"] for c in plain] == [other, old] and "snippet" not in plain[0]


async def test_titles_rank_first_and_renames_are_searched(client, alice):
    body = await new_conversation(client, alice)
    await send(client, alice, body, "I keep a note about the lighthouse here.")
    titled = await new_conversation(client, alice, title="Lighthouse restoration")
    hits = await _search(client, alice, "lighthouse")
    assert [h["id"] for h in hits] == [titled, body] and hits[0]["message_id"] is None
    assert (await client.patch(f"/conversations/{titled}", headers=alice, json={"title": "Boats"})).status_code == 200
    assert [h["id"] for h in await _search(client, alice, "lighthouse")] == [body]
    assert [h["id"] for h in await _search(client, alice, "boats")] == [titled]


async def test_every_branch_is_searched_and_deleted_conversations_are_gone(client, alice):
    cid = await new_conversation(client, alice)
    _, events = await send(client, alice, cid, "first question about pelicans")
    root = done_of(events)
    # An edit: a sibling of the first message; the pelican branch is no longer the active one.
    r = await client.post(f"/conversations/{cid}/messages", headers=alice,
                          json={"text": "first question about flamingos", "parent_id": None})
    assert r.status_code == 200 and root["user_message_id"]
    assert [h["id"] for h in await _search(client, alice, "pelicans")] == [cid]
    assert [h["id"] for h in await _search(client, alice, "flamingos")] == [cid]
    assert (await client.delete(f"/conversations/{cid}", headers=alice)).status_code == 204
    assert await _search(client, alice, "pelicans") == []


async def test_never_another_users_conversations(client, alice):
    bob = await signup(client, "bob")
    mine = await new_conversation(client, alice, title="Secret walrus plans")
    await send(client, alice, mine, "the walrus meets at noon")
    theirs = await new_conversation(client, bob)
    await send(client, bob, theirs, "a walrus of my own")
    assert [h["id"] for h in await _search(client, bob, "walrus")] == [theirs]
    assert [h["id"] for h in await _search(client, alice, "walrus")] == [mine]
    assert await _search(client, bob, "secret") == []
    # Query syntax is never passed through: operators and quotes are just words.
    assert await _search(client, alice, 'walrus" OR "x') == []
    assert await _search(client, alice, "* ( ) NEAR") == []


def test_snippets_are_escaped_around_the_marks():
    from chatloom.app.chat.search import snippet_html

    assert snippet_html("a <b>\ue000word\ue001</b> & <mark>x</mark>") == \
        "a &lt;b&gt;<mark>word</mark>&lt;/b&gt; &amp; x"
