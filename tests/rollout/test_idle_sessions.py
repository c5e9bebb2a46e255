"""``inference.session_idle_timeout_s``: a session that goes quiet is ended as a failed episode
with its turns, and the controller's later end of it reads that episode back."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from areal_sdk.config import load_config
from areal_sdk.launcher import LocalStack
from areal_sdk.plugin_host import PluginHost
from areal_sdk.store import StoreError, TrajectoryStore
from areal_sdk.tracing import EpisodeContext
from areal_sdk.trajectory import Episode, EpisodeStatus


@pytest.mark.slow
def test_an_idle_session_expires_as_a_failed_episode(tiny_model_dir, tmp_path, caplog):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "inference.max_new_tokens=4",
            "inference.session_idle_timeout_s=0.5",
        ],
    )
    host = PluginHost()
    if "embedded" not in host.inference_backends():
        from areal_sdk.backends.embedded import plugin as engine_plugin

        host.register(engine_plugin, "embedded")
    store = TrajectoryStore(tmp_path)

    async def go(stack: LocalStack) -> tuple[Episode, Episode]:
        sessions = stack.sessions("t")
        episode = Episode(task_id="quiet")
        key = await sessions.open(episode)
        async with AsyncOpenAI(base_url=stack.url + "/v1", api_key=key) as client:
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        for _ in range(600):  # the reaper runs a few times per idle timeout
            try:
                expired = store.get(episode.id)
                break
            except StoreError:
                await asyncio.sleep(0.1)
        ctx = EpisodeContext(episode=episode, name="agent", base_url=stack.url, api_key=key)
        episode.reward = 1.0
        return expired, await sessions.end(ctx)

    with LocalStack(cfg, store, host=host) as stack, caplog.at_level("WARNING"):
        expired, ended = asyncio.run(go(stack))
    assert expired.status == EpisodeStatus.FAILED and "idle for 0.5 s" in expired.error
    assert len(expired.turns) == 1 and expired.reward is None
    assert ended == expired  # what was stored stands, and the log says the reward is not used
    assert "the reward 1.0 given after that is not used" in caplog.text
    store.close()
