"""areal-sdk: train an existing LLM agent with asynchronous reinforcement learning.

>>> import areal_sdk as areal
>>> @areal.trace
... def agent(task) -> float:
...     return 1.0
"""

from areal_sdk.hookspecs import hookimpl
from areal_sdk.tracing import (
    EpisodeContext,
    RolloutScope,
    bind,
    current_episode,
    reward,
    rollout_scope,
    trace,
)
from areal_sdk.trajectory import Episode, EpisodeStatus, Turn

__version__ = "0.1.0"

__all__ = [
    "Episode",
    "EpisodeContext",
    "EpisodeStatus",
    "RolloutScope",
    "Turn",
    "__version__",
    "bind",
    "current_episode",
    "hookimpl",
    "reward",
    "rollout_scope",
    "trace",
]
