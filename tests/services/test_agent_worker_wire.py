"""What crosses between a rollout worker and the run: the episode as the agent left it."""

from __future__ import annotations

import pickle

import numpy as np

from areal_sdk.rollout import RolloutController, StoreSessions
from areal_sdk.services.agent_worker import apply_outcome, context_of, outcome_of, request_of
from areal_sdk.tracing import EpisodeContext
from areal_sdk.trajectory import Episode


def round_trip(result, change=lambda ctx: None):
    """The parent's context, sent to a 'worker' and back through pickle, as the pool does."""
    parent = EpisodeContext(
        Episode(task_id="t1", group_id="g", metadata={"attempt": 0}),
        "agent",
        base_url="http://127.0.0.1:1",
        api_key="key",
    )
    request = pickle.loads(pickle.dumps(request_of({"id": "t1"}, parent, {"k": 1}, 5.0)))
    worker = context_of(request)
    assert (worker.id, worker.api_key, request["agent_kwargs"]) == (parent.id, "key", {"k": 1})
    change(worker)
    outcome = pickle.loads(pickle.dumps(outcome_of(result, None, worker)))
    return parent, apply_outcome(parent, outcome)


def test_what_the_agent_set_on_its_episode_comes_back():
    def change(ctx):
        ctx.name = "solve"
        ctx.explicit_reward = 0.25
        ctx.turn_rewards["turn-1"] = 1.0
        ctx.episode.metadata["note"] = {"tool": object()}  # kept as its repr

    parent, (result, error) = round_trip(np.float64(0.5), change)
    assert result == 0.5 and type(result) is float and error is None
    assert parent.name == "solve" and parent.explicit_reward == 0.25
    assert parent.turn_rewards == {"turn-1": 1.0}
    assert parent.episode.metadata["attempt"] == 0
    assert parent.episode.metadata["note"]["tool"].startswith("<object object")


def test_a_return_value_that_is_no_reward_fails_with_its_type_named(tmp_path):
    parent, (result, error) = round_trip({"answer": 4})
    controller = RolloutController(lambda task: None, StoreSessions(None))
    controller._finalize(parent, {"id": "t1"}, result, error)
    assert parent.episode.status == "failed"
    assert parent.episode.error.startswith("the agent returned a dict, not a reward")
