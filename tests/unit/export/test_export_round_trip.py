"""The exported folder is the trained policy: loaded by transformers (PEFT for an adapter), it gives the trainer's
own log-probs (core.logprobs.response_log_probs) on a fixed text, for a tied and an untied head, full fine-tuning,
LoRA merged and unmerged, sharded, and in the base's dtype (a bfloat16 base comes out bfloat16).

Each run directory here is made as training makes one: the run's config.yaml, a checkpoint written by
learner.checkpoint.save_checkpoint from build_policy's model with its trained parameters moved away from the base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from grpo_cli.config.schemas import ExportConfig
from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.export import export_checkpoint, find_checkpoint
from grpo_cli.export.folder import base_dtype, layout_for
from grpo_cli.learner.checkpoint import save_checkpoint
from grpo_cli.models import TINY_RANDOM, build_policy, load_tokenizer
from tests.conftest import TINY_LM_CONFIG, compose_config, random_weights

# Merged LoRA in float32: (W + B @ A * s) x against W x + B (A x) s, the same numbers summed in another order (measured
# 1.6e-5 on transformers 4.57.1, under 1e-5 on 5.19; log-probs about -11). The full model is the same computation:
# 1e-5.
MERGED_ATOL = 1e-4
PROMPT, RESPONSE = "Write one short sentence that includes the words: river, lamp.", " The lamp shone over the river."


def make_run(run_dir: Path, overrides: list[str], steps: tuple[int, ...] = (2,)) -> torch.nn.Module:
    """A run directory (config.yaml + one checkpoint per step) whose trained weights differ from the base's; the
    trainer's model as the last checkpoint holds it."""
    cfg = compose_config(["debug=smoke", *overrides], output_dir=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    model, _ = build_policy(cfg.model, torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    for seed in steps:
        # LoRA's B starts at zero: drawing only the adapters (lora_) makes them matter; full: every weight moves.
        random_weights(
            model,
            std=0.05 if not cfg.model.lora.enabled else 0.3,
            seed=seed,
            only="lora_" if cfg.model.lora.enabled else "",
        )
        save_checkpoint(run_dir, seed, model, optimizer, {"sampler": {}}, keep=5)
    return model.eval()


def log_probs(model: torch.nn.Module) -> torch.Tensor:
    """The trainer's scoring of RESPONSE after PROMPT (the one log-prob function of training), in float32 (the
    model is cast in place: a bfloat16 model scores its rounded weights)."""
    tokenizer = load_tokenizer(TINY_RANDOM)
    batch = tokenize_prompt_and_output_ids(
        [tokenizer(PROMPT)["input_ids"]], [tokenizer(RESPONSE)["input_ids"]], tokenizer.pad_token_id
    )
    with torch.no_grad():
        out = response_log_probs(model.float().eval(), batch["input_ids"], batch["labels"], batch["response_mask"])
    return out["log_probs"][batch["response_mask"].bool()]


def untied_bf16_base(folder: Path, **extra) -> Path:
    """A local base with an untied LM head, published in bfloat16, over the tiny model's tokenizer."""
    tokenizer = load_tokenizer(TINY_RANDOM)
    config = LlamaConfig(**{**TINY_LM_CONFIG, "vocab_size": len(tokenizer), **extra}, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = random_weights(LlamaForCausalLM(config), std=0.5, seed=3).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def stored_names(folder: Path) -> set[str]:
    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def test_tied_head_full_model_round_trip_sharded(tmp_path):
    trainer = make_run(tmp_path / "run", [], steps=(1, 2))
    checkpoint = find_checkpoint(tmp_path / "run")
    assert checkpoint.step == 2 and checkpoint.newest
    exported = export_checkpoint(checkpoint, ExportConfig(max_shard_size="4MB"))
    folder = tmp_path / "run" / "model"
    assert exported.folder == folder and exported.layout == "full" and exported.dtype == "float32"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 4MB (the tiny model is 12.9 MB)
    assert "lm_head.weight" not in stored_names(folder)  # the tied head once, under the embedding's name
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(log_probs(loaded), log_probs(trainer), rtol=0, atol=1e-5)
    # the base itself scores differently: the trained weights are what was exported
    base, _ = build_policy(compose_config(["debug=smoke"]).model, torch.device("cpu"))
    assert (log_probs(base) - log_probs(trainer)).abs().max() > 1e-3
    # an older checkpoint goes to model_step_N
    older = export_checkpoint(find_checkpoint(tmp_path / "run", step=1), ExportConfig())
    assert older.folder == tmp_path / "run" / "model_step_1"
    assert (log_probs(AutoModelForCausalLM.from_pretrained(older.folder)) - log_probs(trainer)).abs().max() > 1e-4


def test_untied_bfloat16_base_comes_out_bfloat16_and_scores_as_trained(tmp_path):
    base = untied_bf16_base(tmp_path / "base")
    trainer = make_run(tmp_path / "run", [f"model.name_or_path={base}"])
    checkpoint = find_checkpoint(tmp_path / "run")
    assert base_dtype(checkpoint.model_cfg) == torch.bfloat16  # the run trained in float32
    exported = export_checkpoint(checkpoint, ExportConfig())
    assert exported.dtype == "bfloat16"
    assert json.loads((exported.folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert "lm_head.weight" in stored_names(exported.folder)
    loaded = AutoModelForCausalLM.from_pretrained(exported.folder, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, trainer.lm_head.weight.to(torch.bfloat16))  # rounded once, exactly
    # bf16 weights: the trainer's own model rounded the same way scores identically; the float32 trainer within
    # the rounding of the weights (the vLLM probe's bf16 bound is 0.5).
    torch.testing.assert_close(log_probs(loaded), log_probs(trainer.to(torch.bfloat16)), rtol=0, atol=1e-5)
    # float32 on request: the trainer's numbers exactly
    exact = export_checkpoint(checkpoint, ExportConfig(dtype="float32"), out=tmp_path / "fp32")
    torch.testing.assert_close(
        log_probs(AutoModelForCausalLM.from_pretrained(exact.folder)),
        log_probs(make_run_model(tmp_path)),
        atol=1e-5,
        rtol=0,
    )


def make_run_model(tmp_path: Path) -> torch.nn.Module:
    """The trainer's model of tmp_path/run rebuilt from its checkpoint (what the float32 export must equal)."""
    from grpo_cli.export import trained_policy

    return trained_policy(find_checkpoint(tmp_path / "run"))[0]


def test_lora_on_a_base_without_hub_id_is_merged_and_scores_as_trained(tmp_path):
    trainer = make_run(tmp_path / "run", ["model.lora.enabled=true", "model.lora.r=4"])
    checkpoint = find_checkpoint(tmp_path / "run")
    layout = layout_for(checkpoint.model_cfg, merge_lora=False)
    assert layout.kind == "merged" and "random:tiny-llama has no hub id" in str(layout.note)
    exported = export_checkpoint(checkpoint, ExportConfig())
    assert exported.layout == "merged" and not (exported.folder / "adapter_config.json").exists()
    assert not any("lora" in name or "base_layer" in name for name in stored_names(exported.folder))
    loaded = AutoModelForCausalLM.from_pretrained(exported.folder)
    torch.testing.assert_close(log_probs(loaded), log_probs(trainer), rtol=0, atol=MERGED_ATOL)


def test_lora_adapter_in_peft_format_loads_over_its_base(tmp_path, monkeypatch):
    """An adapter over a hub base names the hub id in adapter_config.json; here the base is a local folder standing
    in for the hub id (no network), loaded by PEFT as a user would load the hub's."""
    from peft import PeftModel

    base = untied_bf16_base(tmp_path / "base")
    trainer = make_run(tmp_path / "run", [f"model.name_or_path={base}", "model.lora.enabled=true", "model.lora.r=4"])
    monkeypatch.setattr("grpo_cli.export.folder.is_hub_name", lambda name: name == str(base))
    checkpoint = find_checkpoint(tmp_path / "run")
    exported = export_checkpoint(checkpoint, ExportConfig(dtype="float32"))
    assert exported.layout == "adapter" and not (exported.folder / "config.json").exists()
    adapter_config = json.loads((exported.folder / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base)
    assert (exported.folder / "tokenizer_config.json").exists() and (
        exported.folder / "generation_config.json"
    ).exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), exported.folder)
    torch.testing.assert_close(log_probs(loaded), log_probs(trainer), rtol=0, atol=1e-5)
    # merged on request: the same numbers from a plain model
    merged = export_checkpoint(checkpoint, ExportConfig(merge_lora=True, dtype="float32"), out=tmp_path / "merged")
    assert merged.layout == "merged"
    torch.testing.assert_close(
        log_probs(AutoModelForCausalLM.from_pretrained(merged.folder)), log_probs(trainer), rtol=0, atol=MERGED_ATOL
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "adapter"),
        ("embedded:smollm2-135m-instruct", "merged"),
        (TINY_RANDOM, "merged"),
    ],
)
def test_which_lora_layout(name, expected):
    cfg = compose_config([f"model.name_or_path={name}", "model.lora.enabled=true"]).model
    assert layout_for(cfg, merge_lora=False).kind == expected
    assert layout_for(cfg, merge_lora=True).kind == "merged"


def test_the_folder_reads_on_transformers_4_57_too(tmp_path):
    """transformers 5.x writes a tokenizer class 4.57 refuses (TokenizersBackend) and the rotary base only in
    rope_parameters, which 4.57 ignores (silently using rope_theta 10000): the export adds what 4.57 reads (checked
    by hand on 4.57.1: the files load there with the same ids and rope_theta), and 5.x still reads them the same."""
    from transformers import AutoConfig, AutoTokenizer

    base = untied_bf16_base(tmp_path / "base", rope_theta=100000.0)  # SmolLM2's rotary base, not the default
    make_run(tmp_path / "run", [f"model.name_or_path={base}"])
    folder = export_checkpoint(find_checkpoint(tmp_path / "run"), ExportConfig()).folder
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config.get("tokenizer_class") != "TokenizersBackend" and "is_local" not in tokenizer_config
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters", {"rope_theta": config["rope_theta"]})
    assert config["rope_theta"] == rope["rope_theta"] == 100000.0
    text = "hello <|im_end|> world"
    assert AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == load_tokenizer(TINY_RANDOM)(text)["input_ids"]
    reread = AutoConfig.from_pretrained(folder)
    assert getattr(reread, "rope_parameters", None) in (None, rope)
