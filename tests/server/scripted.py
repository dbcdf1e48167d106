"""A model that writes a given text: a loaded model's config, tokenizer and weights, its forward replaced by
logits that pick the next token of a script. Reasoning tags and call layouts the embedded 135M model never writes
then go through the real server, grammar, parsers and prompt builder; the grammar's mask still applies (a script
the constraint refuses comes out otherwise, and the test sees it).

One request at a time: `say(text)` arms the script, the next forward with a logits row is that request's
prompt (its last row starts the script), and each later row writes the script's next token after the text its
output holds so far (forced tokens included), then EOS.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.model.loader import LoadedModel
from kvserve.model.tokenizer import Tokenizer


class ScriptedModel:
    def __init__(self, model, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._script = ""
        self._armed = False
        self._start: int | None = None  # the position of the first output token
        self._written: dict[int, int] = {}  # position -> output token fed back in

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def say(self, text: str) -> None:
        self._script, self._armed, self._start, self._written = text, True, None, {}

    @property
    def generated_ids(self) -> list[int]:
        """The output ids of the last request fed back so far (all but the last; add EOS for a finished one)."""
        return [self._written[p] for p in sorted(self._written)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context, logits_indices=None) -> torch.Tensor:
        rows = logits_indices.tolist() if logits_indices is not None else list(range(len(input_ids)))
        ids, places = input_ids.tolist(), positions.tolist()
        if self._armed and self._start is None and rows:
            self._start = places[rows[0]] + 1  # the prompt's last token: the script starts after it
            self._armed = False
        if self._start is not None:
            self._written.update({p: t for p, t in zip(places, ids) if p >= self._start})
        logits = torch.zeros(len(rows), self._vocab_size)
        for n, row in enumerate(rows):
            logits[n, self._next(places[row])] = 100.0
        return logits

    def _next(self, position: int) -> int:
        eos = self._tokenizer.eos_token_id
        if self._start is None:
            return eos
        written = [self._written[p] for p in range(self._start, position + 1) if p in self._written]
        text = self._tokenizer.decode(written, skip_special_tokens=False)
        if not self._script.startswith(text) or len(text) >= len(self._script):
            return eos
        return self._tokenizer.encode(self._script[len(text):], add_special_tokens=False)[0]


def scripted(loaded: LoadedModel, chat_template: str) -> tuple[LoadedModel, ScriptedModel]:
    """`loaded` with `chat_template` and a scripted model (say() before each request)."""
    import copy

    tokenizer = copy.copy(loaded.require_tokenizer())
    tokenizer.chat_template = chat_template
    model = ScriptedModel(loaded.model, tokenizer, loaded.config.vocab_size)
    return dataclasses.replace(loaded, tokenizer=tokenizer, model=model), model
