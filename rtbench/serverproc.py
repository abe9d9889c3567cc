"""Real server processes on free 127.0.0.1 ports, for the load test, the benchmark and the tests:
`rtserver serve`, llama.cpp's `llama-server`, and `redis-server` (the cluster's store)."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any


def raise_nofile_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until_up(
    proc: subprocess.Popen[bytes], url: str, started: float, timeout_s: float, name: str, log_path: Path
) -> float:
    """Poll `url` until it answers 200; the seconds since `started`. RuntimeError naming the log when
    the process exits first or `timeout_s` passes."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up; see {log_path}")
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{name} not up after {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.2)


def status_mb(pid: int, field: str) -> float:
    """A memory field of a running process's /proc status (VmRSS: resident now, VmHWM: its peak), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def peak_rss_mb(pid: int) -> float:
    """The peak resident set size (VmHWM) of a running process, in MB."""
    return status_mb(pid, "VmHWM")


def parents() -> dict[int, int]:
    """Every process's parent id, from /proc/<pid>/stat (the field after the command's closing paren)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            out[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass  # ended meanwhile
    return out


def process_tree(pid: int, parent_of: dict[int, int] | None = None) -> list[int]:
    """`pid` and its living descendants."""
    children: dict[int, list[int]] = {}
    for child, parent in (parent_of if parent_of is not None else parents()).items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def tree_rss_mb(pid: int) -> float:
    """The resident memory of `pid` and its descendants together, in MB (0 for ended processes)."""
    total = 0.0
    for member in process_tree(pid):
        try:
            total += status_mb(member, "VmRSS")
        except (OSError, RuntimeError):
            pass  # ended, or a zombie without memory
    return total


class RssWatch:
    """Follows a server's memory from its start: its own peak (VmHWM) and, polled every `every_s`, the
    resident memory of its whole process tree. A process it starts while serving counts toward the
    peak; one it runs before it is ready (a compiler building kernels) only in `peak_tree_rss_mb`.
    The figures stay readable after the process ended."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.hwm_mb = 0.0  # the main process's VmHWM at the last sample
        self.tree_mb = 0.0  # the largest sampled sum over the tree, start-up included
        self.serving_tree_mb = 0.0  # the same, from `serving()` on
        self._pid = -1
        self._serving = False
        self._stop = threading.Event()

    def follow(self, pid: int) -> None:
        """Poll `pid` from now on (a restarted server: its new process, the peaks carried on)."""
        self._pid, self._serving, self._stop = pid, False, threading.Event()
        threading.Thread(target=self._poll, args=(self._stop,), name=f"rss-{pid}", daemon=True).start()

    def serving(self) -> None:
        """The server is ready: from now on its whole tree counts toward the peak."""
        self._serving = True

    def sample(self) -> None:
        try:
            self.hwm_mb = max(self.hwm_mb, peak_rss_mb(self._pid))
        except (OSError, RuntimeError):
            return  # not started, or gone: what was seen stays
        tree = tree_rss_mb(self._pid)
        self.tree_mb = max(self.tree_mb, tree)
        if self._serving:
            self.serving_tree_mb = max(self.serving_tree_mb, tree)

    def _poll(self, stop: threading.Event) -> None:
        while not stop.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self.sample()  # the last word while the process may still be there
        self._stop.set()

    @property
    def peak_mb(self) -> float:
        """The server's peak: VmHWM catches a spike between samples, the serving tree a helper."""
        return max(self.hwm_mb, self.serving_tree_mb)

    def figures(self) -> dict[str, float]:
        return {"peak_rss_mb": self.peak_mb, "peak_hwm_mb": self.hwm_mb, "peak_tree_rss_mb": self.tree_mb}


def log_reason(log_path: Path, marker: str) -> str:
    """Why a process stopped, from its log: the last line holding `marker`, from the marker on, else
    its last line."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if marker in line:
            return line[line.index(marker) :]
    return lines[-1] if lines else ""


def terminate(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace_s`."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# A load tool's clients all come from 127.0.0.1: per-client limits would count them as one client.
ONE_ADDRESS_LIMITS_OFF = {
    "RTSERVER_SECURITY_IP_RATE_LIMIT_PER_S": "0",
    "RTSERVER_SECURITY_MAX_SESSIONS_PER_IP": "0",
    "RTSERVER_SECURITY_IP_TOKENS_IN_FLIGHT": "0",
    "RTSERVER_SECURITY_IP_TOKENS_PER_S": "0",
    "RTSERVER_SECURITY_IP_KV_SHARE": "0",
    "RTSERVER_SERVER_MAX_CONNECTIONS_PER_IP": "0",
}


class ServerProcess:
    """`rtserver serve` (or another launcher) in a subprocess on a free 127.0.0.1 port, log to a file."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        config: str | None = None,
        launcher: list[str] | None = None,
    ):
        self.port = free_port()
        self.env = {
            "RTSERVER_SECURITY_API_ENABLED": "true",  # the tools and tests drive it; `env` may turn it off
            "RTSERVER_KNOWLEDGE_ENABLED": "false",  # the plain chat is measured; `env` may turn it on
            **os.environ,
            **env,
            "RTSERVER_SERVER_HOST": "127.0.0.1",
            "RTSERVER_SERVER_PORT": str(self.port),
        }
        # `launcher`: what python runs instead of `-m rtserver.cli [--config PATH] serve` (a script + args)
        self.cmd = [sys.executable] + (
            launcher or ["-m", "rtserver.cli"] + (["--config", config] if config else []) + ["serve"]
        )
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.cpus: set[int] | None = None  # set before start(): the CPUs it may run on (Linux)
        self.rss = RssWatch()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def start(self, timeout_s: float = 300.0) -> float:
        """Start and wait for /ready; the seconds it took. When it exits first or does not get ready, it
        is stopped and the RuntimeError says why (its log's start-up failure)."""
        started = time.monotonic()
        log = self.log_path.open("w")
        cpus = self.cpus

        def prepare() -> None:
            raise_nofile_limit()
            if cpus:
                os.sched_setaffinity(0, cpus)  # its threads, started later, inherit it

        self.proc = proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=prepare
        )
        self.rss.follow(proc.pid)
        try:
            ready_s = wait_until_up(proc, self.base + "/ready", started, timeout_s, "server", self.log_path)
        except RuntimeError as exc:
            terminate(self.proc)
            self.rss.stop()
            reason = log_reason(self.log_path, "startup failed:")
            raise RuntimeError(f"{exc}: {reason}" if reason else str(exc)) from None
        self.rss.serving()
        return ready_s

    def running(self) -> subprocess.Popen[bytes]:
        """The started process; starting it comes first."""
        if self.proc is None:
            raise RuntimeError(f"the server of {self.log_path} was never started")
        return self.proc

    def rss_mb(self) -> float:
        return status_mb(self.running().pid, "VmRSS")

    def health(self) -> dict[str, Any]:
        """The server's /health JSON (what it runs: model, dtype, kernels)."""
        with urllib.request.urlopen(self.base + "/health", timeout=10) as resp:
            health: dict[str, Any] = json.loads(resp.read())
            return health

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self, timeout_s: float = 60.0) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds to exit). Killed (and -9 returned) past the timeout."""
        started = time.monotonic()
        self.rss.stop()
        proc = self.running()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        return rc, time.monotonic() - started

    def log_errors(self) -> list[str]:
        """Log lines at ERROR level or tracebacks."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [
            ln for ln in lines if " ERROR " in ln or ln.startswith("ERROR:") or ln.startswith("Traceback")
        ]


class LlamaServerProcess:
    """llama.cpp's `llama-server` on a GGUF file on a free 127.0.0.1 port (`--metrics`, `--jinja` for its
    own chat endpoint), log to a file."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        log_path: Path,
        slots: int = 4,
        ctx: int = 8192,
        threads: int = 2,
        slot_save_path: Path | None = None,  # given: `POST /slots/<id>?action=erase` works (the bench)
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(slots),
            "-c",
            str(ctx),
            "-t",
            str(threads),
            "--metrics",
            "--jinja",
        ] + (["--slot-save-path", str(slot_save_path)] if slot_save_path else [])
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.cpus: set[int] | None = None  # set before start(): the CPUs it may run on (Linux)
        self.rss = RssWatch()

    def start(self, timeout_s: float = 120.0) -> float:
        """Start and wait for /health; the seconds it took. A failed start is stopped and its
        RuntimeError ends with the log's last error line."""
        started = time.monotonic()
        cpus = self.cpus
        self.proc = proc = subprocess.Popen(
            self.cmd,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.rss.follow(proc.pid)
        try:
            ready_s = wait_until_up(
                proc, self.base + "/health", started, timeout_s, "llama-server", self.log_path
            )
        except RuntimeError as exc:
            self.stop()
            reason = log_reason(self.log_path, "error")
            raise RuntimeError(f"{exc}: {reason}" if reason else str(exc)) from None
        self.rss.serving()
        return ready_s

    def stop(self) -> None:
        self.rss.stop()
        terminate(self.proc)


class RedisProcess:
    """Debian's `redis-server` on a free 127.0.0.1 port with its own data folder. `appendfsync`
    "always" (the default here) makes every acknowledged write survive a stop and restart, as the tests
    of the cluster need; "no" keeps only what the last snapshot held. `stop()` then `start()` again runs
    it on the same port and folder (its data back from the append-only file)."""

    def __init__(self, data_dir: Path, binary: str = "redis-server", appendfsync: str = "always"):
        self.port = free_port()
        self.data_dir = data_dir
        self.binary = binary
        self.appendfsync = appendfsync
        self.log_path = data_dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--daemonize",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        self.proc = proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=raise_nofile_limit
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server not up after {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.05)

    def stop(self) -> None:
        terminate(self.proc)
