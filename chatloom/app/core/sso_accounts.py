"""The account a verified single sign-on identity signs in to: the one already linked to it, else the
one whose email it verifiably owns (linked now, not duplicated), else a new one; then the provider's
role claim sets admin and tier, at every sign-in.

A signed-in account can also connect an identity to itself (`connect`), which is how a password
account gets single sign-on without matching on an email the user typed; the role claim applies there
as at a sign-in, since the identity speaks for the account from then on. `disconnect` removes one,
unless the account would be left with no way to sign in."""
from __future__ import annotations

import re
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError, not_found
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


async def connect(session: AsyncSession, user: User, who: Identity, sso: SsoSettings) -> IdentityRow:
    """Link the identity to `user` (already linked to it: refreshed); flushed, not committed. An identity
    linked to another account is refused (409) and nothing changes."""
    link = await session.scalar(select(IdentityRow).where(IdentityRow.issuer == who.issuer,
                                                          IdentityRow.subject == who.subject))
    if link is not None and link.user_id != user.id:
        raise _taken()
    if link is None:
        link = IdentityRow(user_id=user.id, issuer=who.issuer, subject=who.subject)
        session.add(link)
    link.email = who.email
    if user.email is None:  # the provider's verified email, so later sign-ins by email find this account
        user.email = await _unclaimed(session, who)
    _map_roles(user, who, sso)
    try:
        await session.flush()
    except IntegrityError:  # another account linked it (or took the email) in the meantime
        raise _taken() from None
    return link


def _taken() -> ApiError:
    return ApiError(409, "this single sign-on identity is already linked to another account on this server; "
                    "sign in with it to use that account, or disconnect it there first", "sso_identity_taken")


async def linked(session: AsyncSession, user_id: str) -> list[IdentityRow]:
    return list(await session.scalars(select(IdentityRow).where(IdentityRow.user_id == user_id)
                                      .order_by(IdentityRow.created, IdentityRow.id)))


async def disconnect(session: AsyncSession, user: User, identity_id: str, sso: SsoSettings) -> IdentityRow:
    """Unlink one of the account's identities; flushed, not committed. Refused (409) where the account
    would be left with no way to sign in."""
    rows = await linked(session, user.id)
    row = next((r for r in rows if r.id == identity_id), None)
    if row is None:
        raise not_found("linked identity")
    rest = [r for r in rows if r.id != identity_id]
    passwords_on = not (sso.enabled and not sso.local_login)
    sso_on = bool(sso.enabled and sso.issuer and sso.client_id)
    if not ((user.password_hash and passwords_on) or (rest and sso_on)):
        why = ["password sign-in is turned off on this server (sso.local_login = false)" if user.password_hash
               else "the account has no password"]
        why.append("single sign-on is not set up on this server" if rest else "this is its only linked identity")
        raise ApiError(409, "disconnecting this identity would leave the account with no way to sign in: "
                       + " and ".join(why), "sso_last_sign_in")
    await session.delete(row)
    # An email only an identity vouched for goes with it, so that sign-in by email does not link it again.
    if user.email and user.email == row.email and not any(r.email == user.email for r in rest):
        user.email = None
    await session.flush()
    return row


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
