"""The SGLang backend: a client of SGLang's native HTTP API over one or many servers.

``SGLangBackend`` (``backend.py``) serves generation, pauses and weight updates;
``SGLangLauncher`` (``launcher.py``) starts servers from config; ``SGLangBroadcastSync``
(``weight_sync.py``) pushes trainer weights over SGLang's weight-update group, and
``SGLangTensorSync`` (``tensor_sync.py``) as CUDA IPC handles to colocated servers. The same
client drives the embedded engine, which serves the same routes. See docs/sglang.md.
"""

from areal_sdk.backends.sglang.backend import SGLangBackend
from areal_sdk.backends.sglang.client import (
    ServerClient,
    ServerUnavailable,
    SGLangError,
    SGLangInputError,
)
from areal_sdk.backends.sglang.launcher import LaunchError, SGLangLauncher
from areal_sdk.backends.sglang.pool import NoServerLeft

__all__ = [
    "LaunchError",
    "NoServerLeft",
    "SGLangBackend",
    "SGLangError",
    "SGLangInputError",
    "SGLangLauncher",
    "ServerClient",
    "ServerUnavailable",
]
