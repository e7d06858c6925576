"""What an uploaded file is, from its bytes, and its text.

The type is sniffed from the content, never taken from the name: a PDF begins with `%PDF-`, a DOCX is
a ZIP holding `word/document.xml`; anything else with binary bytes is refused (415). Text files are
told apart (HTML, Markdown, source code, plain text) by their content first and their name second,
which only chooses among kinds that are all read as text. pypdf reads PDFs, python-docx DOCX files,
BeautifulSoup HTML.

Limits: an encrypted or unreadable file is a 400; a file whose text passes `max_extracted_chars`, or a
DOCX whose parts (a PDF whose pages' drawing operators) unpack to more than `max_archive_ratio` times its
size, is refused as a decompression bomb (413) before its text is kept.
"""
from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import PurePath

from chatloom.app.core.errors import ApiError

KINDS = ("pdf", "docx", "html", "markdown", "code", "text")
CONTENT_TYPES = {"pdf": "application/pdf",
                 "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                 "html": "text/html", "markdown": "text/markdown", "code": "text/plain", "text": "text/plain"}
CODE_SUFFIXES = {".py", ".js", ".ts", ".tsx", ".jsx", ".java", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go",
                 ".rb", ".php", ".cs", ".kt", ".swift", ".scala", ".sh", ".bash", ".sql", ".json", ".yaml", ".yml",
                 ".toml", ".ini", ".css", ".lua", ".r", ".m", ".pl", ".hs", ".ex", ".exs", ".dart", ".vue"}
MARKDOWN_SUFFIXES = {".md", ".markdown", ".mdx"}
# Formats we do not read, named so the refusal can say what the file is.
_MAGIC = [(b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
          (b"\x1f\x8b", "a gzip archive"), (b"BZh", "a bzip2 archive"), (b"7z\xbc\xaf", "a 7-Zip archive"),
          (b"Rar!", "a RAR archive"), (b"\x7fELF", "a program"), (b"MZ", "a Windows program"),
          (b"\xd0\xcf\x11\xe0", "an old Office document"), (b"RIFF", "a media file"), (b"OggS", "a media file"),
          (b"ID3", "an MP3 file"), (b"\x00\x00\x00", "a media file")]
_HTML = re.compile(rb"^\s*(<!--.*?-->\s*)*<(!doctype\s+html|html|head|body)\b", re.IGNORECASE | re.DOTALL)
_MARKDOWN = re.compile(r"^(#{1,6} \S|```|\* \S|- \S|\d+\. \S|> \S)|\[[^\]]+\]\([^)]+\)", re.MULTILINE)


@dataclass(frozen=True)
class Limits:
    max_chars: int
    max_archive_ratio: float


@dataclass
class Extracted:
    kind: str
    text: str
    page_starts: list[int] = field(default_factory=list)  # PDFs: where each page's text begins

    def page_at(self, offset: int) -> int | None:
        """The page (from 1) the text at `offset` is on; None for files without pages."""
        if not self.page_starts:
            return None
        page = 1
        for i, start in enumerate(self.page_starts):
            if start <= offset:
                page = i + 1
        return page


def unsupported(what: str) -> ApiError:
    return ApiError(415, f"this file is {what}; upload PDF, DOCX, Markdown, HTML, source code or plain text",
                    "unsupported_file_type", "file")


def _bomb(limits: Limits) -> ApiError:
    return ApiError(413, f"the file's text is larger than {limits.max_chars} characters (a decompression bomb "
                    "or a document too large to index)", "file_too_large", "file")


def binary_kind(data: bytes) -> str | None:
    """What a file that cannot be text is ("a PDF", "a ZIP archive", "a program"...); None where it may be text."""
    if b"%PDF-" in data[:1024]:
        return "a PDF"
    if data.startswith(b"PK\x03\x04"):
        return "a ZIP archive"
    for magic, what in _MAGIC:
        if data.startswith(magic):
            return what
    if b"\x00" in data[:8192] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "binary data"
    return None


def sniff(data: bytes, filename: str) -> str:
    """The file's kind (one of KINDS), from its bytes; ApiError 415 for anything else."""
    if not data:
        raise ApiError(400, "the file is empty", "empty_file", "file")
    if b"%PDF-" in data[:1024]:
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                names = set(z.namelist())
        except (zipfile.BadZipFile, OSError, ValueError):
            raise ApiError(400, "the file looks like a ZIP archive but cannot be read", "corrupt_file", "file") from None
        if "word/document.xml" in names:
            return "docx"
        raise unsupported("a ZIP archive")
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise unsupported(what)
    if b"\x00" in data[:8192] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise unsupported("binary data")
    if _HTML.match(data[:4096]):
        return "html"
    suffix = PurePath(filename).suffix.lower()
    if suffix in MARKDOWN_SUFFIXES:
        return "markdown"
    if suffix in CODE_SUFFIXES:
        return "code"
    head = data[:16384].decode("utf-8", "ignore")
    return "markdown" if len(_MARKDOWN.findall(head)) >= 2 else "text"


def decode_text(data: bytes) -> str:
    """Text bytes as str: UTF-8 (with or without BOM) or UTF-16 with a BOM; else Windows-1252 when that
    reads as text (few control characters); else 415."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            raise unsupported("not readable as UTF-16 text") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:
        raise unsupported("binary data") from None
    controls = sum(1 for ch in text[:8192] if ord(ch) < 32 and ch not in "\t\r\n\f")
    if controls > len(text[:8192]) // 100:
        raise unsupported("binary data")
    return text


def _drawn_bytes(page, budget: int) -> int:
    """The unpacked size of what drawing `page` reads (its content streams and the form XObjects they
    use, nested), counted until it passes `budget`."""
    from pypdf.generic import IndirectObject

    total, seen = 0, set()
    contents = page.get_contents()
    total += len(contents.get_data()) if contents is not None else 0
    pending = [page.get("/Resources")]
    while pending and total <= budget:
        resources = pending.pop()
        resources = resources.get_object() if resources is not None else None
        xobjects = resources.get("/XObject") if hasattr(resources, "get") else None
        for ref in (xobjects.get_object().values() if xobjects is not None else ()):
            key = (ref.idnum, ref.generation) if isinstance(ref, IndirectObject) else id(ref)
            form = ref.get_object()
            if key in seen or form.get("/Subtype") != "/Form":
                continue
            seen.add(key)
            total += len(form.get_data())
            pending.append(form.get("/Resources"))
    return total


def _pdf(data: bytes, limits: Limits) -> Extracted:
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError, PyPdfError

    # Text extraction parses every drawing operator, about 2 s of CPU per unpacked megabyte: a few
    # kilobytes of compressed operators would otherwise hold a worker for minutes. The budget is the
    # DOCX one: the file's size times max_archive_ratio, at least 1 MB, at most 20 bytes per character kept.
    budget = int(min(max(limits.max_archive_ratio * len(data), 1_000_000), 20 * limits.max_chars))
    try:
        reader = PdfReader(io.BytesIO(data))
        # Encrypted with an owner password only (an empty user password: every viewer opens it without
        # asking) is readable; a PDF that needs a password to open is not.
        if reader.is_encrypted and not reader.decrypt(""):
            raise ApiError(400, "the PDF is encrypted; upload it without a password", "encrypted_file", "file")
        drawn = 0
        for page in reader.pages:
            drawn += _drawn_bytes(page, budget - drawn)
            if drawn > budget:
                raise ApiError(413, f"the PDF's pages unpack to more than {budget} bytes from {len(data)}: refused "
                               "as a decompression bomb", "file_too_large", "file")
        parts: list[str] = []
        starts: list[int] = []
        size = 0
        for page in reader.pages:
            starts.append(size)
            text = (page.extract_text() or "").strip()
            parts.append(text)
            size += len(text) + 2
            if size > limits.max_chars:
                raise _bomb(limits)
    except ApiError:
        raise
    except LimitReachedError:  # one stream past pypdf's own cap on what it unpacks
        raise ApiError(413, "a stream of the PDF unpacks to more than the reader allows: refused as a decompression "
                       "bomb", "file_too_large", "file") from None
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, RecursionError,
            AssertionError, ZeroDivisionError) as exc:
        raise ApiError(400, f"the PDF cannot be read ({type(exc).__name__}: {str(exc)[:200]})", "corrupt_file",
                       "file") from None
    return Extracted("pdf", "\n\n".join(parts), starts)


def _docx(data: bytes, limits: Limits) -> Extracted:
    import docx

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        unpacked = sum(i.file_size for i in z.infolist())
    if unpacked > max(limits.max_archive_ratio * len(data), 1_000_000) or unpacked > 20 * limits.max_chars:
        raise ApiError(413, f"the DOCX unpacks to {unpacked} bytes from {len(data)}: refused as a decompression "
                       "bomb", "file_too_large", "file")
    try:
        document = docx.Document(io.BytesIO(data))
        parts = [p.text for p in document.paragraphs]
        for table in document.tables:
            for row in table.rows:
                parts.append(" | ".join(cell.text for cell in row.cells))
    except Exception as exc:  # python-docx raises many kinds (lxml, KeyError, its own) for a broken file
        raise ApiError(400, f"the DOCX cannot be read ({type(exc).__name__})", "corrupt_file", "file") from None
    return Extracted("docx", "\n".join(p for p in parts if p.strip()))


def _html(text: str) -> str:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(text, "html.parser")
    for tag in soup(["script", "style", "noscript", "template"]):
        tag.decompose()
    lines = (line.strip() for line in soup.get_text("\n").splitlines())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def extract(data: bytes, filename: str, limits: Limits) -> Extracted:
    """The file's kind and text; ApiError (400, 413, 415) when it cannot or must not be read."""
    kind = sniff(data, filename)
    if kind == "pdf":
        out = _pdf(data, limits)
    elif kind == "docx":
        out = _docx(data, limits)
    else:
        text = decode_text(data)
        out = Extracted(kind, _html(text) if kind == "html" else text.replace("\r\n", "\n"))
    out.text = out.text.replace("\x00", "")
    if len(out.text) > limits.max_chars:
        raise _bomb(limits)
    if not out.text.strip():
        raise ApiError(400, f"no text could be extracted from this {kind} file (a scanned document?)",
                       "no_text", "file")
    return out
