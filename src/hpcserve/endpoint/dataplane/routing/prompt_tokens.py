"""A request's prompt as the engine's token ids, computed in the data plane (to match it against the
engines' KV events: token_index). The model folder's tokenizer.json (Hugging Face `tokenizers`) and chat
template, rendered as transformers renders it for vLLM:

    tokenizer = PromptTokenizer.load(model_folder, chat_template=None)   # None: no tokenizer.json there
    tokenizer.tokens(request)    # completions: prompt (text, or token ids as given); chat: messages rendered
                                 # with add_generation_prompt; None when it cannot say (the prompt is routed
                                 # by its text alone then)

A prompt tokenized differently from the engine (a template feature not reproduced here) only costs
routing precision: its blocks match nothing, and the approximate index decides.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_PROMPT_CHARS = 1 << 20  # longer prompts are routed by their text alone
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class PromptTokenizer:
    def __init__(self, tokenizer, template: str | None, special: dict[str, str]):
        self.tokenizer, self.special = tokenizer, special
        self.template = compile_template(template) if template else None
        self.failures = 0  # requests whose prompt could not be tokenized here

    @classmethod
    def load(cls, folder: Path | str, chat_template: Path | str | None = None) -> PromptTokenizer | None:
        """From a model folder; chat_template: a file that replaces the model's (vLLM's --chat-template).
        None where the folder has no tokenizer.json (a slow tokenizer only, or a folder not readable here),
        or the `tokenizers` package is missing (it comes with vLLM)."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            return None
        config = read_json(folder / "tokenizer_config.json")
        template = None
        if chat_template and Path(chat_template).is_file():
            template = Path(chat_template).read_text()
        elif chat_template:  # vLLM takes the template itself too
            template = str(chat_template)
        elif (folder / TEMPLATE_FILE).is_file():
            template = (folder / TEMPLATE_FILE).read_text()
        else:
            template = default_template(config.get("chat_template"))
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), template, special_tokens(config))

    def tokens(self, data: dict) -> list[int] | None:
        try:
            return self.prompt_tokens(data)
        except Exception:  # noqa: BLE001 - any template or tokenizer error: route by text
            self.failures += 1
            return None

    def prompt_tokens(self, data: dict) -> list[int] | None:
        messages = data.get("messages")
        if isinstance(messages, list):
            text = self.render(messages, data)
            return None if text is None else self.encode(text, special=False)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # a batch: the first prompt decides
            if isinstance(prompt, int):
                prompt = data["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str):
            return self.encode(prompt, special=data.get("add_special_tokens", True) is not False)
        return None

    def encode(self, text: str, special: bool) -> list[int] | None:
        if len(text) > MAX_PROMPT_CHARS:
            return None
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def render(self, messages: list, data: dict) -> str | None:
        if self.template is None or data.get("chat_template") or data.get("tools"):
            return None  # a template of the request's own, or tools: rendered by the engine alone
        conversation = [normalized(m) for m in messages]
        continue_final = bool(data.get("continue_final_message"))
        kwargs = data.get("chat_template_kwargs")
        if not isinstance(kwargs, dict):
            kwargs = {}
        text = self.template.render(messages=conversation, tools=None, documents=None,
                                    add_generation_prompt=bool(data.get("add_generation_prompt", True))
                                    and not continue_final, **{**self.special, **kwargs})
        if continue_final and conversation and isinstance(conversation[-1].get("content"), str):
            final = conversation[-1]["content"].strip()
            if final and final in text:  # as transformers: the text ends where the final message ends
                text = text[:text.rindex(final) + len(final)]
        return text


def normalized(message: Any) -> dict:
    """A message as vLLM hands it to a string-content template: text parts joined by newlines. Pure."""
    if not isinstance(message, dict):
        return {}
    content = message.get("content")
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        message = {**message, "content": "\n".join(texts)}
    return message


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def default_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates (the one named 'default'). Pure."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


def special_tokens(config: dict) -> dict[str, str]:
    """The special tokens a template may name ({{ bos_token }}), as strings. Pure."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def compile_template(source: str):
    """A chat template compiled as transformers compiles it (sandboxed, trim_blocks, lstrip_blocks, its
    tojson, raise_exception and strftime_now; `{% generation %}` blocks rendered as they are)."""
    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares it so

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
