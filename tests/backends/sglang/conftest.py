from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from areal_sdk.backends.embedded import EmbeddedEngine
from areal_sdk.backends.sglang import SGLangBackend

from areal_sdk.config import Config
from areal_sdk.plugin_host import get_host
from tests.backends.embedded.conftest import engine_server, make_engine

# A stand-in for SGLang's `python -m sglang.launch_server` (which cannot run on these
# machines): it serves the embedded engine, which speaks SGLang's routes, on the given port.
FAKE_LAUNCH_SERVER = """
import argparse

import uvicorn
from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig
from areal_sdk.backends.embedded.server import create_app

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--base-gpu-id", type=int, default=0)
args, _ = parser.parse_known_args()
print("fake sglang.launch_server", vars(args), flush=True)
engine = EmbeddedEngine.from_pretrained(
    args.model_path,
    dtype="float32",
    config=EngineConfig(max_batch_size=8, max_model_len=256, prefill_chunk=64),
)
uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")
"""


def launching_config(model_dir: Path, run_dir: Path, **inference: object) -> Config:
    """A config that launches two (fake) SGLang servers and pushes weights by broadcast."""
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "inference": {
                "backend": "sglang",
                "sglang_python": sys.executable,
                "sglang_servers": 2,
                "launch_timeout_s": 120,
                **inference,
            },
            "weights": {"method": "broadcast", "timeout_s": 60},
            "run": {"dir": str(run_dir)},
        }
    )


@contextlib.contextmanager
def launched_servers(cfg: Config, fake_sglang_path: Path) -> Iterator[SGLangBackend]:
    """The SGLang backend of ``cfg`` with its servers launched; closed after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(fake_sglang_path))
        mp.setenv("OMP_NUM_THREADS", "1")
        backend = get_host().inference_backend("sglang")(cfg)
    try:
        yield backend
    finally:
        asyncio.run(backend.close())


@pytest.fixture(scope="session")
def fake_sglang_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a fake ``sglang`` package, for PYTHONPATH (a mock of SGLang)."""
    root = tmp_path_factory.mktemp("fake-sglang")
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("")
    (root / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return root


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[list[tuple[str, object]]]:
    """Two real embedded engines behind real HTTP servers on loopback."""
    started = []
    try:
        for _ in range(2):
            engine = make_engine(tiny_model_dir)
            srv = engine_server(engine)
            srv.start()
            started.append((srv, engine))
        yield [(srv.url, eng) for srv, eng in started]
    finally:
        for srv, _ in started:
            srv.stop()


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[str, EmbeddedEngine]]:
    """One embedded engine behind its SGLang routes, for a test of its own."""
    engine = make_engine(tiny_model_dir)
    with engine_server(engine) as srv:
        yield srv.url, engine


@pytest.fixture
async def backend(served: tuple[str, EmbeddedEngine]) -> AsyncIterator[SGLangBackend]:
    """An SGLang backend attached to ``served``."""
    b = SGLangBackend([served[0]], timeout_s=60, retries=1)
    b.connect()
    yield b
    await b.close()
