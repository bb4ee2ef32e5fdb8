"""Chat templates without a system role (Gemma-2's, Mistral-7B-Instruct-v0.1's raise on one): the system text is put
at the start of the first user turn instead, as those models' own docs advise, said once in the log. No torch.

A system message reaches a template from the data (conversations that open with one), from task.system_prompt, and
from the default tool prompt (episodes/tools.py) that lists the tools to a template that does not render them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

Message = dict[str, Any]

_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
_refuses: dict[str, bool] = {}  # template -> whether it refuses a system message


def template_refuses_system(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the chat template (`chat_template`, else the tokenizer's own) raises on a system message while it
    renders the same conversation without one. Probed once per tokenizer and template."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    key = str(template)
    if key not in _refuses:
        _refuses[key] = not _renders(tokenizer, _PROBE, template) and _renders(tokenizer, _PROBE[1:], template)
        if _refuses[key]:
            name = getattr(tokenizer, "name_or_path", "") or "the model"
            logger.warning(
                "the chat template of %s has no system role: system text (task.system_prompt, a system message of "
                "the data, the tool prompt) is put at the start of the first user turn",
                name,
            )
    return _refuses[key]


def _renders(tokenizer: Any, messages: list[Message], template: str) -> bool:
    try:
        tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - any failure of the template on this input means it does not support it
        return False
    return True


def fold_system(messages: Sequence[Message]) -> list[Message]:
    """The conversation with its system messages' text put at the start of the first user turn (a new user turn
    when there is none), separated by a blank line."""
    system = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
    rest = [dict(m) for m in messages if m.get("role") != "system"]
    if not system:
        return rest
    text = "\n\n".join(part for part in system if part)
    for message in rest:
        if message.get("role") == "user":
            message["content"] = (
                f"{text}\n\n{message.get('content') or ''}".rstrip("\n") if text else message["content"]
            )
            return rest
    return [{"role": "user", "content": text}, *rest]


def renderable(tokenizer: Any, messages: Sequence[Message], chat_template: str | None = None) -> list[Message]:
    """`messages` as the chat template can render them: as they are, or with the system text folded into the first
    user turn when the template has no system role."""
    if any(m.get("role") == "system" for m in messages) and template_refuses_system(tokenizer, chat_template):
        return fold_system(messages)
    return [dict(m) for m in messages]
