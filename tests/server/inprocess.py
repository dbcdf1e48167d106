"""The app in process (no port, no subprocess): a tiny random model with a tiny character tokenizer,
or any loaded model, behind Starlette's TestClient (which runs the app's lifespan)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.model.tokenizer import Tokenizer
from kvserve.platform import run_on_compute_thread
from kvserve.server.app import create_app
from kvserve.server.core.serving import ServerSettings

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
_MERGES = [("T", "h"), ("Th", "e"), (" ", "c"), ("a", "p"), ("ap", "i"), ("api", "t"), ("apit", "a"),
           ("apita", "l"), (" c", "apital"), ("i", "s")]


def tiny_tokenizer() -> Tokenizer:
    """Characters (printable ASCII and newline; anything else is <unk>) plus a few merges, so some
    tokens span several characters ("The", " capital"); ChatML specials and template. 110 ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    pieces = _SPECIALS + [chr(c) for c in range(32, 127)] + ["\n"] + ["".join(m) for m in _MERGES]
    backend = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=_MERGES,
                                     unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(_SPECIALS[:3])
    return Tokenizer(backend, bos_token=None, eos_token="<|im_end|>", chat_template=CHATML)


def with_tiny_tokenizer(loaded: LoadedModel) -> LoadedModel:
    return dataclasses.replace(loaded, tokenizer=tiny_tokenizer())


@contextlib.contextmanager
def serve_in_process(loaded: LoadedModel, kv_cache_memory: str = "4MiB", kv_disk_path: str | None = None,
                     clock: Callable[[], float] | None = None, engine_options: dict | None = None,
                     **settings) -> Iterator[TestClient]:
    """A TestClient on a fresh engine for `loaded`; `settings` override ServerSettings' defaults,
    `engine_options` EngineConfig's; `clock` times pin TTLs.

    Steps run on the compute thread with one torch thread: these models gain nothing from a second
    OpenMP thread, and on a busy machine its spin-waits made a tiny model's step ~30x slower.
    """
    config = EngineConfig(kv_cache_memory=kv_cache_memory, kv_disk_path=kv_disk_path, **(engine_options or {}))
    engine = Engine(config, loaded=loaded, clock=clock)
    app = create_app(engine, ServerSettings(model_name="tiny", **settings))
    threads = run_on_compute_thread(torch.get_num_threads)
    run_on_compute_thread(torch.set_num_threads, 1)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client
    finally:
        run_on_compute_thread(torch.set_num_threads, threads)


def assert_idle_and_intact(client: TestClient) -> None:
    """Nothing running or waiting, no block held, block accounting intact, /health ok."""
    assert client.get("/health").status_code == 200
    report = client.get("/v1/kv_cache").json()
    assert report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0, report
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok", report
