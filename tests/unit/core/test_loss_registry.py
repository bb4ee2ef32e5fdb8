"""The losses' registry: every declaration names inputs the train step can give, the dispatcher refuses a loss's
missing need by its declaration, and a registered loss gets the settings whole from the train step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_cli.config.schemas import LossConfig
from grpo_cli.core import LossSettings, microbatch_train_step
from grpo_cli.core.loss_settings import loss_options
from grpo_cli.core.losses import LOSS_TENSORS, LOSSES, LossSpec, policy_gradient_loss

SETTINGS = {f.name for f in dataclasses.fields(LossSettings)}


def test_every_declaration_names_a_tensor_or_a_setting_and_weighs_by_rewards_or_advantages():
    for name, spec in LOSSES.items():
        assert set(spec.needs) <= set(LOSS_TENSORS) | SETTINGS, name
        assert set(spec.reads) <= SETTINGS - set(LOSS_TENSORS), name
        assert ("raw_rewards" in spec.needs) != ("advantages" in spec.needs), name


def test_the_loss_options_are_the_loss_keys_of_the_config_by_name():
    keys = {f.name for f in dataclasses.fields(LossConfig)} - {"type"}
    assert keys <= SETTINGS  # the learner copies loss.* over by name
    assert set(loss_options()) <= keys
    read = {option for spec in LOSSES.values() for option in spec.reads}
    assert read <= set(loss_options())  # an optional setting a loss reads is one the config can refuse


@pytest.mark.parametrize("loss_type", list(LOSSES))
def test_the_dispatcher_refuses_each_missing_need_the_declaration_names(loss_type):
    log_probs = torch.zeros(2, 3)
    given = {
        "raw_rewards": torch.ones(2, 1),
        "advantages": torch.ones(2, 1),
        "old_log_probs": torch.zeros(2, 3),
        "response_mask": torch.ones(2, 3),
    }
    settings = LossSettings(loss_type, cliprange=0.2, cliprange_high=0.28)
    policy_gradient_loss(settings, log_probs, **given)  # everything given: it runs
    for need in LOSSES[loss_type].needs:
        if need in given:  # a tensor left out
            without, tensors = settings, {**given, need: None}
        else:  # a setting left out
            without, tensors = dataclasses.replace(settings, **{need: None}), given
        with pytest.raises(ValueError, match=f"needs {need}"):
            policy_gradient_loss(without, log_probs, **tensors)


def test_a_registered_loss_gets_the_settings_whole_from_the_train_step(monkeypatch):
    seen: list[LossSettings] = []

    def spy(old_log_probs, policy_log_probs, advantages, response_mask, settings):
        seen.append(settings)
        return -advantages * policy_log_probs, {}

    monkeypatch.setitem(LOSSES, "spy", LossSpec(spy, "a spy", needs=("advantages",)))
    settings = LossSettings("spy", dual_clip=3.0, kl_estimator="k1")
    log_probs = torch.zeros(2, 3, requires_grad=True)
    microbatch_train_step(log_probs, torch.ones(2, 3), 1, settings, advantages=torch.ones(2, 1))
    assert seen == [settings]
