"""Tokenizers (from tokenizer.json or GGUF metadata), chat templates, streaming detokenization."""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.gguf_vocab import (SPACE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, byte_level_bpe,
                                      sentencepiece_bpe)

log = logging.getLogger(__name__)

# Texts of special tokens that end a generation in common chat formats. Like
# llama.cpp's end-of-generation set, any of these present in the vocabulary as
# a special token stops generation, besides the declared EOS.
_END_OF_GENERATION_TEXTS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "</s>",
)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str):
    """Compile a Hugging Face chat template the way transformers does (sandboxed jinja2), once per template."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        stops = {i for i in extra_stop_token_ids if i is not None}
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        stops.update(special[text] for text in _END_OF_GENERATION_TEXTS if text in special)
        self.stop_token_ids: frozenset[int] = frozenset(stops)

    # --- constructors -----------------------------------------------------

    @classmethod
    def from_directory(cls, directory: str | Path) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, generation_config.json, chat_template.jinja)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{directory} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        config = _read_json(directory / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        generation = _read_json(directory / "generation_config.json")
        eos_ids = generation.get("eos_token_id")
        extra = eos_ids if isinstance(eos_ids, list) else [eos_ids]
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            chat_template=template,
            extra_stop_token_ids=extra,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Build a tokenizer from a GGUF file's `tokenizer.*` metadata.

        `tokenizer.ggml.model` "gpt2" is byte-level BPE (SmolLM2, Llama 3, Qwen2); "llama" is a
        SentencePiece BPE vocabulary (Gemma, Llama 2) with byte fallback.
        """
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        if kind == "gpt2":
            spec = byte_level_bpe(meta, tokens)
        elif kind == "llama":
            # llama.cpp's converter writes SentencePiece's user-defined "▁▁" (Gemma's runs of spaces) as "  ":
            # spell them back, to be matched after spaces become "▁", as SentencePiece matches them.
            tokens = [token.replace(" ", SPACE) if kind == TOKEN_TYPE_USER_DEFINED else token
                      for token, kind in zip(tokens, types)]
            spec = sentencepiece_bpe(meta, tokens, types)
        else:
            raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported "
                                        "(supported: byte-level BPE 'gpt2', SentencePiece 'llama')")
        # Control tokens are special (skipped when decoding); user-defined ones (Gemma's runs of spaces and
        # newlines, HTML tags) are not. Both are matched whole, longest first, before the model runs, as
        # SentencePiece and llama.cpp do; those spelt with "▁" are matched in the text once spaces are "▁".
        spec["added_tokens"] = [
            {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": SPACE in tokens[i], "special": types[i] == TOKEN_TYPE_CONTROL}
            for i in range(len(tokens)) if types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
        ]
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        spec["post_processor"] = None
        if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
            spec["post_processor"] = {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
            }
        backend = HFTokenizer.from_str(json.dumps({"version": "1.0", "truncation": None, "padding": None, **spec}))
        eot_id = meta.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token=bos,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            chat_template=meta.get("tokenizer.chat_template"),
            extra_stop_token_ids=[eot_id] if eot_id is not None else [],
        )

    # --- text <-> ids -----------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it tokenizes; `backend.encode` holds it for the
        # whole call (measured: 1 MB of text, ~1 s with no other Python thread running), which
        # would stall a server's event loop even from a worker thread.
        encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest vocabulary
        entry (byte-level entries spell one character per byte, so they never undercount)."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's own chat template."""
        if not self.chat_template:
            raise UnsupportedModelError("this model has no chat template; send a plain prompt instead")
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
                    ) -> list[int]:
        """`kwargs`: more template variables (`tools`)."""
        # The template writes any BOS itself, so no special tokens are added again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content")
    return token
