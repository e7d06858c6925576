"""The Responses API's input_image parts read into a prompt's turns.

app/responses/ keeps each image part as it was given (an image_url, or the file_id of a file uploaded to
/v1/files) and marks where it goes in its turn; here, before the prompt is rendered, each is read and
checked as every front's images are (core/image_input.py): http(s) URLs fetched when vision.fetch_urls
allows it, uploaded files taken from the blob store (the caller's own only), and a model that takes no
images refused by name. A thread behind previous_response_id brings its images back the same way.
"""
from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.core.errors import ApiError
from chatloom.app.core.image_input import ImageReader, reading_images
from chatloom.store import User
from chatloom.store.files import StoredFiles


async def read_turn_images(ctx, user: User, session: AsyncSession, turns: list[dict],
                           model: str | None) -> list[dict]:
    """`turns` with each turn's image parts (image_refs) read into its images; 400/404 naming a bad one."""
    refs = [ref for turn in turns for ref in turn.get("image_refs", ())]
    if not refs:
        return turns
    if not ctx.backend.takes_images(model):
        raise ApiError(400, f"the model {model!r} does not take images, so input_image parts cannot be read; send "
                       "text only or choose a model whose capabilities include vision (GET /v1/models)",
                       "unsupported_content", "input")
    reader = ImageReader(ctx.settings.vision, "input")
    await reader.fetch([r["image_url"] for r in refs if r.get("image_url")])
    files: dict[str, bytes] = {}
    stored = StoredFiles(session, ctx.blobs)
    for ref in refs:
        file_id = ref.get("file_id")
        if not file_id or file_id in files:
            continue
        row = await stored.get_owned(user.id, file_id)
        if row is None:
            raise ApiError(404, f"no file with id {file_id!r} (an input_image's file_id)", "file_not_found", "input")
        if row.bytes > ctx.settings.vision.max_image_bytes:
            raise ApiError(400, f"the file {file_id} has {row.bytes} bytes; at most "
                           f"{ctx.settings.vision.max_image_bytes} are accepted for an image", "image_too_large",
                           "input")
        files[file_id] = await asyncio.to_thread(ctx.blobs.read, row.blob_key)

    def read_all() -> list[dict]:
        out = []
        for turn in turns:
            turn = dict(turn)
            parts = turn.pop("image_refs", None)
            if parts:
                turn["images"] = [reader.raw(files[p["file_id"]]) if p.get("file_id") else reader.data_url(p["image_url"])
                                  for p in parts]
            out.append(turn)
        return out
    return await reading_images(True, read_all)
