"""Fetching a URL someone else chose (a model, a user), without server-side request forgery.

    policy = FetchPolicy(allow=("127.0.0.1",), max_bytes=2_000_000, timeout_s=10, max_redirects=3)
    page = await safe_fetch("https://example.org/a", policy)      # Fetched, or FetchRefused raised
    page.url, page.status, page.content_type, page.body, page.text()

The rules, checked for the URL asked and again for every redirect:
- http and https only, no user:password in the URL;
- the host is resolved and *every* address it resolves to must be public: loopback, private,
  link-local (169.254.169.254, the cloud metadata service, included), carrier-grade NAT, multicast,
  reserved and unspecified addresses are refused, as are IPv6's equivalents and IPv6 addresses that
  embed such an IPv4 address (mapped, 6to4, Teredo), unless `allow` names the host or a network
  holding the address;
- the connection goes to the address that was checked (the request carries the host name in its
  Host header and TLS server name), so a second DNS answer cannot point it elsewhere;
- at most `max_redirects` redirects, at most `max_bytes` of body (more: refused, or cut with
  `truncate=True`), everything within `timeout_s` in all; proxies from the environment are ignored.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
REDIRECTS = {301, 302, 303, 307, 308}
USER_AGENT = "chatloom-fetch/1.0"


class FetchRefused(Exception):
    """The URL was not fetched (or not wholly): the message says why, in words a model can use."""


@dataclass(frozen=True)
class FetchPolicy:
    allow: tuple[str, ...] = ()  # host names or networks (CIDR) that may be reached although not public
    max_bytes: int = 2_000_000
    timeout_s: float = 10.0
    max_redirects: int = 3
    user_agent: str = USER_AGENT
    _networks: tuple = field(init=False, repr=False, compare=False)
    _hosts: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        networks, hosts = [], []
        for entry in self.allow:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                hosts.append(entry.lower().rstrip("."))
        object.__setattr__(self, "_networks", tuple(networks))
        object.__setattr__(self, "_hosts", frozenset(hosts))

    def allows(self, host: str, address: IPAddress) -> bool:
        return host.lower().rstrip(".") in self._hosts or any(address in n for n in self._networks)


@dataclass(frozen=True)
class Fetched:
    url: str  # the final URL, after redirects
    status: int
    content_type: str
    body: bytes
    truncated: bool = False

    def text(self) -> str:
        charset = "utf-8"
        for part in self.content_type.split(";")[1:]:
            key, _, value = part.strip().partition("=")
            if key.lower() == "charset" and value:
                charset = value.strip('"')
        try:
            return self.body.decode(charset, "replace")
        except LookupError:
            return self.body.decode("utf-8", "replace")


def public(address: IPAddress) -> bool:
    """Whether an address is on the public internet (and embeds no address that is not)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None and not public(embedded):
            return False
        if address in _NAT64 and not public(ipaddress.IPv4Address(address.packed[-4:])):
            return False
    return address.is_global and not address.is_multicast


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address a host name resolves to (an address literal: itself)."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchRefused(f"cannot resolve {host}: {exc}") from None
    found: list[IPAddress] = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if address not in found:
            found.append(address)
    if not found:
        raise FetchRefused(f"cannot resolve {host}")
    return found


async def checked_address(url: str, policy: FetchPolicy) -> tuple[httpx.URL, IPAddress]:
    """The URL, parsed, and the address to connect to; FetchRefused when a rule forbids it."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise FetchRefused(f"not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise FetchRefused(f"only http and https URLs can be fetched, not {parsed.scheme or 'this'!r}")
    if not parsed.host:
        raise FetchRefused("the URL has no host")
    if parsed.userinfo:
        raise FetchRefused("URLs with a user name or password are not fetched")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    addresses = await resolve(parsed.host, port)
    for address in addresses:
        if not public(address) and not policy.allows(parsed.host, address):
            raise FetchRefused(f"{parsed.host} is at {address}, a private, loopback or link-local address: "
                               f"not fetched")
    return parsed, addresses[0]


async def safe_fetch(url: str, policy: FetchPolicy, *, headers: dict[str, str] | None = None,
                     truncate: bool = False) -> Fetched:
    """GET a URL under the policy's rules (module docstring); FetchRefused for anything refused or failed."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(url, policy, headers or {}, truncate)
    except TimeoutError:
        raise FetchRefused(f"fetching {url} took longer than {policy.timeout_s:g} s") from None


async def _fetch(url: str, policy: FetchPolicy, headers: dict[str, str], truncate: bool) -> Fetched:
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=policy.timeout_s) as client:
        for _hop in range(policy.max_redirects + 1):
            parsed, address = await checked_address(url, policy)
            pinned = parsed.copy_with(host=str(address))
            request = client.build_request("GET", pinned, headers={
                "User-Agent": policy.user_agent, **headers, "Host": _host_header(parsed)},
                extensions={"sni_hostname": parsed.host} if parsed.scheme == "https" else {})
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise FetchRefused(f"cannot fetch {url}: {exc or type(exc).__name__}") from None
            try:
                if response.status_code in REDIRECTS and "location" in response.headers:
                    url = urljoin(str(parsed), response.headers["location"])
                    continue
                body, cut = await _read(response, policy.max_bytes, truncate, url)
                return Fetched(str(parsed), response.status_code, response.headers.get("content-type", ""), body, cut)
            finally:
                await response.aclose()
        raise FetchRefused(f"more than {policy.max_redirects} redirects")


def _host_header(url: httpx.URL) -> str:
    host = f"[{url.host}]" if ":" in url.host else url.host
    return f"{host}:{url.port}" if url.port else host


async def _read(response: httpx.Response, limit: int, truncate: bool, url: str) -> tuple[bytes, bool]:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit and not truncate:
        raise FetchRefused(f"{url} is larger than {limit} bytes")
    body = bytearray()
    try:
        async for piece in response.aiter_bytes():
            body.extend(piece)
            if len(body) > limit:
                if not truncate:
                    raise FetchRefused(f"{url} is larger than {limit} bytes")
                return bytes(body[:limit]), True
    except httpx.HTTPError as exc:
        raise FetchRefused(f"cannot fetch {url}: {exc or type(exc).__name__}") from None
    return bytes(body), False


def display_url(url: str) -> str:
    """A URL without its fragment, for showing and citing."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, parts.query, ""))
