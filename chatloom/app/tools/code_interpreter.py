"""The `python` tool: the model's code run in the sandbox (sandbox.py), in the conversation's scratch
folder, which keeps its files from one call to the next.

What comes back: the model reads stdout, stderr and the names of the files the run wrote; the step
stored in the conversation also keeps the code and the files (and plots) as rows of the `files`
table with their bytes in the blob store, so the browser shows images inline and offers the rest for
download. A run that fails (an exception, a limit passed) is a tool error with its output kept.
"""
from __future__ import annotations

import asyncio
import hashlib
import mimetypes
import os
import shutil
import stat
import uuid
from pathlib import Path

from chatloom.app.generation.tool_calls import ToolSpec
from chatloom.app.tools.registry import Tool, ToolContext, ToolFailure, ToolOutput
from chatloom.app.tools.sandbox import SCRATCH, Limits, RunOutcome, Sandbox
from chatloom.settings.tree import ToolsSettings
from chatloom.store.models import StoredFile, new_id

PURPOSE = "code_output"
MAX_CODE_CHARS = 20_000
DESCRIPTION = (f"Run Python 3 code in a sandbox without network access and return what it prints. The working "
               f"folder {SCRATCH} keeps its files between calls in this conversation; files written there and "
               f"matplotlib figures are shown to the user. The value of a last line that is an expression is "
               f"printed.")


class CodeInterpreter:
    """The tool's state: the sandbox and the limits on what one run may leave behind."""

    def __init__(self, settings: ToolsSettings, data_dir: str | Path) -> None:
        self.sandbox = Sandbox(Limits.from_settings(settings), data_dir, settings.code_python,
                               settings.code_uid, settings.code_concurrency)
        self.scratch_bytes = settings.code_scratch_mb << 20
        self.max_files = settings.code_max_files

    def tool(self) -> Tool:
        spec = ToolSpec("python", DESCRIPTION, {"type": "object", "properties": {"code": {"type": "string"}},
                                                "required": ["code"], "additionalProperties": False})
        limits = self.sandbox.limits
        # Room for stdout, stderr and the file list; the wall limit plus time to store the files.
        return Tool(spec, self.run, timeout_s=limits.wall_s + 30, max_output_chars=2 * limits.output_chars + 2000)

    async def run(self, args: dict, ctx: ToolContext) -> ToolOutput:
        code = args["code"]
        if not code.strip():
            raise ToolFailure("the code is empty")
        if len(code) > MAX_CODE_CHARS:
            raise ToolFailure(f"the code is too long (at most {MAX_CODE_CHARS} characters)")
        scratch = self.sandbox.scratch(ctx.conversation_id)
        runs = self.sandbox.data_dir / "sandbox" / ".runs"
        plots = runs / uuid.uuid4().hex
        try:
            for folder in (scratch, plots):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            before = _listing(scratch)
            outcome = await self.sandbox.run(code, scratch, plots)
            written = [p for p, sig in _listing(scratch).items() if before.get(p) != sig]
            problem = outcome.problem(self.sandbox.limits)
            if sum(sig[0] for sig in _listing(scratch).values()) > self.scratch_bytes:
                for rel in written:
                    (scratch / rel).unlink(missing_ok=True)
                problem = (f"the conversation's files passed their limit of {self.scratch_bytes >> 20} MiB; "
                           f"the files this run wrote were removed")
                written = []
            found = [(scratch / rel, rel, False) for rel in sorted(written)]
            found += [(plots / name, name, True) for name in sorted(_listing(plots)) if name.endswith(".png")]
            files = await self._keep(found[:self.max_files], ctx)
        finally:
            await asyncio.to_thread(shutil.rmtree, plots, True)
        text = _model_text(outcome, files)
        details = {"code": code, "stdout": outcome.stdout, "stderr": outcome.stderr,
                   "exit_code": outcome.exit_code, "truncated": outcome.truncated, "files": files}
        if problem:
            raise ToolFailure(problem, text, details)
        return ToolOutput(text, details)

    async def _keep(self, found: list[tuple[Path, str, bool]], ctx: ToolContext) -> list[dict]:
        """Store each file (or plot) as a row of the files table and a blob; what the step shows of them."""
        kept = []
        for path, name, plot in found:
            data = await asyncio.to_thread(_read_plain_file, path, self.sandbox.limits.file_mb << 20)
            if data is None:
                continue
            kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
            entry = {"name": name, "bytes": len(data), "content_type": kind, "image": kind == "image/png",
                     "plot": plot}
            if ctx.blobs is not None:
                row = StoredFile(id=new_id("file"), user_id=ctx.user.id, filename=Path(name).name[:255],
                                 purpose=PURPOSE, content_type=kind, bytes=len(data), status="processed",
                                 sha256=hashlib.sha256(data).hexdigest())
                row.blob_key = f"{ctx.user.id}/{row.id}"
                await asyncio.to_thread(ctx.blobs.put, row.blob_key, data)
                async with ctx.db.session() as session:
                    session.add(row)
                    await session.commit()
                entry["id"] = row.id
            kept.append(entry)
        return kept


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Regular files under a folder (links not followed): relative path -> (size, mtime in ns)."""
    found = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns)
    return found


def _read_plain_file(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file the sandbox wrote, never through a link it may have planted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return f.read(limit + 1)[:limit]


def _model_text(outcome: RunOutcome, files: list[dict]) -> str:
    parts = []
    if outcome.stdout:
        parts.append(f"stdout:\n{outcome.stdout}")
    if outcome.stderr:
        parts.append(f"stderr:\n{outcome.stderr}")
    if outcome.truncated:
        parts.append("(output cut)")
    written = [f"{SCRATCH}/{f['name']}" for f in files if not f["plot"]]
    if written:
        parts.append("files written: " + ", ".join(written))
    plots = sum(1 for f in files if f["plot"])
    if plots:
        parts.append(f"{plots} figure(s) shown to the user")
    return "\n".join(parts) or "(no output)"
