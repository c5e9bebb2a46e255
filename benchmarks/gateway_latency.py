"""What the gateway adds: latency over calling the engine directly, and many sessions at once.

1. Latency. The same chat prompt, greedy, exactly ``--max-tokens`` tokens (EOS ignored), one
   call at a time: ``engine.generate`` on the templated ids, then ``POST /v1/chat/completions``
   through the gateway on loopback (HTTP, auth, templating, decoding, recording the turn
   into its episode). Reports p50/p99 of both and their difference.
2. Sessions. ``--sessions`` episodes run concurrently, each: ``POST /rl/sessions``, one chat
   call, ``POST /rl/sessions/{id}/end`` (stored in a TrajectoryStore). Every call must
   succeed; reports failures, wall time and per-phase latency.

    python benchmarks/gateway_latency.py --calls 200 --sessions 1000 --max-tokens 4

Engine and gateway share one process (the gateway's uvicorn in a thread, as in
``areal-sdk serve``); the client runs in the main thread's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ADMIN = "bench-admin"
MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "Natalia sold clips to 48 of her friends in April. How many?"},
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "p50_ms": round(pct(ms, 50), 2),
        "p99_ms": round(pct(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


async def latency(engine, base_url: str, calls: int, max_tokens: int) -> dict:
    from areal_sdk.inference import SamplingParams

    ids = engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as http:
        r = await http.post("/rl/sessions", json={})
        key = r.json()["api_key"]
        session_headers = {"Authorization": f"Bearer {key}"}
        for _ in range(5):  # warm up both paths
            await engine.generate(ids, params)
            await http.post("/v1/chat/completions", json=body, headers=session_headers)
        direct, gateway = [], []
        for _ in range(calls):  # interleaved, so drift hits both alike
            t0 = time.perf_counter()
            out = await engine.generate(ids, params)
            direct.append(time.perf_counter() - t0)
            assert len(out.output_ids) == max_tokens
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=body, headers=session_headers)
            gateway.append(time.perf_counter() - t0)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
        await http.post(f"/rl/sessions/{r.headers['x-areal-episode-id']}/end")
    d, g = summary(direct), summary(gateway)
    return {
        "calls": calls,
        "engine": d,
        "gateway": g,
        "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 2),
        "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 2),
    }


async def sessions(base_url: str, n: int, max_tokens: int, connections: int) -> dict:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    phases: dict[str, list[float]] = {"open": [], "chat": [], "end": []}
    failures: list[str] = []
    body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True}

    async def timed(phase: str, call) -> httpx.Response:
        t0 = time.perf_counter()
        r = await call
        phases[phase].append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{phase}: {r.status_code} {r.text[:200]}")
        return r

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:

        async def one(i: int) -> None:
            try:
                r = await timed("open", http.post("/rl/sessions", json={}, headers=admin))
                eid, key = r.json()["id"], r.json()["api_key"]
                auth = {"Authorization": f"Bearer {key}"}
                await timed("chat", http.post("/v1/chat/completions", json=body, headers=auth))
                await timed("end", http.post(f"/rl/sessions/{eid}/end", headers=admin))
            except Exception as exc:
                failures.append(f"{i}: {type(exc).__name__}: {exc}"[:300])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {
        "sessions": n,
        "client_connections": connections,
        "failed": len(failures),
        "first_failures": failures[:3],
        "wall_s": round(wall, 2),
        "sessions_per_s": round(n / wall, 1),
        **{f"{k}_latency": summary(v) for k, v in phases.items() if v},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--connections", type=int, default=256, help="client connection pool")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig

    from areal_sdk.gateway import create_app
    from areal_sdk.server_thread import ServerThread
    from areal_sdk.store import TrajectoryStore
    from tests.gateway.conftest import gateway_host
    from tests.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    model = build_tiny_model(tmp / "tiny", None)
    engine = EmbeddedEngine.from_pretrained(
        str(model), config=EngineConfig(max_batch_size=args.max_batch_size, max_model_len=512)
    )
    store = TrajectoryStore(tmp / "store")
    app = create_app(engine, admin_token=ADMIN, episode_sink=store, host=gateway_host())
    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "model": "tiny (2-layer Qwen2, hidden 64, tests/tiny_model.py)",
        "max_tokens": args.max_tokens,
    }
    with ServerThread(app, name="gateway") as server:
        results["latency"] = asyncio.run(latency(engine, server.url, args.calls, args.max_tokens))
        print(json.dumps(results["latency"]), flush=True)
        results["concurrency"] = asyncio.run(
            sessions(server.url, args.sessions, args.max_tokens, args.connections)
        )
        print(json.dumps(results["concurrency"]), flush=True)
        results["episodes_stored"] = store.count()
    store.close()
    asyncio.run(engine.close())
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
