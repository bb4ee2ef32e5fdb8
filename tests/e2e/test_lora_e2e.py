"""The grpo-run end-to-end half of tests/unit/learner/test_lora.py: grpo-run as a subprocess."""

from __future__ import annotations

import pytest

from grpo_cli.config import validate_config
from grpo_cli.errors import UserFacingError
from tests.conftest import compose_config, run_grpo
from tests.unit.learner.test_lora import LORA


def test_4bit_needs_lora_and_cuda(tmp_path):
    with pytest.raises(UserFacingError, match="set model.lora.enabled=true"):
        validate_config(compose_config(["model.quantization=4bit"]))
    result = run_grpo(
        ["debug=smoke", *LORA, "model.quantization=4bit", "model.device=cpu", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and len(result.stderr.strip().splitlines()) == 1
