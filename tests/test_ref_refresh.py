"""The reference refresh (trainer.ref_sync_steps, TR-DPO's soft update; TRL's sync_ref_model):
the update formula, a run that refreshes and resumes exactly, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli.checkpoint import REFERENCE_FILE
from grpo_cli.config import ConfigError
from grpo_cli.logs import read_metrics
from grpo_cli.models.loading import load_models, refresh_reference
from grpo_cli.pipeline import run
from grpo_cli.validation import validate
from helpers import ALTERNATING_REWARD, computed_rows, config


def test_the_refresh_is_alpha_policy_plus_one_minus_alpha_reference(tiny_model_dir):
    models = load_models(config(tiny_model_dir, "trainer.beta=0.04").model, 0.04, torch.device("cpu"))
    with torch.no_grad():
        for parameter in models.policy.parameters():
            parameter.add_(torch.randn_like(parameter))
    policy = {name: p.detach().clone() for name, p in models.policy.named_parameters()}
    before = {name: p.detach().clone() for name, p in models.reference.named_parameters()}
    refresh_reference(models, 0.25)
    for name, reference in models.reference.named_parameters():
        assert torch.allclose(reference, 0.25 * policy[name] + 0.75 * before[name], atol=1e-6), name
        assert not torch.equal(reference, before[name])
    assert all(not p.requires_grad for p in models.reference.parameters())  # still frozen
    refresh_reference(models, 1.0)  # alpha 1: a copy of the policy
    assert all(torch.equal(r, policy[n]) for n, r in models.reference.named_parameters())


REFRESHING = (
    ALTERNATING_REWARD,
    "trainer.beta=0.04",
    "trainer.ref_sync_steps=2",
    "trainer.ref_mixup_alpha=0.5",
    "trainer.checkpoint_every=2",
    "trainer.keep_last=5",
    "data.eval_size=0",
)


def test_a_refreshing_run_saves_its_reference_and_resumes_exactly(tmp_path, tiny_model_dir):
    unbroken = tmp_path / "unbroken"
    run(config(tiny_model_dir, *REFRESHING, "trainer.steps=5", f"trainer.output_dir={unbroken}"))
    rows = [row for row in read_metrics(unbroken) if row["step"] > 0]
    assert [row["step"] for row in rows if row.get("ref/refreshed")] == [2, 4]
    saved = load_file(unbroken / "checkpoints" / "step-000004" / REFERENCE_FILE)
    first = load_file(unbroken / "checkpoints" / "step-000002" / REFERENCE_FILE)
    assert any(not torch.equal(saved[name], first[name]) for name in saved)  # it moved again at step 4
    # stopped after step 3 (one refresh done), resumed to 5: the same KL and rewards at steps 4-5,
    # which needs the refreshed reference back (the base model's would give another KL)
    resumed = tmp_path / "resumed"
    run(config(tiny_model_dir, *REFRESHING, "trainer.steps=3", f"trainer.output_dir={resumed}"))
    run(config(tiny_model_dir, *REFRESHING, "trainer.steps=5", "trainer.resume=true", f"trainer.output_dir={resumed}"))
    assert computed_rows(read_metrics(resumed)) == computed_rows(read_metrics(unbroken))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.ref_sync_steps=10", "model.lora.enabled=true"], "the reference is the base model under the adapter"),
        (["trainer.ref_sync_steps=10", "trainer.beta=0"], "there is no reference to refresh"),
        (["trainer.ref_sync_steps=10", "trainer.distributed=fsdp"], "the policy is sharded"),
        (["trainer.ref_sync_steps=-1"], "trainer.ref_sync_steps=-1 must be >= 0"),
        (["trainer.ref_mixup_alpha=0"], "trainer.ref_mixup_alpha=0.0 must be in (0, 1]"),
    ],
)
def test_refresh_settings_it_cannot_honour_are_refused(tiny_model_dir, overrides, expected):
    with pytest.raises(ConfigError) as caught:
        validate(config(tiny_model_dir, "trainer.beta=0.04", *overrides), check_files=False)
    assert expected in str(caught.value)
