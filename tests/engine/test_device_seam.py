"""Every tensor a step builds is made on the configured device: prefill chunks, decodes, drafts, sampling."""

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import ConfigError
from tests.device_guard import DeviceGuard
from tests.engine.spec_decode.test_drafting import OracleProposer
from tests.engine.test_engine import BYTES_PER_TOKEN
from tests.helpers import run_to_finals


def run(loaded, proposer=None):
    engine = Engine(EngineConfig(kv_cache_memory=64 * 4 * BYTES_PER_TOKEN, block_size=4, max_num_batched_tokens=8),
                    loaded=loaded, proposer=proposer)
    # Greedy with drafts, seeded sampling with penalties, logprobs: every path of the step's tensors.
    engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=6, temperature=0.8, seed=3, repetition_penalty=1.2,
                                                 presence_penalty=0.5, logprobs=2, ignore_eos=True))
    return run_to_finals(engine)


def test_a_step_creates_no_tensor_off_the_configured_device(tiny_models):
    loaded = tiny_models("llama-gqa")
    plain = run(loaded)
    continuation = {tuple(range(5, 25)): plain["0"].outputs[0].token_ids}
    with DeviceGuard("cpu") as guard:
        run(loaded, OracleProposer(continuation))
    assert not guard.violations, guard.report()


def test_the_guard_catches_a_runner_tensor_made_without_a_device(tiny_models, monkeypatch):
    import torch

    from kvserve.engine import runner as runner_module

    monkeypatch.setattr(runner_module.ModelRunner, "_tensor", lambda self, values: torch.tensor(values))
    with DeviceGuard("cpu") as guard:
        run(tiny_models("llama-gqa"))
    assert any(v.factory == "tensor" and not v.named_device for v in guard.violations), guard.report()


def test_a_device_without_kernels_is_refused_before_the_model_loads():
    with pytest.raises(ConfigError, match="CPU only"):
        Engine(EngineConfig(device="cuda"))
