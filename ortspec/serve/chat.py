"""The model's chat template (tokenizer_config.json ``chat_template``), rendered as transformers does.

HuggingFace chat templates are Jinja; they are rendered in Jinja's immutable sandbox (a
template is data that came with a checkpoint, not code to trust) with the variables
transformers passes: messages, add_generation_prompt, bos_token, eos_token and the
raise_exception helper. A model directory without a template serves no /v1/chat/completions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import ModelDirError


class TemplateError(Exception):
    """The template refused the messages (raise_exception) or failed to render on them (HTTP 400)."""


def _token_text(value) -> str:
    """tokenizer_config's special tokens are strings or {"content": ...} objects."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self.template = environment.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "ChatTemplate | None":
        """The template of tokenizer_config.json, or None when there is none."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text())
        except ValueError as exc:
            raise ModelDirError(f"{path} is not valid JSON ({exc}); copy the checkpoint's tokenizer_config.json "
                                "again or reconvert.") from exc
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict]) -> str:
        """The prompt text for these messages, ending where the assistant's reply begins."""
        from jinja2 import TemplateError as JinjaError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError:
            raise
        except JinjaError as exc:
            raise TemplateError(f"the model's chat template failed on these messages: {json_words(str(exc))}; check "
                                "the messages' fields against what it expects.") from None
        except (TypeError, ValueError, LookupError, ArithmeticError):  # Python's, on a field of an unexpected type
            raise TemplateError("the model's chat template failed on these messages: a field holds a value of a type "
                                "it cannot use there (such as a number where it adds strings); check the fields "
                                "beside role and content (tool_calls, name, ...) against what it expects.") from None


JSON_WORDS = {"dict": "an object", "list": "an array", "tuple": "an array", "str": "a string", "int": "a number",
              "float": "a number", "bool": "a boolean"}


def json_words(message: str) -> str:
    """Jinja's words for a value's type ('dict object' has no attribute 'x') in JSON's (an object ...)."""
    message = re.sub(r"'(\w+) object'", lambda m: JSON_WORDS.get(m.group(1), f"a {m.group(1)}"), message)
    return re.sub(r"\bNone has no", "null has no", message)
