"""A real gateway on 127.0.0.1 over the real embedded engine with the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

from areal_sdk.gateway import create_app
from areal_sdk.plugin_host import PluginHost
from areal_sdk.server_thread import ServerThread
from areal_sdk.store import TrajectoryStore

ADMIN = "test-admin-token"


def gateway_host() -> PluginHost:
    """The plugin host, with the gateway's parsers (registered by entry point once installed)."""
    host = PluginHost()
    if "hermes" not in host.tool_call_parsers():
        from areal_sdk.gateway import plugin

        host.register(plugin, "gateway")
    return host


@dataclass
class Gateway:
    base_url: str
    admin: str
    store: TrajectoryStore
    app: object

    def open_session(self, **body: object) -> tuple[str, str]:
        r = httpx.post(
            f"{self.base_url}/rl/sessions",
            json=body or None,
            headers={"Authorization": f"Bearer {self.admin}"},
        )
        r.raise_for_status()
        return r.json()["id"], r.json()["api_key"]

    def end(self, episode_id: str, **body: object) -> httpx.Response:
        return httpx.post(
            f"{self.base_url}/rl/sessions/{episode_id}/end",
            json=body or None,
            headers={"Authorization": f"Bearer {self.admin}"},
        )

    def episode(self, episode_id: str) -> dict:
        r = httpx.get(
            f"{self.base_url}/rl/sessions/{episode_id}",
            headers={"Authorization": f"Bearer {self.admin}"},
        )
        r.raise_for_status()
        return r.json()


def serve(engine: EmbeddedEngine, tmp_path: Path, **kwargs: object) -> Iterator[Gateway]:
    store = TrajectoryStore(tmp_path / "store")
    app = create_app(
        engine,
        engine.tokenizer,
        admin_token=ADMIN,
        episode_sink=store,
        host=gateway_host(),
        **kwargs,
    )
    with ServerThread(app, name="gateway") as server:
        yield Gateway(server.url, ADMIN, store, app)
    store.close()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine.from_pretrained(
        str(tiny_model_dir), config=EngineConfig(max_batch_size=8, max_model_len=1024)
    )
    yield eng
    import asyncio

    asyncio.run(eng.close())


@pytest.fixture
def gateway(engine: EmbeddedEngine, tmp_path: Path) -> Iterator[Gateway]:
    yield from serve(engine, tmp_path, max_model_len=1024, default_max_tokens=16)


@pytest.fixture(scope="session")
def tool_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedEngine]:
    """The tiny model fitted to call the ``add`` tool (tests/gateway/tool_model.py)."""
    from tests.gateway.tool_model import fit_tool_model

    path = fit_tool_model(tiny_model_dir, tmp_path_factory.mktemp("tool-model"))
    eng = EmbeddedEngine.from_pretrained(
        str(path), config=EngineConfig(max_batch_size=4, max_model_len=1024)
    )
    yield eng
    import asyncio

    asyncio.run(eng.close())


@pytest.fixture
def tool_gateway(tool_engine: EmbeddedEngine, tmp_path: Path) -> Iterator[Gateway]:
    yield from serve(tool_engine, tmp_path, max_model_len=1024, default_max_tokens=64)


@pytest.fixture(scope="session")
def reply_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedEngine]:
    """The tiny model fitted to answer and stop on its EOS (tests/gateway/reply_model.py)."""
    from tests.gateway.reply_model import fit_reply_model

    path = fit_reply_model(tiny_model_dir, tmp_path_factory.mktemp("reply-model"))
    eng = EmbeddedEngine.from_pretrained(
        str(path), config=EngineConfig(max_batch_size=4, max_model_len=256)
    )
    yield eng
    import asyncio

    asyncio.run(eng.close())


@pytest.fixture
def reply_gateway(reply_engine: EmbeddedEngine, tmp_path: Path) -> Iterator[Gateway]:
    yield from serve(reply_engine, tmp_path, default_max_tokens=32)
