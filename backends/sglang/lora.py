"""LoRA adapters into SGLang servers (``train.lora`` with the ``sglang`` backend).

SGLang serves LoRA adapters beside the base model (``--enable-lora``), so a weight push moves
the adapter, a few MB, instead of the whole model: the trainer writes it in PEFT's layout
(``save_pretrained``) into ``<weights.dir>/v<version>/``, every server loads it by
``POST /load_lora_adapter {"lora_name": "v<version>", "lora_path": <dir>}``, the backend names
it in every later ``/generate`` (``"lora_path": "v<version>"``), the servers' weight version
becomes ``version`` and the previous adapter is unloaded. The directory must be readable by
the servers (a shared path, as for ``weights.method: disk``).

``lora_server_args`` gives the ``sglang.launch_server`` flags a launched server needs to
accept such adapters (the rank and the target modules cannot grow after start).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from areal_sdk.backends.weight_sync.base import NamedTensors, SyncResult, WeightSync
from areal_sdk.backends.weight_sync.disk import cleanup_versions, version_dir

if TYPE_CHECKING:
    from areal_sdk.backends.sglang.backend import SGLangBackend

    from areal_sdk.config import Config, LoraConfig


def adapter_name(version: int) -> str:
    """The name a version's adapter is loaded under, and requests name it by."""
    return f"v{int(version)}"


def lora_server_args(lora: LoraConfig | None, given: list[str]) -> list[str]:
    """``sglang.launch_server`` flags for serving ``train.lora``'s adapters, except those the
    user already gave in ``inference.sglang_args``."""
    if lora is None:
        return []
    targets = lora.target_modules
    wanted = {
        "--enable-lora": [],
        "--max-lora-rank": [str(lora.r)],
        "--lora-target-modules": ["all"] if targets == "all-linear" else list(targets),
    }
    if isinstance(targets, str) and targets != "all-linear":
        del wanted["--lora-target-modules"]  # a regular expression: SGLang wants names
    args: list[str] = []
    for flag, values in wanted.items():
        if flag not in given:
            args += [flag, *values]
    return args


class SGLangLoraSync(WeightSync):
    """Pushes the trainer's LoRA adapter to every SGLang server as a new version."""

    method = "sglang_lora"
    takes_adapter: ClassVar[bool] = True

    def __init__(
        self,
        backend: SGLangBackend,
        directory: str | Path,
        *,
        keep_last: int = 2,
        timeout_s: float = 120.0,
        trainer_rank: int = 0,
    ) -> None:
        super().__init__(timeout_s=timeout_s, trainer_rank=trainer_rank)
        self.backend = backend
        self.directory = Path(directory)
        self.keep_last = keep_last

    @classmethod
    def from_config(
        cls, backend: SGLangBackend, config: Config, *, trainer_rank: int = 0, **overrides: Any
    ) -> SGLangLoraSync:
        w = config.weights
        args: dict[str, Any] = {
            "keep_last": w.keep_last,
            "timeout_s": w.timeout_s,
            "trainer_rank": trainer_rank,
            **overrides,
        }
        directory = args.pop("directory", w.dir or str(Path(config.run.dir) / "weights"))
        return cls(backend, directory, **args)

    async def push_adapter(self, write: Callable[[Path], Path], version: int) -> SyncResult | None:
        """``write(dir)`` the adapter (every rank: a collective under ZeRO-3), then load it on
        every server as ``version`` and route requests to it."""
        import time

        start = time.perf_counter()
        path = version_dir(self.directory, version).resolve()
        await asyncio.to_thread(write, path)
        if self.trainer_rank != 0:
            return None
        name = adapter_name(version)
        peer = f"SGLang servers {', '.join(s.url for s in self.backend.pool.live)}"
        previous = self.backend.lora_name
        body = {"lora_name": name, "lora_path": str(path)}
        try:
            await asyncio.wait_for(
                self.backend.fan_out_post("/load_lora_adapter", body), self.timeout_s
            )
            self.backend.lora_name = name
            await self.backend.set_version(version)
        except TimeoutError:
            raise self._fail(version, peer, f"no answer within {self.timeout_s:g} s") from None
        except Exception as exc:
            raise self._fail(version, peer, f"loading adapter {path} failed: {exc}") from exc
        if previous is not None and previous != name:
            await self.backend.fan_out_post(
                "/unload_lora_adapter", {"lora_name": previous}, strict=False
            )
        cleanup_versions(self.directory, self.keep_last, keep=[path])
        files = [p for p in path.iterdir() if p.is_file()]
        nbytes = sum(p.stat().st_size for p in files)
        return SyncResult(self.method, version, len(files), nbytes, time.perf_counter() - start)

    async def _push(self, state: Iterable[NamedTensors], version: int) -> tuple[int, int]:
        raise self._fail(
            version,
            "SGLang",
            "a LoRA run pushes its adapter (push_adapter), not whole weights",
        )
