"""The browser app's files: served from chatloom/web/ with the right types and a strict CSP, nothing else."""
from __future__ import annotations

import re

from chatloom.app.api.routes.web import WEB_DIR


async def test_index_is_the_app_with_a_strict_content_security_policy(client):
    r = await client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/web/app.js"></script>' in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "object-src 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"


async def test_every_module_the_page_imports_is_served_as_javascript(client):
    names = {"app.js"}
    seen = set()
    while names - seen:  # follow the import graph from app.js
        name = (names - seen).pop()
        seen.add(name)
        r = await client.get(f"/web/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"].startswith("text/javascript")
        names |= set(re.findall(r"from '\./([\w-]+\.js)'", r.text))
        assert "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")  # nothing from elsewhere
    assert {"api.js", "sse.js", "markdown.js", "messages.js", "run.js", "sidebar.js"} <= seen
    assert (await client.get("/web/style.css")).headers["content-type"].startswith("text/css")


async def test_only_plain_files_inside_the_web_folder(client):
    assert (WEB_DIR / "index.html").is_file()
    for path in ("/web/../app/main.py", "/web/%2e%2e/app/main.py", "/web/", "/web/nope.js", "/web/..%2fcli.py"):
        r = await client.get(path)
        assert r.status_code == 404, path
