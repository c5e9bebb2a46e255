"""``areal-sdk config show CONFIG [KEY=VALUE ...]``: the resolved config."""

from __future__ import annotations

import argparse

from areal_sdk.cli._common import add_config_arguments, fail


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="inspect a run config")
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the config with defaults filled in and overrides applied",
        description="Validate CONFIG, apply overrides, and print the resolved YAML.",
    )
    add_config_arguments(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.set_defaults(func=show_config)


def show_config(args: argparse.Namespace) -> int:
    from areal_sdk.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return fail(str(exc))
    print(
        cfg.model_dump_json(indent=2) if args.json else cfg.to_yaml(),
        end="" if not args.json else "\n",
    )
    return 0
