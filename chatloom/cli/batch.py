"""`chatloom batch run INPUT.jsonl -o OUTPUT.jsonl`: a Batch API input file run offline on the local engine.

The same machinery as the server's Batch API, in this process: the app is built over a throwaway data
folder (SQLite, blob store), the input stored as a `batch` file, a batch created and run by the batch
runner through the one generation pipeline (moderation and caps as configured; an operator's run is not
held to a tier's quota), with a progress bar on stderr. OUTPUT gets the output file, and the error file
(bad lines with their line numbers, refused requests) goes beside it as OUTPUT's stem + `.errors.jsonl`
unless --errors names another path. Nothing is written to OUTPUT until the batch has ended.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from chatloom.model_args import add_kv_cache_dtype_arg

ENDED = ("completed", "failed", "expired", "cancelled")
OFFLINE_TIER = "offline"


def register(subparsers: argparse._SubParsersAction) -> None:
    batch = subparsers.add_parser("batch", help="Batch API input files, run offline")
    sub = batch.add_subparsers(dest="batch_command", metavar="{run}")
    p = sub.add_parser("run", help="run every request of a batch JSONL file on the local engine, with a progress bar")
    p.add_argument("input", metavar="INPUT.jsonl", help="OpenAI batch input: one {custom_id, method, url, body} a line")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT.jsonl", help="where the output file goes")
    p.add_argument("--errors", metavar="FILE",
                   help="where the error file goes (default: OUTPUT's stem + .errors.jsonl)")
    p.add_argument("--endpoint", help="the endpoint every line targets (default: the url of the first line)")
    p.add_argument("--config", metavar="FILE", help="TOML file of settings (see the configuration reference)")
    p.add_argument("--model", help="model to load (default: the settings' model.name)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="weights and KV cache dtype")
    p.add_argument("--max-num-seqs", type=int, metavar="N", help="most sequences running in one step")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_batch_run)


def errors_path(output: Path) -> Path:
    return output.with_name(output.stem + ".errors.jsonl")


def first_url(path: Path) -> str:
    """The url of the first request line that names one."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    continue
                if isinstance(url, str):
                    return url
    raise ValueError(f"{path}: no request line names a url (or pass --endpoint)")


def cmd_batch_run(args: argparse.Namespace) -> int:
    from chatloom.settings import load_settings

    source, output = Path(args.input), Path(args.output)
    if not source.is_file():
        raise ValueError(f"no such file: {source}")
    errors = Path(args.errors) if args.errors else errors_path(output)
    for path in (output, errors):
        if not path.parent.is_dir():
            raise ValueError(f"no such folder for {path}: {path.parent}")
    endpoint = args.endpoint or first_url(source)
    flags = {"model.name": args.model, "model.dtype": args.dtype, "engine.max_num_seqs": args.max_num_seqs,
             "engine.kv_cache_dtype": getattr(args, "kv_cache_dtype", None)}
    settings = load_settings(args.config, flags=flags)
    with tempfile.TemporaryDirectory(prefix="chatloom-batch-") as work:
        settings = settings.with_values({"server.data_dir": work,
                                         "server.db_url": f"sqlite+aiosqlite:///{work}/batch.db"})
        settings.shared_state.redis_url = None  # alone: nothing to share with other gateways
        summary = asyncio.run(run_file(settings, source, endpoint, output, errors, not args.no_progress))
    print(summary, file=sys.stderr)
    return 0


async def run_file(settings, source: Path, endpoint: str, output: Path, errors: Path, progress: bool = True) -> str:
    """Run the batch file to its end; write OUTPUT (and the error file, when there are errors); return a
    one-line summary. Raises ValueError for a file that is no batch."""
    from chatloom.app.main import create_app
    from chatloom.store.batches import Batch
    from chatloom.store.blobs import BlobTooLarge
    from chatloom.store.files import StoredFiles

    app = create_app(settings)
    app.state.ctx.backend.check()  # a missing model file or unsupported architecture: one line, exit 2
    async with app.router.lifespan_context(app):
        ctx = app.state.ctx
        runner = app.state.batch_runner
        if endpoint not in runner.endpoints:
            raise ValueError(f"endpoint must be one of {', '.join(sorted(runner.endpoints))}, not {endpoint!r}")
        await _ready(app)
        user = await _operator(ctx)
        limit = settings.files.limit("batch")
        async with ctx.db.session() as session:
            try:
                with open(source, "rb") as f:
                    stored = await StoredFiles(session, ctx.blobs).save(user.id, source.name, "batch", f,
                                                                        max_bytes=limit)
            except BlobTooLarge:
                raise ValueError(f"{source} is larger than the batch file limit of {limit} bytes "
                                 "(setting files.max_bytes)") from None
            batch = Batch(user_id=user.id, endpoint=endpoint, input_file_id=stored.id, completion_window="24h",
                          status="validating", total=0, completed=0, failed=0)
            session.add(batch)
            await session.commit()
        runner.nudge()
        batch = await _follow(ctx, batch.id, progress)
        if batch.status == "failed":
            raise ValueError(f"{source}: " + "; ".join(e["message"] for e in batch.errors or []))
        await _write(ctx, batch.output_file_id, output)
        if batch.error_file_id:
            await _write(ctx, batch.error_file_id, errors)
        elif errors.exists():
            errors.unlink()  # an error file of an earlier run would read as this run's
    where = f"; errors in {errors}" if batch.error_file_id else ""
    return (f"chatloom: batch {batch.status}: {batch.completed} of {batch.total} requests answered, "
            f"{batch.failed} failed; output in {output}{where}")


async def _ready(app) -> None:
    """Wait for the model to load (the batch's lines would only wait for it one by one)."""
    from chatloom.models import ModelError

    while not app.state.ctx.backend.ready:
        failure = getattr(app.state, "startup_failure", None)
        if failure is not None:
            raise ModelError(failure)
        await asyncio.sleep(0.05)


async def _operator(ctx):
    """The account the offline run belongs to, on a tier of its own with no quota to speak of."""
    from chatloom.app.traffic.tiers import Tier, TierTable
    from chatloom.store import Users

    huge = 10 ** 15
    tiers = ctx.traffic.tiers
    top = max(tiers.tiers.values(), key=lambda t: t.priority)
    offline = Tier(OFFLINE_TIER, tokens_per_minute=huge, tokens_per_day=huge, requests_per_minute=huge,
                   max_concurrent=huge, priority=top.priority, reserved_share=0.0, max_tokens=top.max_tokens)
    ctx.traffic.tiers = TierTable({**tiers.tiers, OFFLINE_TIER: offline}, tiers.default)
    async with ctx.db.session() as session:
        user = await Users(session).create("batch-run", None)
        user.tier = OFFLINE_TIER
        await session.commit()
    return user


async def _follow(ctx, batch_id: str, progress: bool):
    """Wait for the batch to end, moving the progress bar as its lines end."""
    from tqdm import tqdm

    from chatloom.store.batches import Batch

    bar = None
    try:
        while True:
            async with ctx.db.session() as session:
                batch = await session.get(Batch, batch_id)
            if progress and bar is None and batch.total:
                bar = tqdm(total=batch.total, unit="req", file=sys.stderr, desc="batch")
            if bar is not None:
                bar.update(batch.completed + batch.failed - bar.n)
            if batch.status in ENDED:
                return batch
            await asyncio.sleep(0.2)
    finally:
        if bar is not None:
            bar.close()


async def _write(ctx, file_id: str | None, path: Path) -> None:
    """The stored file's bytes to `path`, whole or not at all (an empty file when there is none)."""
    from chatloom.store.models import StoredFile

    key = None
    if file_id is not None:
        async with ctx.db.session() as session:
            key = (await session.get(StoredFile, file_id)).blob_key
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as out:
            for piece in ctx.blobs.iter_chunks(key) if key else ():
                out.write(piece)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
