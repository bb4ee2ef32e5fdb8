"""A Hugging Face sequence-classification model as a reward (task.reward_model.*, task=custom).

The reward of a response is the probability of a named label (softmax over the model's labels: the "Tiny
GRPO-based RL Fine-Tuning" assignment's "probability of the negative class") or, with no label, the raw score of a
one-logit head (a reward model as TRL uses one). Scored in batches, without gradients, on the policy's device, each
text truncated to the model's maximum length. The only module of grpo_cli.tasks that uses torch, imported only when
a reward model is set.
"""

from __future__ import annotations

from typing import Any

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.base import GroundTruth

_CLASSIFIER_SUFFIX = "ForSequenceClassification"


def _labels(config: Any) -> list[str]:  # Any: a transformers PretrainedConfig, whose id2label may be absent
    return [str(config.id2label[i]) for i in sorted(config.id2label)] if getattr(config, "id2label", None) else []


def check_reward_model(path: str, label: str | None) -> None:
    """Before any model loads: the path holds a sequence-classification model, and `label` is one of its labels
    (or, without a label, it has one logit). Reads only the model's config."""
    from transformers import AutoConfig

    key = f"task.reward_model.path={path}"
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a missing directory, an unknown hub id offline: one line
        first = " ".join(str(e).split())[:200]
        raise UserFacingError(
            f"{key}: cannot read a model config there ({type(e).__name__}: {first}): give a local model "
            "directory or a hub id in the local cache"
        ) from None
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and not any(a.endswith(_CLASSIFIER_SUFFIX) for a in architectures):
        raise UserFacingError(
            f"{key} is a {architectures[0]}, not a sequence-classification model (*{_CLASSIFIER_SUFFIX}): give a "
            "classifier or reward model"
        )
    labels = _labels(config)
    if label is not None and label not in labels:
        raise UserFacingError(
            f"task.reward_model.label={label}: {path} has the labels {', '.join(labels) or 'none'}: name one of them"
        )
    if label is None and config.num_labels != 1:
        raise UserFacingError(
            f"{key} has {config.num_labels} labels ({', '.join(labels)}): name the one whose probability is the "
            "reward with task.reward_model.label=..., or give a one-logit reward model"
        )


class RewardModelScorer:
    """Loads the classifier once on `device`; `scorer(responses, truths)` -> one float per response."""

    def __init__(self, path: str, label: str | None, batch_size: int, dtype: str, device: str, text: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.device = torch.device(device)
        if dtype == "auto":
            cuda_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
            torch_dtype = torch.bfloat16 if cuda_bf16 else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch_dtype).to(self.device)
        self.model.eval()
        if self.tokenizer.pad_token is None:  # batches need padding; the classifier reads the last real token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label_index = None if label is None else _labels(self.model.config).index(label)
        self.batch_size = batch_size
        self.text = text
        # The tokenizer's model_max_length is a huge sentinel when the model does not say; the position table does.
        limits = (self.tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings", None))
        known = [int(x) for x in limits if isinstance(x, int) and x < 1_000_000]
        self.max_length = min(known) if known else 512

    def _texts(self, responses: list[str], truths: list[GroundTruth]) -> list[str]:
        if self.text == "response":
            return list(responses)
        out = []
        for response, truth in zip(responses, truths, strict=True):
            prompt = truth.get("prompt") if isinstance(truth, dict) else ""
            if isinstance(prompt, list):  # chat messages: their contents, in order
                prompt = "\n".join(str(m.get("content", "")) for m in prompt)
            out.append(f"{prompt}{response}")
        return out

    def __call__(self, responses: list[str], truths: list[GroundTruth]) -> list[float]:
        torch = self.torch
        texts = self._texts(responses, truths)
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                batch = self.tokenizer(
                    chunk, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
                ).to(self.device)
                logits = self.model(**batch).logits.float()  # (batch, num_labels)
                if self.label_index is None:
                    scores.extend(logits[:, 0].tolist())
                else:
                    scores.extend(torch.softmax(logits, dim=-1)[:, self.label_index].tolist())
        return scores
