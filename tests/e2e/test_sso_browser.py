"""Single sign-on in Chromium: an OpenID Connect provider built with authlib's server side runs on loopback
(discovery, authorization code with PKCE, an RS256-signed ID token, JWKS); the login screen's button goes
there and back, and the person lands in the app as the tier their group maps to. A wrong state or the
provider's refusal brings the login screen back with the reason. A password account connects the
provider in its settings, and signing in with the provider then opens that same account."""
from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

from app_testing import LiveServer, make_settings
from browser_testing import DESKTOP, sign_up, unique_name, wait_js
from oidc_testing import CLIENT_ID, CLIENT_SECRET, Client, Person, Provider
from scripted_backend import ScriptedBackend
from test_chat import send_and_wait

from chatloom.app.main import create_app


@pytest.fixture(scope="module")
def sso(tmp_path_factory):
    provider = Provider()
    with LiveServer(provider.app()) as idp:
        provider.issuer = idp.url
        settings = make_settings(tmp_path_factory.mktemp("sso"), sampling={"max_tokens": 100},
                                 sso={"enabled": True, "issuer": idp.url, "client_id": CLIENT_ID,
                                      "client_secret": CLIENT_SECRET, "scopes": "openid email profile groups",
                                      "role_claim": "groups", "admin_values": ["admins"],
                                      "tier_values": {"staff": "pro"}, "button_label": "Sign in with Example ID"})
        with LiveServer(create_app(settings, ScriptedBackend())) as gateway:
            provider.client = Client(CLIENT_ID, CLIENT_SECRET, gateway.url + "/auth/sso/callback")
            yield provider, gateway


@pytest.fixture
def sso_page(browser, sso):
    _, gateway = sso
    context = browser.new_context(viewport=DESKTOP, base_url=gateway.url)
    context.set_default_timeout(10_000)
    page = context.new_page()
    page.console_errors = []
    page.on("pageerror", lambda exc: page.console_errors.append(str(exc)))
    yield page
    context.close()


def click_sso(page) -> None:
    page.goto("/")
    page.wait_for_selector("#sso-button:not([hidden])")
    assert page.inner_text("#sso-button") == "Sign in with Example ID"
    page.click("#sso-button")


def test_sign_in_through_the_provider_lands_as_the_mapped_tier(sso_page, sso):
    provider, gateway = sso
    provider.user = Person("browser-person-1", "erin@example.com", preferred_username="erin", groups=["staff"])
    requests_before = provider.token_requests
    click_sso(sso_page)
    sso_page.wait_for_selector("#app:not([hidden])")
    assert provider.token_requests == requests_before + 1
    assert sso_page.inner_text("#username") == "erin"
    assert "sso_token" not in sso_page.url  # the token left the address bar
    sso_page.wait_for_selector("#usage:not([hidden])")
    assert sso_page.inner_text("#usage strong") == "Pro plan"  # staff maps to the pro tier
    assert sso_page.locator("#ops-link").is_hidden()
    send_and_wait(sso_page, "hello from single sign-on")
    assert sso_page.locator(".conversation").count() == 1

    # Signed out and in again with the admin group: the same account, now an admin.
    sso_page.click("#logout")
    provider.user = Person("browser-person-1", "erin@example.com", preferred_username="erin",
                           groups=["staff", "admins"])
    click_sso(sso_page)
    sso_page.wait_for_selector("#app:not([hidden])")
    sso_page.wait_for_selector("#ops-link:not([hidden])")
    wait_js(sso_page, "document.querySelectorAll('.conversation').length === 1")  # the same account's chats
    assert sso_page.console_errors == []


def test_a_wrong_state_or_the_providers_refusal_shows_the_reason(sso_page, sso):
    provider, gateway = sso
    provider.user = Person("browser-person-2", "frank@example.com", preferred_username="frank")

    # The way out as the login button goes (its cookie kept in this browser), then to the provider with
    # another state than the one the cookie holds: the provider sends that state back with a good code.
    leave = sso_page.request.get("/auth/sso/login", max_redirects=0)
    assert leave.status == 302
    to_provider = urlsplit(leave.headers["location"])
    query = dict(parse_qsl(to_provider.query))
    sso_page.goto(to_provider._replace(query=urlencode({**query, "state": "forged"})).geturl())
    sso_page.wait_for_selector("#auth-error:not([hidden])")
    message = sso_page.inner_text("#auth-error")
    assert message.startswith("single sign-on failed:") and "state" in message, message
    assert sso_page.locator("#app").is_hidden() and "sso_error" not in sso_page.url

    # The provider sends the browser back with an error instead of a code.
    sso_page.goto("/auth/sso/callback?" + urlencode({"error": "access_denied",
                                                     "error_description": "The person declined."}))
    sso_page.wait_for_selector("#auth-error:not([hidden])")
    assert sso_page.inner_text("#auth-error") == ("single sign-on failed: the provider said access_denied: "
                                                  "The person declined.")
    assert sso_page.locator("#app").is_hidden()

    # Nothing was left half-done: the next sign-in works.
    click_sso(sso_page)
    sso_page.wait_for_selector("#app:not([hidden])")
    assert sso_page.inner_text("#username") == "frank"
    assert sso_page.console_errors == []


def test_a_password_account_connects_sso_in_settings_and_signs_in_with_it(sso_page, sso):
    provider, gateway = sso
    page = sso_page
    username = sign_up(page, unique_name("linked"))
    send_and_wait(page, "hello from a password account")
    wait_js(page, "document.querySelectorAll('.conversation').length === 1")

    # Settings: no identity yet; connect the provider, and come back to the settings, connected.
    provider.user = Person("browser-person-3", "grace@example.com", preferred_username="grace-idp")
    page.click("#open-settings")
    page.wait_for_selector("#sso-settings:not([hidden])")
    assert page.inner_text("#identity-list") == "No identity connected."
    assert page.inner_text("#sso-connect") == "Connect Example ID"
    page.click("#sso-connect")
    page.wait_for_selector("#settings-dialog[open] #identity-list .linked-identity")
    assert "grace@example.com" in page.inner_text("#identity-list .linked-identity")
    assert page.inner_text("#sso-link-status").startswith("Connected")
    assert "sso_linked" not in page.url and page.inner_text("#username") == username
    page.click("#settings-close")

    # Signed out, then in with the provider: the same account and its conversation.
    page.click("#logout")
    click_sso(page)
    page.wait_for_selector("#app:not([hidden])")
    assert page.inner_text("#username") == username
    wait_js(page, "document.querySelectorAll('.conversation').length === 1")
    assert page.inner_text(".conversation .open") == "hello from a password account"

    # Another password account cannot take the identity: the settings say why, and nothing changes.
    page.click("#logout")
    sign_up(page, unique_name("other"))
    page.click("#open-settings")
    page.wait_for_selector("#sso-connect:not([hidden])")
    page.click("#sso-connect")
    page.wait_for_selector("#settings-dialog[open] #settings-error:not([hidden])")
    assert "already linked to another account" in page.inner_text("#settings-error")
    assert page.inner_text("#identity-list") == "No identity connected."
    assert page.console_errors == []
