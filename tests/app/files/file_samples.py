"""Documents made in the test, byte by byte: PDFs with text pages, DOCX files, broken and hostile ones."""
from __future__ import annotations

import io
import struct
import zipfile
import zlib


def _pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of these objects (numbered from 1, the catalog first) with a correct cross-reference table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def make_pdf(pages: list[str]) -> bytes:
    """A small valid PDF, one text line per page (Helvetica), with a correct cross-reference table."""
    objects: list[bytes] = []
    n = len(pages)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, text in enumerate(pages):
        safe = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        stream = f"BT /F1 12 Tf 72 720 Td ({safe}) Tj ET".encode()
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                       f"/Contents {5 + 2 * i} 0 R >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    return _pdf_file(objects)


def make_pdf_bomb(unpacked: int = 4_000_000, in_form: bool = False) -> bytes:
    """A one-page PDF whose drawing operators (one short text line, repeated) unpack to `unpacked` bytes
    from a few kilobytes: in the page's content stream, or in a form XObject the page draws."""
    line = b"BT /F1 12 Tf 72 720 Td (a) Tj ET\n"
    packed = zlib.compress(line * (unpacked // len(line)), 9)
    bomb = b"<< /Length %d /Filter /FlateDecode%s >>\nstream\n" % (
        len(packed), b" /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >>"
        if in_form else b"") + packed + b"\nendstream"
    page_stream = b"/X1 Do" if in_form else b""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >>"
               + (b" /XObject << /X1 6 0 R >>" if in_form else b"") + b" >> /Contents 5 0 R >>",
               b"<< /Length %d >>\nstream\n" % len(page_stream) + page_stream + b"\nendstream" if in_form else bomb]
    if in_form:
        objects.append(bomb)
    return _pdf_file(objects)


def make_encrypted_pdf(user_password: str = "user-password", pages: tuple[str, ...] = ("a secret page",),
                       algorithm: str = "RC4-128") -> bytes:
    """Encrypted; with user_password "" it has an owner password only, and opens without asking."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(make_pdf(list(pages)))))
    writer.encrypt(user_password, owner_password="owner-password", algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def make_docx(paragraphs: list[str]) -> bytes:
    import docx

    document = docx.Document()
    for p in paragraphs:
        document.add_paragraph(p)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def make_docx_bomb(unpacked: int = 60_000_000) -> bytes:
    """A ZIP that says it is a DOCX, whose document part unpacks to `unpacked` bytes of one letter."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", b"a" * unpacked)
    return out.getvalue()


def understate_sizes(data: bytes, size: int) -> bytes:
    """The ZIP with every member's uncompressed size written as at most `size`, in the local headers and
    the central directory alike: a bomb that lies about what it unpacks to."""
    out = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            struct.pack_into("<I", out, info.header_offset + 22, min(size, info.file_size))
    at = out.find(b"PK\x01\x02")
    while at >= 0:
        struct.pack_into("<I", out, at + 24, min(size, struct.unpack_from("<I", out, at + 24)[0]))
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
# The start of a 64-bit little-endian ELF executable: its header, then padding of printable-looking bytes.
ELF = b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 8 + b"\x02\x00\x3e\x00\x01\x00\x00\x00" + b"notes " * 40
