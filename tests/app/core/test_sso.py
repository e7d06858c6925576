"""Single sign-on through a real OpenID Connect flow: a provider built with authlib's server side runs on
loopback, and a browser-like client follows the redirects from /auth/sso/login to the provider and back."""
from __future__ import annotations

from contextlib import contextmanager

import httpx
import pytest

from chatloom.app.main import create_app

from app_testing import LiveServer, make_settings
from oidc_testing import CLIENT_ID, CLIENT_SECRET, Client, Person, Provider


@contextmanager
def servers(tmp_path, tiny_backend, **sso):
    provider = Provider()
    with LiveServer(provider.app()) as idp:
        provider.issuer = idp.url
        settings = make_settings(tmp_path, sso={"enabled": True, "issuer": idp.url, "client_id": CLIENT_ID,
                                                "client_secret": CLIENT_SECRET, "scopes": "openid email profile groups",
                                                "role_claim": "groups", "admin_values": ["admins"],
                                                "tier_values": {"staff": "pro"}, **sso})
        app = create_app(settings, tiny_backend)
        with LiveServer(app) as gateway:
            provider.client = Client(CLIENT_ID, CLIENT_SECRET, gateway.url + "/auth/sso/callback")
            yield provider, gateway, app


def sign_in(gateway) -> tuple[httpx.Response, str | None]:
    """Click 'Sign in with SSO' in a fresh browser: the session token the app lands with."""
    with httpx.Client(base_url=gateway.url, follow_redirects=True, timeout=30) as browser:
        r = browser.get("/auth/sso/login")
        fragment = dict(p.split("=", 1) for p in r.url.fragment.split("&") if "=" in p)
        return r, fragment.get("sso_token")


def me(gateway, token: str) -> dict:
    r = httpx.get(gateway.url + "/auth/me", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_sign_in_lands_as_the_mapped_tier_and_links_by_email(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend) as (provider, gateway, app):
        info = httpx.get(gateway.url + "/auth/sso").json()
        assert info == {"enabled": True, "label": "Sign in with SSO", "local_login": True}

        provider.user = Person("person-1", "Carol@Example.com", groups=["staff"])
        r, token = sign_in(gateway)
        assert r.status_code == 200 and r.url.path == "/" and token, (r.status_code, r.url, r.text)
        assert [h.status_code for h in r.history] == [302, 302, 302]
        assert provider.token_requests == 1
        first = me(gateway, token)
        assert first["tier"] == "pro" and not first["is_admin"] and first["username"] == "carol"

        # The same person again: the same account; the claim now makes them an admin.
        provider.user = Person("person-1", "carol@example.com", groups=["staff", "admins"])
        _, token = sign_in(gateway)
        again = me(gateway, token)
        assert again["id"] == first["id"] and again["is_admin"]

        # Another identity (a second subject) with the same verified email: linked, not duplicated.
        provider.user = Person("person-1-other-login", "carol@example.com")
        _, token = sign_in(gateway)
        assert me(gateway, token)["id"] == first["id"]

        # An unverified email is not trusted to link: a new account.
        provider.user = Person("person-2", "carol@example.com", email_verified=False)
        _, token = sign_in(gateway)
        assert me(gateway, token)["id"] != first["id"]

        # Local accounts stay available.
        assert httpx.post(gateway.url + "/auth/signup",
                          json={"username": "dave", "password": "correct horse"}).status_code == 201


def test_a_forged_or_replayed_callback_signs_no_one_in(tmp_path, tiny_backend):
    with servers(tmp_path, tiny_backend, local_login=False) as (provider, gateway, app):
        assert httpx.get(gateway.url + "/auth/sso").json()["local_login"] is False
        r = httpx.post(gateway.url + "/auth/login", json={"username": "x", "password": "y"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "sso_only"

        with httpx.Client(base_url=gateway.url, timeout=30) as browser:
            to_provider = browser.get("/auth/sso/login")
            assert to_provider.status_code == 302
            location = to_provider.headers["location"]
            assert "code_challenge=" in location and "code_challenge_method=S256" in location and "nonce=" in location
            back = httpx.get(location)  # the provider sends the browser back with a code
            callback = back.headers["location"].removeprefix(gateway.url)
            # Without this browser's cookie (another browser, a forged link): refused, and the code unused.
            stolen = httpx.get(gateway.url + callback)
            assert stolen.status_code == 400 and "cookie is missing" in stolen.json()["error"]["message"]
            # A wrong state with the right cookie: refused.
            wrong = browser.get(callback.replace("state=", "state=x"))
            assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "sso_failed"
            ok = browser.get(callback)
            assert ok.status_code == 302 and ok.headers["location"].startswith("/#sso_token=")
            # The code works once.
            replay = browser.get(callback)
            assert replay.status_code == 400
        r = httpx.get(gateway.url + "/auth/sso/callback", params={"error": "access_denied"})
        assert r.status_code == 400 and "access_denied" in r.json()["error"]["message"]
        assert httpx.get(gateway.url + "/auth/sso/callback").status_code == 400
        # A browser's page load goes back to the login screen with the reason instead of a page of JSON.
        page = httpx.get(gateway.url + "/auth/sso/callback", params={"error": "access_denied"},
                         headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        assert page.status_code == 302
        assert page.headers["location"] == "/#sso_error=single+sign-on+failed%3A+the+provider+said+access_denied"


@pytest.mark.parametrize("create_users", [False])
def test_unknown_people_are_refused_when_accounts_are_not_created(tmp_path, tiny_backend, create_users):
    with servers(tmp_path, tiny_backend, create_users=create_users) as (provider, gateway, app):
        with httpx.Client(base_url=gateway.url, follow_redirects=True, timeout=30) as browser:
            r = browser.get("/auth/sso/login")
        assert r.status_code == 403 and r.json()["error"]["code"] == "sso_no_account"


async def test_sso_is_404_when_not_set_up(client):
    assert (await client.get("/auth/sso")).json() == {"enabled": False, "label": None, "local_login": True}
    r = await client.get("/auth/sso/login")
    assert r.status_code == 404 and r.json()["error"]["code"] == "sso_disabled"
    assert (await client.get("/auth/sso/callback", params={"code": "c", "state": "s"})).status_code == 404


def test_a_provider_out_of_reach_is_502_or_the_login_screen_with_the_reason(tmp_path, tiny_backend):
    from app_testing import free_port

    with servers(tmp_path, tiny_backend, issuer=f"http://127.0.0.1:{free_port()}") as (provider, gateway, app):
        r = httpx.get(gateway.url + "/auth/sso/login")
        assert r.status_code == 502 and r.json()["error"]["code"] == "sso_provider_error", r.text
        page = httpx.get(gateway.url + "/auth/sso/login", headers={"Accept": "text/html"})
        assert page.status_code == 302 and page.headers["location"].startswith("/#sso_error=")
        assert "chatloom_sso" not in page.cookies
