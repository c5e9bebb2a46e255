"""Start SGLang servers as subprocesses of this run, wait until they serve, stop them on exit.

Each server is ``<inference.sglang_python> -m sglang.launch_server --model-path ... --host
... --port ... <inference.sglang_args>``. ``sglang_python`` is the interpreter of a separate
environment (SGLang pins its own torch); it defaults to this one. Server *i* of several gets
``--base-gpu-id i * tp`` so they sit on different GPUs. Logs go to
``<run.dir>/sglang/server-<i>.log``. Each server runs in its own process group, which
``stop()`` terminates (SGLang spawns scheduler and detokenizer children), and an ``atexit``
hook stops whatever is left if the run dies.

>>> launcher = SGLangLauncher(model_path="/models/qwen", run_dir="runs/a").start()
>>> launcher.urls        # ['http://127.0.0.1:30000']
>>> launcher.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from areal_sdk.config import Config


class LaunchError(RuntimeError):
    """A server that did not come up; the message names it and quotes its log."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _tp_size(args: list[str]) -> int:
    for flag in ("--tp-size", "--tp", "--tensor-parallel-size"):
        if flag in args:
            return int(args[args.index(flag) + 1])
        for arg in args:
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


@dataclass
class LaunchedServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


class SGLangLauncher:
    def __init__(
        self,
        *,
        model_path: str,
        run_dir: str | Path,
        python: str | None = None,
        args: list[str] | None = None,
        servers: int = 1,
        host: str = "127.0.0.1",
        timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if servers < 1:
            raise ValueError(f"servers must be at least 1, got {servers}")
        self.model_path = model_path
        self.log_dir = Path(run_dir) / "sglang"
        self.python = python or sys.executable
        self.args = list(args or [])
        self.count = servers
        self.host = host
        self.timeout_s = timeout_s
        self.env = env
        self.servers: list[LaunchedServer] = []

    @classmethod
    def from_config(cls, config: Config) -> SGLangLauncher:
        from areal_sdk.backends.sglang.lora import lora_server_args

        inference = config.inference
        if config.model.path is None:
            raise LaunchError(
                "launching SGLang needs model.path (a local model directory); or attach to "
                "running servers with inference.urls"
            )
        return cls(
            model_path=config.model.path,
            run_dir=config.run.dir,
            python=inference.sglang_python,
            args=[
                *inference.sglang_args,
                *lora_server_args(config.train.lora, inference.sglang_args),
            ],
            servers=inference.sglang_servers,
            host=inference.host,
            timeout_s=inference.launch_timeout_s,
        )

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def command(self, index: int, port: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            *self.args,
        ]
        if self.count > 1 and "--base-gpu-id" not in self.args:
            cmd += ["--base-gpu-id", str(index * _tp_size(self.args))]
        return cmd

    def start(self) -> SGLangLauncher:
        """Start every server, then wait until all answer ``/health`` (or fail)."""
        if not Path(self.python).exists():
            raise LaunchError(
                f"inference.sglang_python={self.python} does not exist; give the python of "
                "the environment where SGLang is installed"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        env = {**os.environ, **(self.env or {})}
        for i in range(self.count):
            port = _free_port(self.host)
            log_path = self.log_dir / f"server-{i}.log"
            log_file = log_path.open("ab")
            process = subprocess.Popen(
                self.command(i, port),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group, so stop() reaches children
            )
            self.servers.append(
                LaunchedServer(f"http://{self.host}:{port}", process, log_path, log_file)
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.servers)
        pause = 0.1
        with httpx.Client(timeout=5) as http:
            while pending:
                for server in list(pending):
                    code = server.process.poll()
                    if code is not None:
                        raise LaunchError(
                            f"SGLang server {server.url} exited with code {code} while "
                            f"starting; log {server.log_path}:\n{_tail(server.log_path)}"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(server.url + "/health").status_code == 200:
                            pending.remove(server)
                if not pending:
                    return
                if time.monotonic() > deadline:
                    names = ", ".join(s.url for s in pending)
                    raise LaunchError(
                        f"SGLang server(s) {names} not healthy within {self.timeout_s:g} s "
                        f"(inference.launch_timeout_s); log {pending[0].log_path}:\n"
                        f"{_tail(pending[0].log_path)}"
                    )
                time.sleep(pause)
                pause = min(pause * 1.5, 2.0)

    def kill(self, index: int) -> None:
        """Kill server ``index`` at once (SIGKILL to its process group)."""
        server = self.servers[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(10)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate every server (SIGTERM, then SIGKILL after ``timeout_s``). Idempotent."""
        servers, self.servers = self.servers, []
        for server in servers:
            if server.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for server in servers:
            try:
                server.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait(10)
            server.log_file.close()
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
