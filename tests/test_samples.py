from areal_sdk.samples import NO_VERSION, MergeStats, build_batch_samples, build_samples
from areal_sdk.trajectory import Episode, Turn


def turn(prompt, completion, version=0):
    return Turn(
        api="openai.chat",
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.1 * (i + 1) for i in range(len(completion))],
        versions=[version] * len(completion),
    )


def test_one_sample_per_turn_without_merge():
    ep = Episode(task_id="t", reward=1.0, turns=[turn([1, 2], [3]), turn([1, 2, 3, 9], [4, 5])])
    samples = build_samples(ep, merge=False)
    assert [s.input_ids for s in samples] == [[1, 2, 3], [1, 2, 3, 9, 4, 5]]
    assert samples[1].loss_mask == [0, 0, 0, 0, 1, 1]
    assert all(s.reward == 1.0 for s in samples)


def test_prefix_extending_turns_merge_token_exactly():
    # turn 2's prompt = turn 1's prompt + completion + a tool result [7, 8]
    ep = Episode(
        task_id="t", reward=0.5, turns=[turn([1, 2], [3, 4], 0), turn([1, 2, 3, 4, 7, 8], [5], 1)]
    )
    stats = MergeStats()
    (sample,) = build_samples(ep, stats=stats)
    assert sample.input_ids == [1, 2, 3, 4, 7, 8, 5]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert sample.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.1]
    assert sample.versions == [NO_VERSION, NO_VERSION, 0, 0, NO_VERSION, NO_VERSION, 1]
    assert sample.turn_ids == [t.id for t in ep.turns]
    assert (stats.turns, stats.merged, stats.splits) == (2, 1, 0)
    assert sample.min_version == 0


def test_a_retokenized_history_is_split_and_counted():
    # turn 2 re-tokenized the assistant text differently: 3,4 became 34
    ep = Episode(
        task_id="t", turns=[turn([1, 2], [3, 4]), turn([1, 2, 34, 7], [5]), turn([1], [6])]
    )
    samples, stats = build_batch_samples([ep])
    assert len(samples) == 3
    assert stats.splits == 2
    assert stats.split_reasons == {
        "prompt_diverges_from_history": 1,
        "prompt_shorter_than_history": 1,
    }
    assert stats.as_metrics()["samples/merge_failures"] == 2.0


def test_turn_rewards_add_to_episode_reward():
    t1 = turn([1], [2])
    t1.reward = 0.25
    ep = Episode(task_id="t", reward=1.0, turns=[t1])
    assert build_samples(ep)[0].reward == 1.25
