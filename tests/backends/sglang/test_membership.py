"""Servers joining and leaving an ``SGLangBackend`` while requests run, over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from areal_sdk.backends.sglang import NoServerLeft, SGLangBackend
from areal_sdk.backends.sglang.client import SGLangInputError

from areal_sdk.inference import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 3, 250, 12]
LONG = SamplingParams(max_new_tokens=48, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=2, ignore_eos=True)


@pytest.fixture
async def one(servers) -> AsyncIterator[SGLangBackend]:
    """A backend over the first server only; the second is there to join."""
    b = SGLangBackend([servers[0][0]], timeout_s=60, retries=1)
    b.connect()
    yield b
    await b.close()


async def test_a_joining_server_takes_new_episodes_and_old_ones_stay(one, servers) -> None:
    first, second = servers[0][0], servers[1][0]
    before = await one.generate(PROMPT, SHORT, request_id="old:0")
    one.add_server(second)
    assert [(s["url"], s["alive"]) for s in one.servers()] == [(first, True), (second, True)]
    outs = await asyncio.gather(
        *(one.generate(PROMPT, LONG, request_id=f"new{i}:0") for i in range(4)),
        one.generate(PROMPT, SHORT, request_id="old:1"),
    )
    assert {o.meta["server"] for o in outs[:4]} == {first, second}
    assert outs[4].meta["server"] == before.meta["server"] == first


async def test_a_leaving_server_finishes_its_requests_and_its_episodes_move(one, servers) -> None:
    first, second = servers[0][0], servers[1][0]
    one.add_server(second)
    running = [
        asyncio.create_task(one.generate(PROMPT, LONG, request_id=f"ep{i}:0")) for i in range(4)
    ]
    while not all(s["in_flight"] for s in one.servers()):
        await asyncio.sleep(0.01)
    one.remove_server(second)
    assert [s["url"] for s in one.servers()] == [first]
    outs = await asyncio.gather(*running)  # the requests on the leaving server finish
    assert {o.meta["server"] for o in outs} == {first, second}
    assert all(len(o.output_ids) == LONG.max_new_tokens for o in outs)
    later = await asyncio.gather(
        *(one.generate(PROMPT, SHORT, request_id=f"ep{i}:1") for i in range(4))
    )
    assert {o.meta["server"] for o in later} == {first}


async def test_set_servers_replaces_the_members_at_a_version(one, servers) -> None:
    first, second = servers[0][0], servers[1][0]
    one.set_servers([second], 0)
    assert [s["url"] for s in one.servers()] == [second] and one.version == 0
    out = await one.generate(PROMPT, SHORT, request_id="a:0")
    assert out.meta["server"] == second
    one.set_servers([], 0)
    with pytest.raises(NoServerLeft):
        await one.generate(PROMPT, SHORT)
    one.set_servers([first, second], 0)
    assert all(s["alive"] for s in one.servers()) and len(one.servers()) == 2


async def test_a_refused_request_fails_alone_and_the_server_stays(one, servers) -> None:
    with pytest.raises(SGLangInputError):
        await one.generate([10**9], SHORT)  # not a token id: the server answers 400
    assert [s["alive"] for s in one.servers()] == [True]
    assert (await one.generate(PROMPT, SHORT)).output_ids
