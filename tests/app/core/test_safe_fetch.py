"""The safe fetcher against a web on loopback: it reaches an allow-listed host, and refuses loopback,
IPv6 loopback, link-local (the metadata service), private addresses and redirects to any of them
when the allow-list does not name them; it connects to the address it checked, caps redirects,
size and time."""
from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest

from chatloom.app.core.safe_fetch import FetchPolicy, FetchRefused, public, safe_fetch

from fake_web import fake_web


@pytest.fixture
def web():
    with fake_web() as w:
        yield w


async def test_an_allow_listed_loopback_page_is_fetched(web):
    page = await safe_fetch(f"{web.base}/notes.txt", FetchPolicy(allow=("127.0.0.1",)))
    assert (page.status, page.content_type, page.text()) == (200, "text/plain", "plain notes: 7 otters seen")
    page = await safe_fetch(f"{web.base}/notes.txt", FetchPolicy(allow=("127.0.0.0/8",)))
    assert page.status == 200


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/notes.txt", "http://[::1]:{port}/notes.txt",
                                 "http://169.254.169.254/latest/meta-data/", "http://localhost:{port}/notes.txt",
                                 "http://10.0.0.1/", "http://192.168.1.1/", "http://[fe80::1]/", "http://0.0.0.0/",
                                 "http://[::ffff:127.0.0.1]:{port}/", "http://100.64.0.1/", "http://[fd00::1]/"])
async def test_private_loopback_and_link_local_addresses_are_refused(web, url):
    with pytest.raises(FetchRefused, match="private, loopback or link-local"):
        await safe_fetch(url.format(port=web.port), FetchPolicy())
    assert web.hosts == []


@pytest.mark.parametrize("target", ["http://127.0.0.1:{port}/notes.txt", "http://[::1]:{port}/notes.txt",
                                    "http://169.254.169.254/latest/meta-data/"])
async def test_a_redirect_to_a_refused_address_is_refused(web, target, monkeypatch):
    # The first hop is allowed by name only: the redirect's target is checked again on its own.
    _resolve_as(monkeypatch, "start.test", "127.0.0.1")
    policy = FetchPolicy(allow=("start.test",))
    with pytest.raises(FetchRefused, match="private, loopback or link-local"):
        await safe_fetch(f"http://start.test:{web.port}/redirect?to={target.format(port=web.port)}", policy)
    assert len(web.hosts) == 1  # the redirect was read, its target never reached


async def test_the_connection_goes_to_the_checked_address_with_the_name_as_host(web, monkeypatch):
    calls = _resolve_as(monkeypatch, "page.test", "127.0.0.1")
    page = await safe_fetch(f"http://page.test:{web.port}/notes.txt", FetchPolicy(allow=("page.test",)))
    assert page.status == 200 and web.hosts == [f"page.test:{web.port}"]
    assert calls == ["page.test"]  # resolved once: nothing else can answer a second lookup


async def test_redirects_size_and_time_are_capped(web):
    policy = FetchPolicy(allow=("127.0.0.1",), max_redirects=2, max_bytes=1_000_000, timeout_s=1.0)
    hop = f"{web.base}/notes.txt"
    for _ in range(3):
        hop = f"{web.base}/redirect?to={hop}"
    with pytest.raises(FetchRefused, match="more than 2 redirects"):
        await safe_fetch(hop, policy)
    page = await safe_fetch(f"{web.base}/redirect?to={web.base}/redirect?to={web.base}/notes.txt", policy)
    assert page.text() == "plain notes: 7 otters seen"
    with pytest.raises(FetchRefused, match="larger than 1000000 bytes"):
        await safe_fetch(f"{web.base}/large", policy)
    cut = await safe_fetch(f"{web.base}/large", policy, truncate=True)
    assert cut.truncated and len(cut.body) == 1_000_000
    with pytest.raises(FetchRefused, match="longer than 1 s"):
        await safe_fetch(f"{web.base}/slow", policy)


@pytest.mark.parametrize("url, why", [("ftp://example.org/", "only http and https"), ("not a url", "only http"),
                                      ("http://user:pw@example.org/", "user name or password"),
                                      ("http:///path", "no host")])
async def test_other_urls_are_refused(url, why):
    with pytest.raises(FetchRefused, match=why):
        await safe_fetch(url, FetchPolicy())


def test_embedded_ipv4_addresses_are_judged_by_what_they_embed():
    assert public(ipaddress.ip_address("93.184.215.14"))
    assert public(ipaddress.ip_address("2606:2800:21f:cb07:6820:80da:af6b:8b2c"))
    for private in ["::ffff:10.1.2.3", "2002:7f00:1::", "64:ff9b::a9fe:a9fe", "ff02::1", "224.0.0.1"]:
        assert not public(ipaddress.ip_address(private)), private


def _resolve_as(monkeypatch, name: str, address: str) -> list[str]:
    """Make `name` resolve to `address` (and record the lookups)."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    calls: list[str] = []

    async def getaddrinfo(host, port, *args, **kwargs):
        if host == name:
            calls.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]
        return await real(host, port, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    return calls
