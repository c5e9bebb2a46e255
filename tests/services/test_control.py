"""The run's control endpoint (``services.json``) and the commands that use it:
``areal-sdk status`` and ``areal-sdk engines``, against a live control server."""

from __future__ import annotations

import asyncio
import json
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from areal_sdk.cli import main
from areal_sdk.services.control import ControlServer
from areal_sdk.services.health import Phase, ServiceState


@pytest.fixture
def run_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


class Fleet:
    def __init__(self) -> None:
        self.urls = ["http://127.0.0.1:9001"]
        self.states = [ServiceState("engine", "engine-0", pid=11, url=self.urls[0])]
        self.states[0].enter(Phase.UP)

    async def add(self, url: str | None) -> str:
        url = url or "http://127.0.0.1:9002"
        self.urls.append(url)
        return url

    async def remove(self, url: str) -> None:
        if url not in self.urls:
            raise KeyError(f"no engine server {url} in this fleet")
        self.urls.remove(url)


@pytest.fixture
def control(tmp_path: Path, run_loop) -> Iterator[tuple[ControlServer, Fleet]]:
    fleet = Fleet()
    server = ControlServer(
        tmp_path,
        placement="processes",
        states=lambda: fleet.states,
        add_engine=fleet.add,
        remove_engine=fleet.remove,
    )
    server.start(run_loop)
    yield server, fleet
    server.stop()


def _cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out + out.err


def test_the_services_file_is_private_and_names_a_live_endpoint(control, tmp_path):
    path = tmp_path / "services.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the control token
    record = json.loads(path.read_text())
    assert record["live"] is True
    assert httpx.get(record["url"] + "/services").status_code == 401
    answer = httpx.get(
        record["url"] + "/services", headers={"Authorization": f"Bearer {record['token']}"}
    ).json()
    assert [s["name"] for s in answer["services"]] == ["engine-0"]
    metrics = httpx.get(record["url"] + "/metrics").text
    assert 'areal_service_up{kind="engine",name="engine-0"} 1.0' in metrics


def test_status_prints_the_live_services_then_the_last_recorded(control, tmp_path, capsys):
    server, fleet = control
    code, out = _cli(capsys, "status", str(tmp_path))
    assert code == 0 and "live" in out and "engine-0" in out and "http://127.0.0.1:9001" in out
    fleet.states[0].enter(Phase.STOPPED)
    server.stop()
    code, out = _cli(capsys, "status", str(tmp_path))
    assert code == 0 and "ended" in out and "stopped" in out


def test_status_of_a_directory_without_a_run_is_one_error_line(tmp_path, capsys):
    code, out = _cli(capsys, "status", str(tmp_path))
    assert code != 0 and out.strip().startswith("error:") and len(out.strip().splitlines()) == 1


def test_engines_add_and_remove_change_the_fleet(control, tmp_path, capsys):
    _, fleet = control
    code, out = _cli(capsys, "engines", "add", str(tmp_path))
    assert code == 0 and "added http://127.0.0.1:9002" in out
    code, out = _cli(capsys, "engines", "remove", str(tmp_path), "http://127.0.0.1:9001")
    assert code == 0 and fleet.urls == ["http://127.0.0.1:9002"]
    code, out = _cli(capsys, "engines", "remove", str(tmp_path), "http://127.0.0.1:9001")
    assert code != 0 and "error: no engine server http://127.0.0.1:9001" in out
    code, out = _cli(capsys, "engines", "add", str(tmp_path), "ftp://elsewhere")
    assert code != 0 and "error: url must be an http(s) URL" in out
