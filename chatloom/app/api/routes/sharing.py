"""Shared links: make one for a conversation, list and revoke one's own, and read one without an
account (GET /shared/{token} as JSON, /s/{token} as a page of the browser app)."""
from __future__ import annotations

from fastapi import APIRouter, Path, Response
from fastapi.responses import FileResponse

from chatloom.app.api.account_schemas import SharedConversation, ShareIn, ShareOut
from chatloom.app.api.deps import CurrentUser, OwnedConversation, SessionDep
from chatloom.app.api.openapi_responses import OWN_CONVERSATION, SIGNED_IN, errors
from chatloom.app.api.routes.web import WEB_DIR, page
from chatloom.app.chat import sharing
from chatloom.app.core.errors import not_found

router = APIRouter(tags=["sharing"])

Token = Path(min_length=1, max_length=64)


@router.post("/conversations/{conversation_id}/shares", status_code=201, response_model=ShareOut,
             responses=OWN_CONVERSATION | errors(400))
async def share_conversation(conv: OwnedConversation, session: SessionDep, body: ShareIn | None = None) -> ShareOut:
    """A read-only link to the conversation as it is now: its active branch, or the branch up to
    `message_id`. What is written later, and every other branch, stays private."""
    link = await sharing.create_link(session, conv, body.message_id if body else None)
    await session.commit()
    return ShareOut.of(link)


@router.get("/shares", response_model=list[ShareOut], responses=SIGNED_IN)
async def list_shares(user: CurrentUser, session: SessionDep) -> list[ShareOut]:
    """The caller's shared links, newest first."""
    return [ShareOut.of(link) for link in await sharing.links_of(session, user.id)]


@router.delete("/shares/{share_id}", status_code=204, responses=errors(401, 404))
async def revoke_share(share_id: str, user: CurrentUser, session: SessionDep) -> Response:
    """Revoke a link: it stops working at once."""
    if not await sharing.revoke(session, user.id, share_id):
        raise not_found("shared link")
    await session.commit()
    return Response(status_code=204)


@router.get("/shared/{token}", response_model=SharedConversation, responses=errors(404))
async def read_shared(session: SessionDep, token: str = Token) -> SharedConversation:
    """A shared conversation, for anyone holding its link (no account needed)."""
    link = await sharing.by_token(session, token)
    if link is None:
        raise not_found("shared conversation")
    return SharedConversation.of(link)


@router.get("/s/{token}", include_in_schema=False)
async def shared_page(token: str = Token) -> FileResponse:
    # The page reads GET /shared/{token} itself; a revoked or unknown token shows its error there.
    return page(WEB_DIR / "shared.html")
