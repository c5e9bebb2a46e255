"""The gateway: OpenAI- and Anthropic-compatible HTTP routes over an ``InferenceBackend``,
recording every call token-exactly into its episode.

>>> from areal_sdk.gateway import create_app, GatewayServer   # doctest: +SKIP
"""

from areal_sdk.gateway.app import create_app
from areal_sdk.gateway.server import GatewayServer

__all__ = ["GatewayServer", "create_app"]
