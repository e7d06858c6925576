"""The code interpreter for real: code runs in bubblewrap, tries to get out in every way the sandbox
is meant to stop, and each attempt comes back as a tool error while the server, and another user's
answer running beside it, carry on. Skipped only where bwrap cannot create namespaces."""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from chatloom.app.generation.tool_calls import ToolCall
from chatloom.app.tools.code_interpreter import CodeInterpreter
from chatloom.app.tools.registry import ToolContext, ToolRegistry
from chatloom.app.tools.sandbox import interpreter_paths
from chatloom.settings.tree import ToolsSettings

from app_testing import (ToolCallingBackend, app_client, call_text, done_of, make_settings, new_conversation,
                         send, signup, tokens_of)

LIMITS = {"code_cpu_s": 1, "code_wall_s": 10.0, "code_memory_mb": 256, "code_processes": 16,
          "code_output_chars": 2000}


def _interpreter(data_dir) -> CodeInterpreter:
    if shutil.which("bwrap") is None:  # CI installs it (.ci/run): missing is a failure, not a skip
        pytest.fail("bubblewrap is not installed (apt-get install bubblewrap)")
    interpreter = CodeInterpreter(ToolsSettings(**LIMITS), data_dir)
    problem = interpreter.sandbox.problem()
    if problem:
        pytest.skip(f"the sandbox cannot run here: {problem}")
    return interpreter


@pytest.fixture
def data_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "chatloom.db").write_text("SECRET-ROW")
    return data


async def _run(registry: ToolRegistry, code: str, conversation: str = "conv1"):
    return await registry.run(ToolCall("c1", "python", json.dumps({"code": code})),
                              ToolContext(None, None, conversation))


async def test_code_runs_and_keeps_its_files_between_calls(data_dir):
    registry = ToolRegistry([_interpreter(data_dir).tool()])
    r = await _run(registry, "import numpy as np\nopen('notes.txt', 'w').write('kept')\nnp.arange(10).sum()")
    assert r.error is None, r.output
    assert r.output.startswith("stdout:\nnp.int64(45)") or r.output.startswith("stdout:\n45")
    assert "files written: /mnt/data/notes.txt" in r.output
    assert r.details["files"] == [{"name": "notes.txt", "bytes": 4, "content_type": "text/plain",
                                   "image": False, "plot": False}]
    r = await _run(registry, "print(open('notes.txt').read())")
    assert r.output.strip() == "stdout:\nkept"
    r = await _run(registry, "import os; print(os.listdir('.'))", conversation="conv2")
    assert r.output.strip() == "stdout:\n[]"  # another conversation's scratch folder is its own


ESCAPES = {
    "read the data folder": ("print(open({db!r}).read())", "No such file or directory"),
    "list the data folder": ("import os; print(os.listdir({data!r}))", "No such file or directory"),
    "read pid 1's environment": ("print(open('/proc/1/environ').read())", "Permission denied"),
    "read the server's environment": ("import os; print(os.environ['CHATLOOM_TEST_SECRET'])", "KeyError"),
    "open a socket": ("import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)",
                      "Connection refused"),
    "reach the internet": ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)",
                           "Network is unreachable"),
    "fork without end": ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
    "allocate past the memory limit": ("b = bytearray(1 << 30)", "MemoryError"),
    "write outside the scratch folder": ("open('/usr/escaped', 'w').write('x')", "Read-only file system"),
    "write to the root": ("open('/escaped', 'w').write('x')", "Permission denied"),
    "run past the time limit": ("import time\ntime.sleep(120)", "time limit of 10 s"),
    "burn the CPU": ("while True:\n    pass", "CPU time"),
    "flood the output": ("while True:\n    print('x' * 1000)", "printed more than 2000 characters"),
}


@pytest.mark.parametrize("attempt", list(ESCAPES))
async def test_every_way_out_fails_inside_and_is_a_tool_error(attempt, data_dir, monkeypatch):
    monkeypatch.setenv("CHATLOOM_TEST_SECRET", "hunter2")
    registry = ToolRegistry([_interpreter(data_dir).tool()])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    template, expected = ESCAPES[attempt]
    code = template.format(db=str(data_dir / "chatloom.db"), data=str(data_dir), port=listener.getsockname()[1])
    try:
        r = await _run(registry, code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's loopback
    finally:
        listener.close()
    assert r.error, r.output
    assert expected in r.error + r.output
    assert "SECRET-ROW" not in r.output and "hunter2" not in r.output
    assert not os.path.exists("/usr/escaped") and not os.path.exists("/escaped")
    assert subprocess.run(["true"]).returncode == 0  # the server can still start processes
    # The sandbox works again at once.
    again = await _run(registry, "print('still here')")
    assert again.error is None and again.output.strip() == "stdout:\nstill here"


@pytest.mark.parametrize("inside", ["the interpreter's folder", "/usr"])
async def test_a_data_folder_inside_a_folder_the_sandbox_shows_is_hidden(inside):
    # /tmp is hidden whole; these are bound into the sandbox, so only the data folder's own guard keeps it out.
    base = interpreter_paths(sys.executable)[0] if inside != "/usr" else "/usr/local/share"
    if not os.access(base, os.W_OK):
        pytest.skip(f"cannot write to {base} here")
    data = Path(tempfile.mkdtemp(prefix="chatloom-test-data-", dir=base))
    try:
        data.chmod(0o755)  # readable by the run's user id: the permissions alone would not keep it out
        (data / "chatloom.db").write_text("SECRET-ROW")
        registry = ToolRegistry([_interpreter(data).tool()])
        db = str(data / "chatloom.db")
        r = await _run(registry, f"import os\nprint(os.path.isdir({base!r}))\nprint(open({db!r}).read())")
        assert r.output.startswith("stdout:\nTrue\n")  # the folder around it is there
        assert r.error == f"the code failed: FileNotFoundError: [Errno 2] No such file or directory: '{db}'"
        assert "SECRET-ROW" not in r.output
        r = await _run(registry, f"import os; print(os.listdir({str(data)!r}))")
        assert r.error is None and r.output.strip() == "stdout:\n[]"
    finally:
        shutil.rmtree(data)
    assert not data.exists()


async def test_the_process_limit_is_the_runs_own(data_dir):
    registry = ToolRegistry([_interpreter(data_dir).tool()])
    # Bounded, so that the test itself stays harmless if the limit were ever lost.
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
            "            time.sleep(20)\n            os._exit(0)\n        n += 1\nfinally:\n    print('forked', n)")
    r = await _run(registry, code)
    assert "Resource temporarily unavailable" in r.error
    forked = int(r.output.split("forked ")[1].split()[0])
    assert 0 < forked < LIMITS["code_processes"]


async def test_no_process_of_the_sandbox_outlives_its_run(data_dir):
    registry = ToolRegistry([_interpreter(data_dir).tool()])
    # A duration no other process on the machine has in its command line (a shell's `sleep 300` would
    # match a plain one).
    duration = f"300.{random.randrange(10**6):06d}"
    code = (f"import subprocess\nsubprocess.Popen(['sleep', '{duration}'], start_new_session=True)\n"
            "import time; time.sleep(120)")
    r = await _run(registry, code)
    assert "time limit" in r.error
    # The kill is sent before the tool returns; the kernel may take a moment to finish the killed
    # processes off on a busy machine, so wait for them to be gone (a survivor is still a failure).
    deadline = time.monotonic() + 5.0
    while (left := subprocess.run(["pgrep", "-f", f"sleep {duration}"], capture_output=True,
                                  text=True).stdout.split()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert left == []


async def test_a_plot_and_a_file_are_stored_and_downloadable_by_their_owner_only(tmp_path):
    backend = ToolCallingBackend()
    # matplotlib's import alone can take over a second of CPU on a loaded machine: this test is not about the limit.
    settings = make_settings(tmp_path, chat={"tools": "python"}, tools={**LIMITS, "code_cpu_s": 10},
                             sampling={"max_tokens": 500})
    _interpreter(tmp_path)
    code = ("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n"
            "open('table.csv', 'w').write('a,b\\n1,2\\n')\nprint(6 * 7)")
    async with app_client(settings, backend) as (client, app, alice):
        cid = await new_conversation(client, alice)
        _, events = await send(client, alice, cid, call_text("python", code=code))
        result = next(e.data["tool_result"] for e in events if isinstance(e.data, dict) and "tool_result" in e.data)
        assert result["error"] is None and result["output"].startswith("stdout:\n42\n")
        assert tokens_of(events).startswith("Result: stdout:\n42")
        assert done_of(events)["status"] == "complete"
        details = result["details"]
        assert details["code"] == code and details["stdout"] == "42\n" and details["exit_code"] == 0
        table, figure = details["files"]
        assert (table["name"], table["plot"], figure["name"], figure["image"], figure["plot"]) == (
            "table.csv", False, "figure-1.png", True, True)
        # Stored with the answer, and the bytes downloadable.
        answer = (await client.get(f"/conversations/{cid}", headers=alice)).json()["messages"][-1]
        assert answer["tool_steps"][0]["details"]["files"] == details["files"]
        r = await client.get(f"/conversations/{cid}/tool-files/{table['id']}", headers=alice)
        assert r.status_code == 200 and r.content == b"a,b\n1,2\n"
        assert r.headers["content-disposition"].startswith("attachment;")
        r = await client.get(f"/conversations/{cid}/tool-files/{figure['id']}", headers=alice)
        assert r.status_code == 200 and r.content.startswith(b"\x89PNG") and r.headers["content-type"] == "image/png"
        bob = await signup(client, "bob")
        bobs = await new_conversation(client, bob)
        r = await client.get(f"/conversations/{bobs}/tool-files/{table['id']}", headers=bob)
        assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
        r = await client.get(f"/conversations/{cid}/tool-files/{table['id']}", headers=bob)
        assert r.status_code == 404
        # Deleting the conversation removes its scratch folder.
        scratch = tmp_path / "sandbox" / cid
        assert (scratch / "table.csv").read_text() == "a,b\n1,2\n"
        assert (await client.delete(f"/conversations/{cid}", headers=alice)).status_code == 204
        assert not scratch.exists()


async def test_a_fork_bomb_leaves_another_users_answer_alone(tmp_path):
    backend = ToolCallingBackend()
    settings = make_settings(tmp_path, chat={"tools": "python,calculator"}, tools=LIMITS,
                             sampling={"max_tokens": 500})
    _interpreter(tmp_path)
    async with app_client(settings, backend) as (client, app, alice):
        bob = await signup(client, "bob")
        mine, theirs = await new_conversation(client, alice), await new_conversation(client, bob)
        bomb = call_text("python", code="import os\nwhile True:\n    os.fork()")
        (_, bombed), (_, calm) = await asyncio.gather(
            send(client, alice, mine, bomb), send(client, bob, theirs, call_text("calculator", expression="6*7")))
        result = next(e.data["tool_result"] for e in bombed if isinstance(e.data, dict) and "tool_result" in e.data)
        assert "Resource temporarily unavailable" in result["error"]
        assert done_of(bombed)["status"] == "complete"  # the model read the error and answered
        assert tokens_of(calm) == "Result: 42" and done_of(calm)["status"] == "complete"
        assert (await client.get("/healthz")).status_code == 200
