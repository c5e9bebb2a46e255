"""The gateway: OpenAI- and Anthropic-compatible HTTP routes over an ``InferenceBackend``,
recording every call token-exactly into its episode.

>>> from areal_sdk.gateway import create_app   # doctest: +SKIP
"""

from areal_sdk.gateway.app import create_app

__all__ = ["create_app"]
