import pytest
from pydantic import ValidationError

from areal_sdk.trajectory import Episode, EpisodeStatus, Turn


def make_turn(**kw):
    base = dict(
        api="openai.chat",
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.5, -1.0],
        versions=[0, 1],
    )
    base.update(kw)
    return Turn(**base)


def test_episode_json_round_trip_keeps_every_field():
    ep = Episode(
        task_id="t1",
        group_id="g1",
        reward=0.5,
        metadata={"agent": "solve"},
        turns=[
            make_turn(
                request={"messages": [{"role": "user", "content": "hi"}]}, finish_reason="stop"
            )
        ],
    )
    again = Episode.from_json(ep.to_json())
    assert again == ep
    assert again.turns[0].request["messages"][0]["content"] == "hi"
    assert again.status is EpisodeStatus.OK


def test_logprobs_length_must_match_completion():
    with pytest.raises(ValidationError, match="logprobs has 1 entries but completion_ids has 2"):
        make_turn(logprobs=[-0.5])


def test_versions_length_must_match_completion():
    with pytest.raises(ValidationError, match="versions has 3 entries"):
        make_turn(versions=[0, 0, 0])


@pytest.mark.parametrize("bad", [[1.5, 2], ["3", 4], [True, 2]])
def test_ids_must_be_ints(bad):
    with pytest.raises(ValidationError, match="completion_ids"):
        make_turn(completion_ids=bad)


def test_unknown_api_and_unknown_field_are_rejected():
    with pytest.raises(ValidationError, match="api"):
        make_turn(api="cohere.chat")
    with pytest.raises(ValidationError, match="extra"):
        Episode(task_id="t", bogus=1)


def test_episode_version_range():
    ep = Episode(task_id="t", turns=[make_turn(versions=[3, 4]), make_turn(versions=[2, 5])])
    assert (ep.min_version, ep.max_version, ep.num_tokens) == (2, 5, 4)
    assert Episode(task_id="t").min_version is None
