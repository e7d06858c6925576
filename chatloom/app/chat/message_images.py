"""Images kept in a conversation: saved with their user message as files (purpose "vision") in the blob
store, and put back in their turn whenever a prompt is built from the branch.

An image is stored once per message that carries it (its bytes under "vision/<file id>"), linked to
the message in order (store/message_images.py); deleting the conversation deletes the links and the
message's rows, the files stay the user's. A turn's stored token count includes its images' tokens,
so prompt planning counts them as the model will.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chatloom.app.chat.prompt import Turn
from chatloom.serving import Backend
from chatloom.serving.images import IMAGE_MARKER, ImageData, read_image
from chatloom.store.blobs import BlobStore
from chatloom.store.message_images import IMAGE_PURPOSE, MessageImage
from chatloom.store.models import StoredFile, new_id


def image_tokens(backend: Backend, text: str, images: list[ImageData]) -> int:
    """The tokens `images` add to a user turn of `text` (their image tokens and tags)."""
    with_images = backend.count_prompt_tokens([{"role": "user", "content": IMAGE_MARKER * len(images) + text,
                                                "images": images}])
    return with_images - backend.count_prompt_tokens([{"role": "user", "content": text}])


async def save_images(session: AsyncSession, blobs: BlobStore, user_id: str, message_id: str,
                      images: list[ImageData]) -> list[str]:
    """Store each image's bytes and its file row, linked to the message; returns the blob keys written
    (for the caller to delete should its transaction fail). Nothing is committed here."""
    keys: list[str] = []
    try:
        for position, image in enumerate(images):
            file_id = new_id("file")
            key = f"vision/{file_id}"
            await asyncio.to_thread(blobs.put, key, image.data)
            keys.append(key)
            session.add(StoredFile(id=file_id, user_id=user_id, filename=f"image-{position + 1}."
                                   f"{image.media_type.split('/')[-1]}", purpose=IMAGE_PURPOSE,
                                   content_type=image.media_type, bytes=len(image.data), blob_key=key,
                                   sha256=hashlib.sha256(image.data).hexdigest(), status="processed"))
            await session.flush()
            session.add(MessageImage(message_id=message_id, position=position, file_id=file_id))
        await session.flush()
    except BaseException:
        await asyncio.to_thread(delete_blobs, blobs, keys)
        raise
    return keys


def delete_blobs(blobs: BlobStore, keys: list[str]) -> None:
    for key in keys:
        blobs.delete(key)


async def image_ids(session: AsyncSession, message_ids: list[str]) -> dict[str, list[str]]:
    """The file ids of each message's images, in order (messages without images are left out)."""
    if not message_ids:
        return {}
    rows = (await session.execute(select(MessageImage.message_id, MessageImage.file_id)
                                  .where(MessageImage.message_id.in_(message_ids))
                                  .order_by(MessageImage.message_id, MessageImage.position))).all()
    found: dict[str, list[str]] = {}
    for message_id, file_id in rows:
        found.setdefault(message_id, []).append(file_id)
    return found


async def with_images(session: AsyncSession, blobs: BlobStore, turns: list[Turn], max_pixels: int) -> list[Turn]:
    """The turns with the images their messages carry, read back from the blob store."""
    ids = [t.id for t in turns if t.role == "user" and t.id]
    if not ids:
        return turns
    rows = (await session.execute(
        select(MessageImage.message_id, StoredFile.blob_key).join(StoredFile, StoredFile.id == MessageImage.file_id)
        .where(MessageImage.message_id.in_(ids)).order_by(MessageImage.message_id, MessageImage.position))).all()
    if not rows:
        return turns

    def read(key: str) -> ImageData:
        with blobs.open(key) as f:
            return read_image(f.read(), max_pixels)

    found: dict[str, list[ImageData]] = {}
    for message_id, key in rows:
        found.setdefault(message_id, []).append(await asyncio.to_thread(read, key))
    return [replace(t, images=tuple(found[t.id])) if t.id in found else t for t in turns]
