"""The Operations page: an admin reaches it from the sidebar and watches its charts take new points
while requests are being made; anyone else sees no entry and is refused."""
from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest

from app_testing import LiveServer, make_settings
from browser_testing import DESKTOP, screenshot, sign_up, unique_name, wait_js
from chatloom.app.main import create_app
from chatloom.serving import BackendStats, Timings
from scripted_backend import ScriptedBackend

ADMIN, PASSWORD = "root", "correct horse battery"
CHARTS = ("chart-queue", "chart-kv", "chart-goodput", "chart-arrivals", "chart-replicas")


def points(chart: str) -> str:
    return f"Number(document.getElementById('{chart}').dataset.points)"


class MeasuredBackend(ScriptedBackend):
    """The scripted answers, with the latencies an engine reports and a KV cache that fills with the
    answers running, so goodput and KV occupancy have something to show."""

    running = 0

    def stats(self) -> BackendStats:
        return BackendStats(ready=True, num_requests_running=self.running,
                            kv_cache_usage_perc=min(1.0, 0.15 + 0.3 * self.running))

    async def stream(self, request):
        start, first = time.monotonic(), None
        self.running += 1
        try:
            async for delta in super().stream(request):
                first = first or time.monotonic()
                if delta.finished:
                    end = time.monotonic()
                    n = max(1, delta.completion_tokens - 1)
                    delta = dataclasses.replace(delta, metrics=Timings(ttft=first - start, tpot=(end - first) / n,
                                                                       e2e=end - start))
                yield delta
        finally:
            self.running -= 1


@pytest.fixture(scope="module")
def ops_server(tmp_path_factory):
    # Its own server, so the first account (the admin) is this module's.
    settings = make_settings(tmp_path_factory.mktemp("e2e-ops"), sampling={"max_tokens": 1000},
                             autoscale={"enabled": True, "capacity_rps": 1.0, "interval_s": 0.5, "startup_s": 1.0})
    with LiveServer(create_app(settings, MeasuredBackend())) as live:
        r = httpx.post(f"{live.url}/auth/signup", json={"username": ADMIN, "password": PASSWORD})
        assert r.status_code == 201 and r.json()["user"]["is_admin"], r.text
        yield live


def log_in(page, username: str) -> None:
    page.goto("/")
    page.fill("#auth-username", username)
    page.fill("#auth-password", PASSWORD)
    page.click("#login-button")
    page.wait_for_selector("#app:not([hidden])")


class Load:
    """Chat completions, one after another from a thread, until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            r = c.post("/auth/signup", json={"username": unique_name("load"), "password": PASSWORD})
            headers = {"Authorization": f"Bearer {r.json()['token']}"}
            while not self.stop.is_set():
                r = c.post("/v1/chat/completions", headers=headers, json={
                    "model": "scripted", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20})
                assert r.status_code == 200, r.text
                self.done += 1

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def test_admin_watches_the_charts_move_under_load(browser, ops_server):
    context = browser.new_context(viewport=DESKTOP, base_url=ops_server.url)
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        log_in(page, ADMIN)
        link = page.locator("#ops-link")
        assert link.is_visible()
        with Load(ops_server.url) as load:
            link.click()
            page.wait_for_url("**/web/ops.html")
            page.locator("#ops:not([hidden])").wait_for()
            for chart in CHARTS:  # every chart is drawn (uPlot puts a canvas in its figure)
                page.locator(f"#{chart} canvas").wait_for()
            start = wait_js(page, points("chart-arrivals"))
            # New snapshots arrive and the charts take them: the point count rises while requests finish.
            wait_js(page, f"{points('chart-arrivals')} >= {start + 2}")
            wait_js(page, "[...document.querySelectorAll('#classes-table tbody tr td:nth-child(2)')]"
                          ".some((td) => Number(td.textContent) > 0)")
            assert load.done > 0
        assert page.locator("#classes-table tbody tr td").first.inner_text() == "interactive:free"
        assert page.locator("#tiers-table tbody tr td").first.inner_text() == "free"
        assert page.locator("#degrade-step").inner_text() in ("none", "1/3: effort", "2/3: small_model",
                                                              "3/3: max_tokens")
        assert "desired" in page.locator("#autoscale-now").inner_text()
        assert all(int(page.get_attribute(f"#{c}", "data-points")) >= start + 2 for c in CHARTS)
        screenshot(page, "desktop-operations")
        assert errors == []
    finally:
        context.close()


def test_others_see_no_entry_and_are_refused(browser, ops_server):
    context = browser.new_context(viewport=DESKTOP, base_url=ops_server.url)
    try:
        page = context.new_page()
        sign_up(page)  # not the first account: not an admin
        assert page.locator("#ops-link").is_hidden()
        token = page.evaluate("localStorage.getItem('chatloom.token')")
        r = httpx.get(f"{ops_server.url}/admin/ops", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 403
        page.goto("/web/ops.html")
        wait_js(page, "!document.getElementById('ops-error').hidden")
        assert page.locator("#ops-error").inner_text() == "The Operations page is for admins only."
        assert page.locator("#ops").is_hidden()
    finally:
        context.close()
