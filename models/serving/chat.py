"""Chat messages -> one prompt string, through a checkpoint's Jinja chat template (the
`chat_template` of its tokenizer_config.json, as Hugging Face tokenizers render it), in a
sandboxed Jinja environment so that a template can read only what it is given."""
from __future__ import annotations

import json
import os

# Qwen2.5's message layout (without its default system message), for the demo model.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def checkpoint_chat_template(checkpoint: str) -> str | None:
  """The chat template of a Hugging Face checkpoint folder, or None when it has none."""
  path = os.path.join(checkpoint, "tokenizer_config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    template = json.load(f).get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  return template if isinstance(template, str) else None


class ChatTemplate:
  """render(messages) -> the prompt text ending with the assistant's turn opened."""

  def __init__(self, source: str = QWEN_CHAT_TEMPLATE):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    self._template = environment.from_string(source)

  def render(self, messages: list[dict]) -> str:
    return self._template.render(messages=messages, add_generation_prompt=True, tools=None)
