"""Multi-turn rollouts inside grpo-train (rollout=calculator, rollout=number_guessing) on the
real SmolLM2-135M-Instruct: every sampler turn of every conversation, tool and environment
tokens masked out of the update, the rollout metrics in metrics.jsonl."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from grpo_cli.tools.report import report
from helpers import config, grpo_train, input_error

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    path = tmp_path_factory.mktemp("multiturn") / "sums.jsonl"
    rows = [
        {"question": f"What is {a} + {b}? Use the calculator.", "answer": str(a + b)} for a, b in [(37, 48), (19, 64)]
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    "preset, reward",
    [
        ("calculator", "grpo_cli.rewards.exact_match"),
        ("number_guessing", "grpo_cli.rewards.environment_reward"),
    ],
)
def test_a_multi_turn_run_trains_and_logs_its_rollouts(smollm2_dir, sums, tmp_path, preset, reward):
    run = tmp_path / "run"
    grpo_train(
        f"hydra.run.dir={run}",
        f"model.name_or_path={smollm2_dir}",
        "model.dtype=float32",
        f"data.path={sums}",
        "data.prompt_field=question",
        "data.eval_path=null",
        "data.use_chat_template=auto",
        "data.prompts_per_step=2",
        f"rollout={preset}",
        "rollout.max_turns=2",
        "sampler.group_size=2",
        "sampler.temperature=1.2",
        "sampler.max_new_tokens=24",
        "trainer.steps=2",
        "trainer.sample_every=1",
        "optimizer.lr=1e-5",
        f"reward.functions=[{{_target_: {reward}, weight: 1.0}}]",
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "rollout/turns" in row]
    assert len(steps) == 2
    for row in steps:
        assert 1 <= row["rollout/turns"] <= 2
        assert row["rollout/tokens_policy"] > 0 and row["completion/length_mean"] == row["rollout/tokens_policy"]
        assert row["rollout/tool_errors"] >= 0 and row["loss"] is not None
    if preset == "number_guessing":  # the environment's opening and its hints are not the policy's
        assert all(row["rollout/tokens_other"] > 0 for row in steps if row["rollout/turns"] > 1)
    # samples.jsonl keeps each whole conversation, and grpo-report shows the last step's.
    entries = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in entries] == [1, 1, 2, 2]
    for entry in entries:
        for conversation, final, turns in zip(entry["conversations"], entry["completions"], entry["turns"]):
            said = [m["content"] for m in conversation if m["role"] == "assistant"]
            assert len(said) == turns and said[-1] == final
    report(run, Console(file=io.StringIO()))
    samples = (run / "report.md").read_text().split("## Samples")[1]
    assert "### Step 2" in samples and "assistant: " in samples


def test_multi_turn_needs_a_chat_template(tiny_model_dir, tmp_path):
    message = input_error("grpo-train", f"model.name_or_path={tiny_model_dir}", "rollout=calculator", cwd=tmp_path)
    assert "need a chat template" in message and "rollout=single_turn" in message


def test_a_turn_limit_under_one_is_a_config_error(smollm2_dir, tmp_path):
    message = input_error(
        "grpo-train",
        f"model.name_or_path={smollm2_dir}",
        "rollout=calculator",
        "rollout.max_total_tokens=0",
        cwd=tmp_path,
    )
    assert "rollout.max_total_tokens=0: give a whole number of at least 1" in message


class OneSentenceMore:
    """Asks for one sentence, then for one more: a task SmolLM2 ends turns on (NumberGuessing's
    answers it rambles through at 40 tokens)."""

    def reset(self, row):
        return [{"role": "user", "content": "Tell me about cats in one sentence."}]

    def step(self, messages):
        if len(messages) >= 4:
            return [], 1.0, True
        return [{"role": "user", "content": "One more sentence, please."}], None, False


def test_a_sampled_multi_turn_rollout_trains_only_the_policys_tokens(smollm2_dir, sums):
    from grpo_cli.algorithm.advantages import group_advantages
    from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
    from grpo_cli.algorithm.update import update_policy
    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models, trainable_parameters
    from grpo_cli.multiturn.rollout import MultiTurnSampler
    from grpo_cli.sampling import run_sampler

    cfg = config(
        smollm2_dir,
        f"data.path={sums}",
        "data.prompt_field=question",
        "data.use_chat_template=auto",
        "sampler.group_size=2",
        "sampler.max_new_tokens=40",
        "rollout.environment._target_=test_multiturn_training.OneSentenceMore",
        "rollout.max_turns=3",
        "optimizer.lr=1e-5",
    )
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    sampler = run_sampler(cfg, models, [])
    assert isinstance(sampler, MultiTurnSampler)
    torch.manual_seed(0)
    rollout = sampler.sample(models.policy, PromptSource(cfg.data, models.tokenizer).next_batch())
    assert rollout.completion_ids.shape[0] == 4 and rollout.policy_mask is not None
    assert torch.all(rollout.policy_mask <= rollout.completion_mask)
    parameters = trainable_parameters(models.policy)
    optimizer = make_optimizer(cfg.optimizer, parameters)
    advantages = group_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), std_eps=1e-4, std_threshold=1e-4)
    stats = update_policy(
        models, rollout, advantages, optimizer, make_scheduler(cfg.optimizer, optimizer, 1), cfg.trainer, 1.0, 0.0
    )
    assert stats.tokens == int(rollout.policy_mask.sum()) < int(rollout.completion_mask.sum())
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    answers = sampler.greedy(models.policy, batch)  # the eval: greedy turns, the last one's text
    assert len(answers) == 2 and all(isinstance(answer, str) and answer for answer in answers)


def test_the_environment_reward_function_reads_the_column_and_none_without_it():
    from grpo_cli.rewards import environment_reward

    assert environment_reward(["p"] * 3, ["a"] * 3, environment_reward=[1, None, 0.5]) == [1.0, None, 0.5]
    assert environment_reward(["p"], ["a"]) == [None]


def stall(seconds: int) -> str:
    """Wait, then say so.

    Args:
        seconds: How long to wait.
    """
    import time

    time.sleep(seconds)
    return "waited"


class ScriptedSampler:
    """The run's sampler with a scripted policy (test_multiturn_rollout.ScriptedPolicy) drawing
    the turns: what the policy writes is known, the update still runs on SmolLM2."""

    def __init__(self, cfg, tokenizer, script):
        from test_multiturn_rollout import ScriptedPolicy

        self.cfg, self.policy = cfg, ScriptedPolicy(tokenizer, script)

    def sample(self, policy, batch, group_size=None):
        return self.policy(batch)

    def greedy(self, policy, batch):
        return self.policy.tokenizer.batch_decode(self.policy(batch).completion_ids, skip_special_tokens=True)

    def close(self):
        pass


def test_a_tool_that_hangs_is_cut_off_and_the_step_goes_on(smollm2_dir, sums, tmp_path, monkeypatch, capsys):
    import time

    import grpo_cli.sampling
    from grpo_cli.logs import read_metrics
    from grpo_cli.pipeline import run

    stalled = '<tool_call>\n{"name": "stall", "arguments": {"seconds": 300}}\n</tool_call>'
    script = {"Use the calculator.": stalled, "was stopped": "I could not wait."}
    monkeypatch.setattr(
        grpo_cli.sampling,
        "make_sampler",
        lambda cfg, tokenizer, *_: ScriptedSampler(cfg, tokenizer, script),
    )
    cfg = config(
        smollm2_dir,
        f"data.path={sums}",
        "data.prompt_field=question",
        "data.use_chat_template=auto",
        f"data.eval_path={sums}",  # a greedy eval of the same two questions, before and after
        "sampler.group_size=2",
        "rollout.tools=[{_target_: test_multiturn_training.stall}]",
        "rollout.tool_timeout_s=1.0",
        "trainer.steps=1",
        "trainer.checkpoint_every=0",
        "trainer.sample_every=1",
        "reward.functions=[{_target_: grpo_cli.rewards.exact_match, weight: 1.0}]",
        f"trainer.output_dir={tmp_path}",
    )
    started = time.monotonic()
    run(cfg)
    assert time.monotonic() - started < 300  # one call of the 8 not cut off at 1 s would take 300 s
    before, row = read_metrics(tmp_path)
    assert row["rollout/tool_calls"] == 1.0 and row["rollout/tool_errors/timeout"] == 4  # a mean, a sum
    for evaluated in (before, row):  # each eval conversation called the tool, then answered
        assert (evaluated["eval/tool_use"], evaluated["eval/turns"], evaluated["eval/accuracy"]) == (1.0, 2.0, 0.0)
    assert "greedy eval tool_use, before -> after: 1.000 -> 1.000" in capsys.readouterr().out  # the summary
    assert row["rollout/turns"] == 2 and row["loss"] is not None
    entries = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(entries) == 2  # one a prompt
    for entry in entries:
        tool_message = entry["conversations"][0][-2]
        assert tool_message["role"] == "tool" and "ran longer than 1 s and was stopped" in tool_message["content"]
        assert entry["completions"] == ["I could not wait."] * 2


def test_a_multi_turn_run_resumes_exactly(smollm2_dir, sums, tmp_path):
    from grpo_cli.logs import read_metrics
    from grpo_cli.pipeline import run
    from helpers import ALTERNATING_REWARD, computed_rows

    def multi_turn_run(folder, *overrides):
        run(
            config(
                smollm2_dir,
                f"data.path={sums}",
                "data.prompt_field=question",
                "data.use_chat_template=auto",
                "data.eval_size=0",
                "sampler.group_size=2",
                "sampler.max_new_tokens=24",
                "rollout.environment._target_=test_multiturn_training.OneSentenceMore",
                "rollout.max_turns=3",
                "optimizer.lr=1e-5",
                "trainer.checkpoint_every=1",
                ALTERNATING_REWARD,
                f"trainer.output_dir={folder}",
                *overrides,
            )
        )
        return [row for row in read_metrics(folder) if row["step"] > 0]

    unbroken = multi_turn_run(tmp_path / "unbroken", "trainer.steps=2")
    assert unbroken[-1]["rollout/turns"] > 1  # the premise: conversations of several turns
    multi_turn_run(tmp_path / "resumed", "trainer.steps=1")
    resumed = multi_turn_run(tmp_path / "resumed", "trainer.steps=2", "trainer.resume=true")
    assert [row["step"] for row in resumed] == [1, 2]
    assert computed_rows(resumed) == computed_rows(unbroken)  # the turns, tool and token counts, loss, KL
