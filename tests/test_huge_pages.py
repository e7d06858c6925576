"""Importing chatloom puts PyTorch's large CPU tensors on transparent huge pages, unless the user chose."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")

# With its huge-page switch on, PyTorch madvise(MADV_HUGEPAGE)s a large tensor's memory: the kernel then
# lists "hg" among the flags of the mapping that holds it (whatever the system's THP mode).
PROBE = """
import os, chatloom, torch
x = torch.empty(16 << 20, dtype=torch.uint8)
addr, flags = x.data_ptr(), None
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and ":" not in head:
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= addr < hi
    elif inside and head == "VmFlags:":
        flags = line.split()[1:]
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), "hg" in flags)
"""


def _probe(env_value: str | None) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_import_turns_huge_pages_on_before_torch_allocates() -> None:
    assert _probe(None) == ["1", "True"]


def test_an_explicit_choice_is_kept() -> None:
    assert _probe("0") == ["0", "False"]
