import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_sdk.config import Config, ConfigError, load_config, parse_override


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_yaml_sections(tmp_path):
    path = write(
        tmp_path,
        "model:\n  path: /m\nrollout:\n  group_size: 8\nalgorithm:\n  token_mask:\n    metric: ratio\n    upper: 2.0\n",
    )
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.model.path == "/m" and cfg.rollout.group_size == 8
    assert cfg.algorithm.token_mask.metric == "ratio" and cfg.algorithm.token_mask.upper == 2.0
    assert cfg.train.backend == "torch"  # default filled in


def test_overrides_coerce_types_and_create_sections(tmp_path):
    path = write(tmp_path, "rollout:\n  group_size: 2\n")
    cfg = load_config(
        path,
        [
            "rollout.group_size=16",
            "rollout.batch_size=32",
            "train.lr=3e-6",
            "algorithm.decoupled=false",
            "inference.urls=[http://a, http://b]",
            "model.name=smollm2-135m-instruct",
        ],
    )
    assert cfg.rollout.group_size == 16
    assert cfg.train.lr == 3e-6
    assert cfg.algorithm.decoupled is False
    assert cfg.inference.urls == ["http://a", "http://b"]
    assert cfg.model.name == "smollm2-135m-instruct"


def test_unknown_key_names_the_key_and_what_is_allowed(tmp_path):
    path = write(tmp_path, "rollout:\n  group_sise: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "rollout.group_sise: unknown key" in message
    assert "group_size" in message and "max_staleness" in message
    with pytest.raises(
        ConfigError, match="rolout: unknown key; allowed in the top level: .*rollout"
    ):
        load_config(None, ["rolout.group_size=1"])


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"rollout.group_size: Input should be greater than or equal to 1 \(got 0\)",
    ):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match="train.zero_stage"):
        load_config(None, ["train.zero_stage=5"])
    with pytest.raises(ConfigError, match="rollout.batch_size: Input should be a valid integer"):
        load_config(None, ["rollout.batch_size=lots"])
    with pytest.raises(ConfigError, match="set model.path or model.name, not both"):
        load_config(None, ["model.path=/a", "model.name=b"])
    with pytest.raises(ConfigError, match="agent.entry must look like"):
        load_config(None, ["agent.entry=nocolon"])
    with pytest.raises(ConfigError, match="token_mask.lower"):
        load_config(None, ["algorithm.token_mask.lower=3", "algorithm.token_mask.upper=1"])


def test_malformed_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1,\n"))
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        parse_override("rollout.group_size")
    with pytest.raises(ConfigError, match="rollout.group_size is a value, not a section"):
        load_config(None, ["rollout.group_size=1", "rollout.group_size.x=2"])


def test_data_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tasks.jsonl").write_text("{}\n")
    path = write(tmp_path / "sub", "data:\n  path: tasks.jsonl\n")
    assert load_config(path).data.path == str((tmp_path / "sub" / "tasks.jsonl").resolve())


def test_input_paths_follow_the_config_file_and_outputs_the_current_directory(
    tmp_path, monkeypatch
):
    (tmp_path / "proj" / "model").mkdir(parents=True)
    path = write(
        tmp_path / "proj",
        "model:\n  path: model\n  tokenizer: ../tok\nrun:\n  dir: runs/x\nweights:\n  dir: w\n",
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    assert cfg.model.path == str(tmp_path / "proj" / "model")
    assert cfg.model.tokenizer == str(tmp_path / "tok")  # missing: named where it was looked for
    assert (cfg.run.dir, cfg.weights.dir) == ("runs/x", "w")
    (tmp_path / "typed-here").mkdir()
    cfg = load_config(path, ["model.path=typed-here"])  # an override, relative to the cwd
    assert cfg.model.path == str(tmp_path / "typed-here")


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "config", sorted(EXAMPLES.glob("*/config.yaml")), ids=lambda p: p.parent.name
)
def test_example_configs_find_their_data_and_agent_from_another_directory(
    config, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config)
    for data in (cfg.data.path, cfg.data.eval_path):
        if data is not None and "shared/data" not in data:  # GSM8K lives outside the repo
            assert Path(data).is_file(), data
    assert (config.parent / (cfg.agent.entry.split(":")[0] + ".py")).is_file()


@pytest.mark.slow
def test_an_example_rolls_out_from_another_directory(tiny_model_dir, tmp_path):
    """The CLI as a user runs it, from a directory that is not the repository."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_sdk",
            "rollout",
            str(EXAMPLES / "openai_sdk" / "config.yaml"),
            "model.name=null",
            f"model.path={tiny_model_dir}",
            "data.limit=2",
            "inference.max_new_tokens=4",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "2 episodes" in proc.stdout
    run_dir = tmp_path / "runs" / "example-openai_sdk"  # run.dir: relative to the cwd
    exported = subprocess.run(
        [sys.executable, "-m", "areal_sdk", "trajectories", "export", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    episodes = [json.loads(line) for line in exported.stdout.splitlines()]
    assert len(episodes) == 2  # decoded with the tokenizer the rollout recorded
    assert all("<|im_start|>user" in e["turns"][0]["prompt_text"] for e in episodes)


def test_yaml_round_trip():
    cfg = load_config(None, ["rollout.max_staleness=0"])
    assert Config.model_validate(__import__("yaml").safe_load(cfg.to_yaml())) == cfg


def test_a_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="multiple of rollout.group_size"):
        load_config(None, ["rollout.group_size=3", "rollout.batch_size=8"])
