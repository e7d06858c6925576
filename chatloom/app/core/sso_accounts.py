"""The account a verified single sign-on identity signs in to: the one already linked to it, else the
one whose email it verifiably owns (linked now, not duplicated), else a new one; then the provider's
role claim sets admin and tier, at every sign-in."""
from __future__ import annotations

import re
import secrets

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.app.core.oidc import Identity
from chatloom.settings.tree import SsoSettings
from chatloom.store import Identity as IdentityRow
from chatloom.store import User
from chatloom.store.models import utcnow

USERNAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


async def account_for(session: AsyncSession, who: Identity, sso: SsoSettings) -> User:
    """The account (linked or created, roles mapped); flushed, not committed."""
    link = await session.scalar(select(IdentityRow).where(IdentityRow.issuer == who.issuer,
                                                          IdentityRow.subject == who.subject))
    user = await session.get(User, link.user_id) if link is not None else None
    if user is None and who.email and who.email_verified and sso.link_by_email:
        user = await session.scalar(select(User).where(User.email == who.email))
    if user is None:
        if not sso.create_users:
            raise ApiError(403, "no account here belongs to this identity, and single sign-on does not create "
                           "accounts on this server; ask an admin", "sso_no_account")
        user = User(username=await _free_username(session, who), password_hash=None,
                    email=await _unclaimed(session, who))
        session.add(user)
        await session.flush()
    if link is None:
        link = IdentityRow(user_id=user.id, issuer=who.issuer, subject=who.subject, email=who.email)
        session.add(link)
    link.email, link.last_login = who.email, utcnow()
    _map_roles(user, who, sso)
    await session.flush()
    return user


def _map_roles(user: User, who: Identity, sso: SsoSettings) -> None:
    if not sso.role_claim:
        return
    values = who.values(sso.role_claim)
    if sso.admin_values:
        user.is_admin = any(v in sso.admin_values for v in values)
    tier = next((sso.tier_values[v] for v in values if v in sso.tier_values), None)
    if tier is not None:
        user.tier = tier


async def _unclaimed(session: AsyncSession, who: Identity) -> str | None:
    """The identity's email for the new account, when verified and not another account's."""
    if not who.email or not who.email_verified:
        return None
    taken = await session.scalar(select(User.id).where(User.email == who.email))
    return None if taken else who.email


async def _free_username(session: AsyncSession, who: Identity) -> str:
    """preferred_username, else the email's local part, made a valid username not yet taken."""
    wanted = who.claims.get("preferred_username") or (who.email or "").split("@")[0] or "user"
    base = USERNAME_CHARS.sub("-", str(wanted)).strip("-.")[:24] or "user"
    base = base if len(base) >= 3 else f"{base}-user"
    name = base
    while await session.scalar(select(User.id).where(User.username == name)) is not None:
        name = f"{base}-{secrets.token_hex(3)}"
    return name
