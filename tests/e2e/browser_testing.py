"""Shared helpers for the browser tests: Chromium's path and flags, viewports, signing up,
waiting on the page, screenshots. (A uniquely named module, so test modules import it directly,
as tests/app does with app_testing.)"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

CHROMIUM = os.environ.get("CHATLOOM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def unique_name(prefix: str = "user") -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def sign_up(page, username: str | None = None, password: str = "correct horse battery") -> str:
    username = username or unique_name()
    page.goto("/")
    page.fill("#auth-username", username)
    page.fill("#auth-password", password)
    page.click("#signup-button")
    page.wait_for_selector("#app:not([hidden])")
    wait_js(page, "document.querySelector('#model').options.length > 0")
    return username


def wait_js(page, expression: str, timeout_s: float = 10.0):
    """Poll a JavaScript expression until it is truthy. (page.wait_for_function evaluates strings with
    eval, which the app's Content-Security-Policy forbids; page.evaluate is not subject to it.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        value = page.evaluate(expression)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {expression}")
        time.sleep(0.03)


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path
