"""Untrusted Python run in a bubblewrap sandbox: the code interpreter's walls.

Each run is one `bwrap` process with new PID, network, IPC and UTS namespaces: no network at all
(only a loopback device of its own), no view of the server's processes, the system's /usr (and the
interpreter's own folders) bound read-only, an empty /tmp in memory, and one writable folder, the
conversation's scratch folder, at /mnt/data. Nothing else of the host is there: not the data folder,
not the server's environment (bwrap starts from an empty one, and is itself started with only PATH).

Limits: `prlimit` inside the sandbox caps CPU seconds, the address space of each process, the
number of processes, the size of any file written and open files; the server kills the whole PID
namespace at the wall-clock limit or when the output passes its cap. RLIMIT_NPROC counts every
process of a user id, so when the server runs as root each concurrent run gets a user id of its own
(`uid_base` + slot) and the code never runs as root; a server that is not root runs the code under
its own user id (unprivileged user namespaces) and the process cap then counts the server's own
threads too, so it is set to what the server has plus the limit.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from chatloom.settings.tree import ToolsSettings

RUNNER = Path(__file__).with_name("sandbox_runner.py")
INSIDE_RUNNER = "/opt/chatloom/runner.py"
SCRATCH, PLOTS = "/mnt/data", "/mnt/plots"
_HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
_INSIDE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "LANG": "C.UTF-8", "MPLBACKEND": "Agg",
               "MPLCONFIGDIR": "/tmp/matplotlib", "XDG_CACHE_HOME": "/tmp/cache", "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives", "/etc/fonts")
_TMP_BYTES = 64 << 20
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(: .*)?$")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces here; the message says which."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int
    wall_s: float
    memory_mb: int
    processes: int
    output_chars: int
    file_mb: int

    @classmethod
    def from_settings(cls, s: ToolsSettings) -> "Limits":
        return cls(s.code_cpu_s, s.code_wall_s, s.code_memory_mb, s.code_processes, s.code_output_chars,
                   s.code_file_mb)


@dataclass(frozen=True)
class RunOutcome:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed by the server (see `stopped`)
    stopped: str | None = None  # why the server stopped the run: "wall_time" or "output"
    truncated: bool = False

    def problem(self, limits: Limits) -> str | None:
        """A sentence for the model when the run failed; None when it ended well."""
        if self.stopped == "wall_time":
            return f"the code ran past the time limit of {limits.wall_s:g} s and was stopped"
        if self.stopped == "output":
            return f"the code printed more than {limits.output_chars} characters and was stopped"
        if self.exit_code == 0:
            return None
        code = self.exit_code if self.exit_code is not None else -1
        sig = code - 128 if code > 128 else -code if code < 0 else 0
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "CPU" in self.stderr):
            return f"the code used more than {limits.cpu_s} s of CPU time and was stopped"
        if sig:
            return f"the code was killed by signal {signal.Signals(sig).name}"
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        if len(lines) > 1 and not self.stderr.endswith("\n"):
            lines.pop()  # cut at the output cap
        # Processes of one run may interleave their tracebacks: the last whole exception line says most.
        raised = [line for line in lines if _EXCEPTION_LINE.match(line)] or lines
        return f"the code failed: {raised[-1][:300]}" if raised else f"the code exited with status {code}"


@functools.lru_cache(maxsize=8)
def interpreter_paths(python: str) -> tuple[str, ...]:
    """The folders an interpreter needs (its prefix, its base prefix, where its binary really is);
    asked of the interpreter itself, once."""
    probe = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
             "sys.base_exec_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))]))")
    try:
        out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, timeout=30,
                             env=_HOST_ENV, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"cannot run the interpreter {python!r}: {exc}") from None
    found = []
    for p in json.loads(out):
        real = os.path.realpath(p)
        if real not in found and not real.startswith("/usr/") and real != "/usr":
            found.append(real)
    return tuple(found)


class Sandbox:
    """Runs code under the limits; one instance per gateway (it hands out the run slots)."""

    def __init__(self, limits: Limits, data_dir: str | Path, python: str | None = None, uid_base: int = 61000,
                 concurrency: int = 4) -> None:
        self.limits = limits
        self.data_dir = Path(data_dir).resolve()
        self.python = python or sys.executable
        self.uid_base = uid_base
        self.as_root = os.geteuid() == 0
        self._free = list(range(concurrency))
        self._slots = asyncio.Semaphore(concurrency)

    def scratch(self, conversation_id: str) -> Path:
        return scratch_path(self.data_dir, conversation_id)

    def problem(self) -> str | None:
        """Why runs cannot work here (no bwrap, no namespaces, no interpreter); None when they can."""
        return _problem(self.python, self.as_root)

    def command(self, scratch: Path, plots: Path, uid: int | None) -> list[str]:
        """The bwrap command line of one run (uid: the user id to run as, when the server is root)."""
        args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        if uid is not None:  # privileged bwrap: keep only what setpriv needs to drop to the run's user id
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:
            args += ["--unshare-user"]
        made: set[str] = set()

        def parents(path: str) -> None:  # bwrap would create them 0700 (copying the host), unreadable to uid
            parts = Path(path).parts
            for i in range(2, len(parts)):
                d = str(Path(*parts[:i]))
                if d not in made and d not in _SYSTEM_LINKS:
                    made.add(d)
                    args.extend(["--perms", "0755", "--dir", d])

        args += _system_binds()
        for f in _SYSTEM_FILES:
            if os.path.exists(f):
                parents(f)
                args += ["--ro-bind", f, f]
        # /tmp before the interpreter: one that lives under /tmp (a checkout there, its venv) is bound on
        # top of the empty /tmp, not hidden by it.
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(_TMP_BYTES), "--perms", "1777", "--tmpfs", "/tmp"]
        made.add("/tmp")
        for p in interpreter_paths(self.python):
            parents(p)
            args += ["--ro-bind", p, p]
        # Never the data folder, wherever it sits: inside /usr, a system folder or an interpreter's own.
        # An empty tmpfs over it, after every bind that could show it.
        if any(self.data_dir == Path(p) or Path(p) in self.data_dir.parents for p in _bound(args)):
            args += ["--tmpfs", str(self.data_dir)]
        for inside in (SCRATCH, INSIDE_RUNNER):
            parents(inside)
        args += ["--bind", str(scratch), SCRATCH, "--bind", str(plots), PLOTS,
                 "--ro-bind", str(RUNNER), INSIDE_RUNNER, "--chdir", SCRATCH, "--clearenv"]
        for key, value in _INSIDE_ENV.items():
            args += ["--setenv", key, value]
        args.append("--")
        if uid is not None:
            args += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all", "--no-new-privs"]
        lim = self.limits
        nproc = lim.processes if uid is not None else _tasks_of(os.getuid()) + lim.processes
        args += ["prlimit", f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb << 20}", f"--nproc={nproc}",
                 f"--fsize={lim.file_mb << 20}", "--nofile=256", "--core=0", "--",
                 self.python, "-I", "-B", INSIDE_RUNNER]
        return args

    async def run(self, code: str, scratch: Path, plots: Path) -> RunOutcome:
        """Run `code` with `scratch` as /mnt/data and `plots` (empty) as /mnt/plots."""
        async with self._slots:
            slot = self._free.pop()
            try:
                uid = self.uid_base + slot if self.as_root else None
                if uid is not None:
                    _give(scratch, uid)
                    _give(plots, uid)
                return await self._run(self.command(scratch, plots, uid), code)
            finally:
                self._free.append(slot)

    async def _run(self, args: list[str], code: str) -> RunOutcome:
        proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=_HOST_ENV, start_new_session=True)
        cap = self.limits.output_chars * 4  # bytes: room for UTF-8
        out, err = bytearray(), bytearray()
        overflow = asyncio.Event()

        async def pump(stream: asyncio.StreamReader, into: bytearray) -> None:
            while piece := await stream.read(65536):
                into.extend(piece[:max(0, cap + 1 - len(into))])
                if len(into) > cap:
                    overflow.set()

        async def feed() -> None:
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        stopped = None
        pumps = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), feed(), proc.wait())
        watch = asyncio.ensure_future(overflow.wait())
        try:
            done, _ = await asyncio.wait({pumps, watch}, timeout=self.limits.wall_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if pumps not in done:
                stopped = "output" if watch in done else "wall_time"
        finally:
            watch.cancel()
            if proc.returncode is None:
                _kill(proc.pid)
            await asyncio.gather(pumps, return_exceptions=True)
        stdout, t1 = _text(out, self.limits.output_chars)
        stderr, t2 = _text(err, self.limits.output_chars)
        return RunOutcome(stdout, stderr, None if stopped else proc.returncode, stopped, t1 or t2)


def scratch_path(data_dir: str | Path, conversation_id: str) -> Path:
    """A conversation's scratch folder: data_dir/sandbox/<conversation id>."""
    if not conversation_id.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"bad conversation id {conversation_id!r}")
    return Path(data_dir).resolve() / "sandbox" / conversation_id


def remove_scratch(data_dir: str | Path, conversation_id: str) -> None:
    """Delete a conversation's scratch folder (the conversation is gone)."""
    shutil.rmtree(scratch_path(data_dir, conversation_id), ignore_errors=True)


def _system_binds() -> list[str]:
    """/usr read-only, and /bin, /lib... as the host has them (links into /usr, or folders)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in _SYSTEM_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


def _bound(args: list[str]) -> list[str]:
    """The places inside the sandbox that a bwrap command line binds from the host."""
    return [args[i + 2] for i, arg in enumerate(args[:-2]) if arg in ("--bind", "--ro-bind")]


def _kill(pid: int) -> None:
    """bwrap is its session's leader and the PID namespace's parent: killing it ends every process inside."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _text(data: bytearray, chars: int) -> tuple[str, bool]:
    text = data.decode("utf-8", "replace")
    return (text, False) if len(text) <= chars else (text[:chars], True)


def _give(path: Path, uid: int) -> None:
    """Hand a folder (and what is in it) to the run's user id, without following links."""
    os.chown(path, uid, uid, follow_symlinks=False)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)


def _tasks_of(uid: int) -> int:
    """Threads of every process of a user id now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


@functools.lru_cache(maxsize=8)
def _problem(python: str, as_root: bool) -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    if shutil.which("prlimit") is None or (as_root and shutil.which("setpriv") is None):
        return "util-linux's prlimit and setpriv are not installed"
    try:
        interpreter_paths(python)
    except SandboxUnavailable as exc:
        return str(exc)
    probe = ["bwrap", "--unshare-pid", "--unshare-net", *_system_binds(), "--proc", "/proc", "--dev", "/dev", "--",
             "/usr/bin/true"]
    if not as_root:
        probe.insert(1, "--unshare-user")
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env=_HOST_ENV)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap cannot start: {exc}"
    if done.returncode != 0:
        return f"bwrap cannot create namespaces here: {done.stderr.strip()[:200]}"
    return None
