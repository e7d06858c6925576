"""/v1/files with purpose `vision`: the upload must be an image a request could use, sniffed from its bytes
with the chat path's checks; anything else is a 400 naming the problem, and nothing is stored."""
from __future__ import annotations

import io

import pytest
from PIL import Image
from sqlalchemy import func, select

from chatloom.store.models import StoredFile


def _image(fmt: str = "PNG", size: tuple[int, int] = (24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 40, 90)).save(buf, fmt)
    return buf.getvalue()


async def _upload(client, headers, data: bytes, content_type: str = "image/png", purpose: str = "vision"):
    return await client.post("/v1/files", headers=headers, data={"purpose": purpose},
                             files={"file": ("picture.png", data, content_type)})


async def _stored(app) -> tuple[int, int]:
    """Rows in the files table, and files in the blob store."""
    async with app.state.ctx.db.session() as session:
        rows = await session.scalar(select(func.count()).select_from(StoredFile))
    return rows, len([p for p in (app.state.ctx.blobs.root / "files").rglob("*") if p.is_file()])


@pytest.mark.parametrize("case,code,words", [
    ("text", "invalid_image", "not an image"),
    ("corrupt", "invalid_image", "corrupt"),
    ("pixels", "image_too_large", "pixels"),
    ("bytes", "image_too_large", "at most 2000"),
])
async def test_a_vision_upload_that_is_not_a_usable_image_is_refused(app, client, alice, settings, case, code,
                                                                     words):
    settings.vision.max_image_pixels = 1_000_000
    if case == "bytes":
        settings.vision.max_image_bytes = 2000
    data = {"text": b"just some words, with an image's name and type",
            "corrupt": _image()[:60],
            "pixels": _image(size=(2000, 1000)),
            "bytes": _image("BMP", (40, 40))}[case]
    r = await _upload(client, alice, data)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == "file", error
    assert words in error["message"] and "purpose vision" in error["message"], error
    assert await _stored(app) == (0, 0)


@pytest.mark.parametrize("fmt,media", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
async def test_a_vision_image_is_stored_with_the_type_its_bytes_show(app, client, alice, fmt, media):
    data = _image(fmt)
    r = await _upload(client, alice, data, content_type="application/octet-stream")
    assert r.status_code == 200, r.text
    assert r.json()["purpose"] == "vision" and r.json()["bytes"] == len(data)
    async with app.state.ctx.db.session() as session:
        row = await session.get(StoredFile, r.json()["id"])
    assert row.content_type == media
    content = await client.get(f"/v1/files/{r.json()['id']}/content", headers=alice)
    assert content.content == data


async def test_other_purposes_are_not_sniffed(app, client, alice):
    r = await _upload(client, alice, b"not a picture", purpose="user_data")
    assert r.status_code == 200, r.text
    assert await _stored(app) == (1, 1)
