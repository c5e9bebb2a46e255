"""``areal-sdk serve``: the inference engine and the gateway, for agents run by hand.

``areal-sdk serve --model MODEL [--port P]`` starts the embedded engine in this process and
the gateway in front of it; ``areal-sdk serve CONFIG [key=value ...]`` takes the model and the
inference section from a config. It prints the base URL and the admin key (taken from
``AREAL_SDK_ADMIN_TOKEN`` when set, else generated). Episodes ended through
``/rl/sessions/{id}/end`` are stored under the run id ``serve`` in serve's own run directory,
``--run-dir`` (default ``runs/serve``): never in the config's ``run.dir``, which belongs to a
training run. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from areal_sdk.cli._common import fail

ADMIN_ENV = "AREAL_SDK_ADMIN_TOKEN"
ADMIN_ENV_ALIASES = ("AREAL_ADMIN_KEY",)
DEFAULT_PORT = 8321
DEFAULT_RUN_DIR = "runs/serve"
SERVE_RUN_ID = "serve"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the policy behind the OpenAI/Anthropic-compatible gateway",
        description=(
            "Start the inference engine and the gateway (OpenAI /v1/chat/completions, "
            "/v1/responses, /v1/completions, Anthropic /v1/messages, sessions under "
            "/rl/sessions). Give --model, or a CONFIG file."
        ),
    )
    parser.add_argument(
        "config", nargs="?", help="a run config (YAML); its model and inference sections are used"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. inference.port=9000",
    )
    parser.add_argument(
        "--model",
        help=(
            "local HF dir (a run's checkpoint runs/NAME/checkpoints/step-N is one), .gguf "
            "file, or registry name (instead of CONFIG)"
        ),
    )
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port (default {DEFAULT_PORT} with --model, inference.port with a config; 0 picks a free one)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context per request, in tokens"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="concurrent requests in the engine"
    )
    parser.add_argument(
        "--tool-parser",
        default=None,
        help="a registered tool-call parser (default: from the chat template)",
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help=f"where ended episodes are stored (default {DEFAULT_RUN_DIR}; a config's "
        "run.dir is a training run's and is not used)",
    )
    parser.set_defaults(func=run)


def _admin_token() -> tuple[str, str | None]:
    """The admin token and the variable it came from (None when generated)."""
    for name in (ADMIN_ENV, *ADMIN_ENV_ALIASES):
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    return "sk-areal-admin-" + secrets.token_urlsafe(24), None


def _settings(args: argparse.Namespace):
    """A Config from CONFIG (+ overrides) or from the flags alone, flags winning."""
    from areal_sdk.config import load_config

    if args.config is None and args.model is None:
        raise ValueError("give --model MODEL or a CONFIG file")
    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        raise ValueError(f"{args.config!r} looks like an override; give the CONFIG file first")
    cfg = load_config(args.config, list(args.overrides))
    flags = {
        "model.path": args.model,
        "inference.host": args.host,
        "inference.device": args.device,
        "model.dtype": args.dtype,
        "inference.max_model_len": args.max_model_len,
        "inference.max_batch_size": args.max_batch_size,
        "inference.tool_parser": args.tool_parser,
        # Serve's own directory: a training run's store only when the user names it.
        "run.dir": args.run_dir or DEFAULT_RUN_DIR,
    }
    if args.model is not None:
        cfg.model.name = None
        flags["inference.port"] = DEFAULT_PORT if args.port is None else args.port
    elif args.port is not None:
        flags["inference.port"] = args.port
    for key, value in flags.items():
        if value is not None:
            section, field = key.split(".")
            setattr(getattr(cfg, section), field, value)
    return cfg


def _backend(cfg):
    """The embedded engine in this process, or another registered backend by name."""
    if cfg.inference.backend != "embedded":
        from areal_sdk.plugin_host import get_host

        return get_host().inference_backend(cfg.inference.backend)(cfg)
    from areal_sdk.backends.embedded import EmbeddedEngine, EngineConfig
    from areal_sdk.compute_threads import call_in_fresh_thread

    model = cfg.model.path or cfg.model.name
    if model is None:
        raise ValueError(
            "the config names no model: set model.path or model.name (or pass --model)"
        )
    # On a thread that exits, so this one keeps no OpenMP team (areal_sdk/compute_threads.py).
    return call_in_fresh_thread(
        EmbeddedEngine.from_pretrained,
        model,
        device=cfg.inference.device,
        dtype=cfg.model.dtype,
        tokenizer=cfg.model.tokenizer,
        model_name=cfg.model.served_name if cfg.model.served_name != "policy" else None,
        config=EngineConfig(
            max_batch_size=cfg.inference.max_batch_size, max_model_len=cfg.inference.max_model_len
        ),
    )


def run(args: argparse.Namespace) -> int:
    from areal_sdk.config import ConfigError

    try:
        cfg = _settings(args)
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    import uvicorn

    from areal_sdk.gateway import create_app
    from areal_sdk.models import ModelNotFoundError
    from areal_sdk.server_thread import bind_tcp
    from areal_sdk.store import TrajectoryStore
    from areal_sdk.trajectory_export import record_run_config

    try:
        backend = _backend(cfg)
    except (ModelNotFoundError, ValueError, OSError) as exc:
        return fail(str(exc))
    admin, source = _admin_token()
    try:
        store = TrajectoryStore(cfg.run.dir, run_id=SERVE_RUN_ID)
        note = record_run_config(cfg)
    except OSError as exc:
        return fail(f"cannot use {cfg.run.dir} as the run directory: {exc}")
    try:
        app = create_app(
            backend,
            backend.tokenizer,
            admin_token=admin,
            episode_sink=store,
            tool_parser=cfg.inference.tool_parser,
            max_model_len=cfg.inference.max_model_len,
            default_max_tokens=cfg.inference.max_new_tokens,
            session_idle_timeout_s=cfg.inference.session_idle_timeout_s,
        )
    except ValueError as exc:
        return fail(str(exc))
    host = cfg.inference.host
    try:
        sock = bind_tcp(host, cfg.inference.port)
    except OSError as exc:
        return fail(f"cannot bind {host}:{cfg.inference.port}: {exc}")
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    print(f"model:     {backend.model_name}")
    print(f"gateway:   {base}   (OpenAI base_url {base}/v1, Anthropic base_url {base})")
    print(f"admin key: {admin if source is None else f'(from ${source})'}")
    print(f"episodes:  {store.path}")
    if note:
        print(f"note:      {note}")
    print(f"new episode: curl -X POST {base}/rl/sessions -H 'Authorization: Bearer <admin key>'")
    sys.stdout.flush()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    try:
        server.run(sockets=[sock])
    finally:
        store.close()
    return 0
