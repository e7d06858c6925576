"""Connecting single sign-on to a signed-in password account, through the real OpenID Connect flow
against the loopback provider: the identity is linked to that account (not matched by a typed email),
signing in with it lands there, an identity of another account is refused, and disconnecting is refused
where it would leave the account no way in."""
from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

import httpx

from chatloom.app.core.oidc import LinkTo, OidcClient

from oidc_testing import CLIENT_ID, Person
from test_sso import me, servers, sign_in


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def password_account(gateway, name: str) -> tuple[str, str]:
    r = httpx.post(gateway.url + "/auth/signup", json={"username": name, "password": "correct horse"})
    assert r.status_code == 201, r.text
    return r.json()["token"], r.json()["user"]["id"]


def fragment(response: httpx.Response) -> dict:
    return dict(parse_qsl(urlsplit(response.headers["location"]).fragment))


def connect(gateway, token: str, html: bool = False) -> httpx.Response:
    """'Connect' in the settings of a browser signed in with `token`: the callback's answer."""
    with httpx.Client(base_url=gateway.url, timeout=30) as browser:
        r = browser.post("/auth/sso/connect", headers=bearer(token))
        assert r.status_code == 200 and "chatloom_sso" in browser.cookies, r.text
        back = httpx.get(r.json()["url"])  # the provider signs its person in at once and sends them back
        assert back.status_code == 302, back.text
        return browser.get(back.headers["location"], headers={"Accept": "text/html"} if html else {})


def identities(gateway, token: str) -> list[dict]:
    r = httpx.get(gateway.url + "/auth/sso/identities", headers=bearer(token))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_connected_password_account_is_where_sso_signs_in(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend) as (provider, gateway, app):
        token, uid = password_account(gateway, "grace")
        cid = httpx.post(gateway.url + "/conversations", headers=bearer(token)).json()["id"]
        assert identities(gateway, token) == []

        provider.user = Person("grace-at-idp", "Grace@Example.com", preferred_username="grace-idp",
                               groups=["staff"])
        done = connect(gateway, token)
        assert done.status_code == 302 and done.headers["location"] == "/#sso_linked=1", done.text
        assert "chatloom_sso" not in done.cookies or not done.cookies["chatloom_sso"]
        [linked] = identities(gateway, token)
        assert linked["issuer"] == provider.issuer and linked["email"] == "grace@example.com"
        assert me(gateway, token)["tier"] == "pro"  # the role claim applies at connect as at sign-in

        # Signing in with the identity lands in the password account, with its conversation.
        r, sso_token = sign_in(gateway)
        assert sso_token, r.url
        assert me(gateway, sso_token)["id"] == uid
        listed = httpx.get(gateway.url + "/conversations", headers=bearer(sso_token)).json()
        assert cid in [c["id"] for c in (listed["data"] if isinstance(listed, dict) else listed)]

        # Connecting it again is harmless; a password login still works.
        assert connect(gateway, token).headers["location"] == "/#sso_linked=1"
        assert len(identities(gateway, token)) == 1
        assert httpx.post(gateway.url + "/auth/login",
                          json={"username": "grace", "password": "correct horse"}).status_code == 200

        # Disconnected: the password remains, and the identity (whose email went with it) no longer
        # signs in here.
        r = httpx.delete(gateway.url + f"/auth/sso/identities/{linked['id']}", headers=bearer(token))
        assert r.status_code == 204, r.text
        assert identities(gateway, token) == []
        _, other = sign_in(gateway)
        assert me(gateway, other)["id"] != uid


def test_an_identity_of_another_account_is_refused(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend) as (provider, gateway, app):
        provider.user = Person("heidi-at-idp", "heidi@example.com", preferred_username="heidi")
        _, heidi = sign_in(gateway)  # an account of its own, made by single sign-on
        token, uid = password_account(gateway, "ivan")

        r = connect(gateway, token)
        assert r.status_code == 409 and r.json()["error"]["code"] == "sso_identity_taken", r.text
        assert "already linked to another account" in r.json()["error"]["message"]
        assert identities(gateway, token) == [] and len(identities(gateway, heidi)) == 1
        # A browser goes back to the app (still signed in) with the reason.
        page = connect(gateway, token, html=True)
        assert page.status_code == 302
        assert "already linked to another account" in fragment(page)["sso_link_error"]
        _, again = sign_in(gateway)
        assert me(gateway, again)["id"] == me(gateway, heidi)["id"] != uid

        # The account made by single sign-on has no password: its only identity cannot go.
        [only] = identities(gateway, heidi)
        r = httpx.delete(gateway.url + f"/auth/sso/identities/{only['id']}", headers=bearer(heidi))
        assert r.status_code == 409 and r.json()["error"]["code"] == "sso_last_sign_in"
        assert "no way to sign in" in r.json()["error"]["message"] and "no password" in r.json()["error"]["message"]
        # Nor can another account's identity be touched.
        r = httpx.delete(gateway.url + f"/auth/sso/identities/{only['id']}", headers=bearer(token))
        assert r.status_code == 404
        assert len(identities(gateway, heidi)) == 1


def test_sso_only_servers_keep_the_last_identity(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend) as (provider, gateway, app):
        token, uid = password_account(gateway, "judy")
        provider.user = Person("judy-at-idp", "judy@example.com")
        assert connect(gateway, token).headers["location"] == "/#sso_linked=1"
        [linked] = identities(gateway, token)
        app.state.ctx.settings.sso.local_login = False  # the admin turns passwords off
        r = httpx.delete(gateway.url + f"/auth/sso/identities/{linked['id']}", headers=bearer(token))
        assert r.status_code == 409 and "sso.local_login = false" in r.json()["error"]["message"], r.text
        assert len(identities(gateway, token)) == 1


def test_forged_expired_or_stale_connect_states_link_nothing(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend) as (provider, gateway, app):
        token, uid = password_account(gateway, "mallory")
        victim, victim_id = password_account(gateway, "victor")
        provider.user = Person("mallory-at-idp", "mallory@example.com")
        settings = app.state.ctx.settings

        def state_for(secret: str, ttl: int, link_to: LinkTo) -> tuple[str, str]:
            import asyncio
            client = OidcClient(provider.issuer, CLIENT_ID, None, "openid email", secret, ttl)
            sign = asyncio.run(client.begin(gateway.url + "/auth/sso/callback", link_to))
            return sign.url, sign.state_cookie

        def finish(url: str, cookie: str) -> httpx.Response:
            with httpx.Client(base_url=gateway.url, timeout=30) as browser:
                browser.cookies.set("chatloom_sso", cookie, path="/auth/sso")
                back = httpx.get(url)
                return browser.get(back.headers["location"])

        # A state cookie naming the victim's account, signed with a key other than the server's: refused.
        r = finish(*state_for("not-the-server-secret-0123456789abcdef", 600, LinkTo(victim_id, 0)))
        assert r.status_code == 400 and "not valid" in r.json()["error"]["message"], r.text
        # Signed by the server but expired: refused.
        r = finish(*state_for(settings.secret(), -120, LinkTo(uid, 0)))
        assert r.status_code == 400 and "too long" in r.json()["error"]["message"], r.text
        # Begun, then the account signed out everywhere before coming back: refused.
        with httpx.Client(base_url=gateway.url, timeout=30) as browser:
            url = browser.post("/auth/sso/connect", headers=bearer(token)).json()["url"]
            assert httpx.post(gateway.url + "/auth/revoke-all", headers=bearer(token)).status_code == 204
            r = browser.get(httpx.get(url).headers["location"])
        assert r.status_code == 400 and "signed out" in r.json()["error"]["message"], r.text
        assert identities(gateway, victim) == []
        # An API key may not add a way into its account.
        key = httpx.post(gateway.url + "/auth/api-keys", headers=bearer(victim), json={}).json()["key"]
        r = httpx.post(gateway.url + "/auth/sso/connect", headers=bearer(key))
        assert r.status_code == 403 and r.json()["error"]["code"] == "session_required"


def test_connecting_needs_sso_and_a_sign_in(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend, enabled=False) as (provider, gateway, app):
        token, _ = password_account(gateway, "nina")
        assert httpx.post(gateway.url + "/auth/sso/connect").status_code == 401
        r = httpx.post(gateway.url + "/auth/sso/connect", headers=bearer(token))
        assert r.status_code == 404 and r.json()["error"]["code"] == "sso_disabled"
        assert identities(gateway, token) == []
