import pytest

from areal_sdk.plugin_host import PluginHost


@pytest.fixture(scope="module")
def host():
    return PluginHost()


def test_builtin_rewards_are_registered_through_the_entry_point(host):
    names = host.reward_functions()
    assert {"numeric_match", "gsm8k", "exact_match", "answer_tag"} <= set(names)
    record = next(r for r in host.plugins() if r.name == "builtin_rewards")
    assert record.source.endswith("(built-in)") and record.status.usable


@pytest.mark.parametrize(
    "completion, score",
    [
        ("She pays 3 * 6 = 18 dollars.\n#### 18", 1.0),
        ("The answer is \\boxed{18}.", 1.0),
        ("so 17 then 1,018... no: 18", 1.0),
        ("#### 19", 0.0),
        ("no number here", 0.0),
    ],
)
def test_gsm8k_final_answer_match(host, completion, score):
    task = {"question": "?", "answer": "Each costs 6.\n#### 18"}
    assert host.reward_function("gsm8k")(completion, task) == score


def test_strict_answer_tag_rejects_loose_formats(host):
    fn = host.reward_function("answer_tag")
    assert fn("<answer>42</answer>", {"answer": "42"}) == 1.0
    assert fn("I think <answer>42</answer>", {"answer": "42"}) == 0.0
    assert fn("42", {"answer": "42"}) == 0.0
    assert host.reward_function("exact_match")(" Paris ", {"answer": "Paris"}) == 1.0
