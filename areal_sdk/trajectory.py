"""Trajectory types: one ``Episode`` per agent call on one task, one ``Turn`` per completion.

Ids are the ids the engine consumed and sampled, never re-tokenized text. ``logprobs`` and
``versions`` are aligned with ``completion_ids``: ``versions[i]`` is the weight version that
sampled token ``i``.

>>> turn = Turn(api="openai.chat", prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1], versions=[0])
>>> Episode(task_id="t0", turns=[turn]).model_dump_json() != ""
True
"""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

TurnApi = Literal["openai.chat", "openai.responses", "openai.completions", "anthropic.messages"]


def new_id(prefix: str) -> str:
    """A random, unguessable id with a readable prefix (``ep-1f3a...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class EpisodeStatus(StrEnum):
    OK = "ok"
    FAILED = "failed"
    TRUNCATED = "truncated"


class Turn(BaseModel):
    """One LLM completion inside an episode, token-exact."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: new_id("turn"))
    api: TurnApi
    request: dict[str, Any] = Field(default_factory=dict)
    prompt_ids: list[StrictInt]
    completion_ids: list[StrictInt]
    logprobs: list[float]
    versions: list[StrictInt]
    finish_reason: str | None = None
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> Turn:
        n = len(self.completion_ids)
        if len(self.logprobs) != n:
            raise ValueError(
                f"turn {self.id}: logprobs has {len(self.logprobs)} entries but completion_ids "
                f"has {n}; they must be aligned token for token"
            )
        if len(self.versions) != n:
            raise ValueError(
                f"turn {self.id}: versions has {len(self.versions)} entries but completion_ids "
                f"has {n}; they must be aligned token for token"
            )
        return self


class Episode(BaseModel):
    """The record of one agent call on one task: its turns, reward and outcome."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: new_id("ep"))
    task_id: str
    group_id: str | None = None
    status: EpisodeStatus = EpisodeStatus.OK
    reward: float | None = None
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    started: float = Field(default_factory=time.time)
    ended: float | None = None
    turns: list[Turn] = Field(default_factory=list)

    @property
    def min_version(self) -> int | None:
        """The oldest weight version that sampled any token of this episode."""
        versions = [v for t in self.turns for v in t.versions]
        return min(versions) if versions else None

    @property
    def max_version(self) -> int | None:
        versions = [v for t in self.turns for v in t.versions]
        return max(versions) if versions else None

    @property
    def num_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Episode:
        return cls.model_validate_json(text)
