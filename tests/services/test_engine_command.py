"""What an engine server of the ``processes`` placement is started with: the config's engine
settings, as ``areal-sdk engine`` parses them."""

from __future__ import annotations

import argparse
from pathlib import Path

from areal_sdk.cli import engine as engine_cli
from areal_sdk.config import load_config
from areal_sdk.services.engine_fleet import EngineFleet, _Server
from areal_sdk.services.health import ServiceKind, ServiceState


def _parsed(fleet: EngineFleet, version: int) -> argparse.Namespace:
    member = _Server(state=ServiceState(kind=ServiceKind.ENGINE, name="engine-0"), port=30001)
    cmd = fleet.command(member, version=version)
    parser = argparse.ArgumentParser()
    engine_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(cmd[cmd.index("engine") :])


def test_engine_servers_get_the_configs_engine_settings(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "model.path=/models/policy",
            "model.tokenizer=/models/tokenizer",
            "inference.cuda_graphs=false",
            "inference.recompute_kv_on_update=false",
            "inference.reuse_prefixes=false",
            "inference.prefill_chunk=64",
            "inference.prompt_hold_steps=4",
            "inference.overlap_decode=false",
            f"run.dir={tmp_path}",
        ],
    )
    args = _parsed(EngineFleet(cfg, servers=1), version=3)
    assert (args.model, args.tokenizer, args.port) == ("/models/policy", "/models/tokenizer", 30001)
    assert args.cuda_graphs is False and args.recompute_kv_on_update is False
    assert args.reuse_prefixes is False and args.overlap_decode is False
    assert (args.prefill_chunk, args.prompt_hold_steps, args.weight_version) == (64, 4, 3)


def test_unset_settings_are_left_to_the_server(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.path=/m", f"run.dir={tmp_path}"])
    args = _parsed(EngineFleet(cfg, servers=1), version=0)
    # Graphs on for CUDA (the server's default), keys recomputed after an update.
    assert args.cuda_graphs is None and args.recompute_kv_on_update is True
    assert args.reuse_prefixes is True
    # Held prompts and overlapped steps: the server decides (on where decode graphs run).
    assert args.prompt_hold_steps is None and args.overlap_decode is None
    assert args.tokenizer is None
