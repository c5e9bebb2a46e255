"""The quickstart and GSM8K examples: valid configs, loadable agents, and the quickstart's
own config driving a short real run (the tiny model standing in for SmolLM2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from areal_sdk.config import load_config
from areal_sdk.plugin_host import get_host
from areal_sdk.tasks import load_agent, load_tasks
from areal_sdk.training_run import TrainingRun

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = [
    EXAMPLES / "quickstart" / "config.yaml",
    EXAMPLES / "gsm8k" / "config.yaml",
    EXAMPLES / "gsm8k" / "config.deepspeed.yaml",
    EXAMPLES / "gsm8k" / "config.gpu.yaml",
]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_loads_its_agent_and_reward(path, monkeypatch, request):
    monkeypatch.setenv("OPENAI_API_KEY", "unused")  # the agents build a client at import
    if path.parent.name == "gsm8k":
        request.getfixturevalue("gsm8k_dir")  # skips where the shared data is absent
    cfg = load_config(path)
    agent = load_agent(cfg.agent.entry, search_path=path.parent)
    assert hasattr(agent, "__areal_trace__")
    assert load_tasks(cfg.data.path) and load_tasks(cfg.data.eval_path)
    if cfg.agent.reward:
        assert cfg.agent.reward in get_host().reward_functions()
    assert cfg.rollout.batch_size % cfg.rollout.group_size == 0


def test_gsm8k_reward_reads_the_final_answer(gsm8k_dir):
    reward = get_host().reward_function("gsm8k")
    task = load_tasks(gsm8k_dir / "train.jsonl", limit=1)[0]  # "... #### 72"
    assert reward("48 + 24 = 72\n#### 72", task) == 1.0
    assert reward("#### 71", task) == 0.0


def test_quickstart_score_is_strict(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    from examples.quickstart.agent import score

    assert score("<answer>27</answer>", "27") == 1.0
    assert score(" <answer> 27 </answer>\n", "27") == 1.0
    assert score("The answer is <answer>27</answer>", "27") == 0.0
    assert score("<answer>26</answer>", "27") == 0.0
    assert score("27", "27") == 0.0


def test_quickstart_config_runs_two_steps(tiny_model_dir, tmp_path):
    cfg = load_config(
        CONFIGS[0],
        [
            "model.name=null",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'run'}",
            "run.steps=2",
            "rollout.batch_size=8",
            "rollout.group_size=4",
            "data.eval_limit=4",
            "eval.samples=1",
            "algorithm.dynamic_filter=false",  # a random tiny model rarely scores
            "run.metric_sinks=[jsonl]",
            # The tiny model's tokenizer spells the few-shot prompt in more tokens than
            # SmolLM2's, for which the config's 128 are sized.
            "inference.max_model_len=512",
        ],
    )
    result = asyncio.run(TrainingRun(cfg, config_dir=CONFIGS[0].parent).run())
    assert result.steps == 2 and result.after is not None and result.after.episodes == 4


@pytest.mark.timeout(300)
def test_a_run_whose_every_episode_fails_stops_with_the_error(tiny_model_dir, tmp_path):
    """The quickstart's 128-token context is too short for the tiny model's longer spelling
    of its prompts: every call is refused. The run stops naming why, rather than starting
    new groups forever."""
    from areal_sdk.trainer import TrainingError

    cfg = load_config(
        CONFIGS[0],
        [
            "model.name=null",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path / 'run'}",
            "run.steps=2",
            "eval.before=false",
            "eval.after=false",
            "run.metric_sinks=[jsonl]",
        ],
    )
    with pytest.raises(TrainingError, match="every episode of the last 8 groups failed"):
        asyncio.run(TrainingRun(cfg, config_dir=CONFIGS[0].parent).run())
