"""GGUF files written from tiny transformers models (llama.cpp layout) load to the same logits."""

import numpy as np
import pytest
import torch

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.model.gguf import load_gguf, unpermute_qk
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, build_hf_model, reference_logits, write_gguf
from tests.model.test_checkpoint_parity import DECODE_STEPS, PROMPT_LEN, cached_logits

MIXES = {
    "f32": {},
    "q8_0": {"proj": "Q8_0", "embed": "Q8_0"},
    "q4_1-mixed": {"proj": "Q4_1", "embed": "Q8_0", "lm_head": "Q8_0"},
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mha-tied"])
def test_gguf_matches_dequantized_reference(variant, mix, tmp_path):
    hf_model = build_hf_model(variant)
    path = tmp_path / "tiny.gguf"
    reference_weights = write_gguf(hf_model, path, MIXES[mix])
    hf_model.load_state_dict(reference_weights, strict=False)

    loaded = load_model(path)
    assert loaded.tokenizer is None  # no tokenizer metadata in this file
    assert loaded.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    token_ids = torch.randint(0, TINY_VOCAB, (PROMPT_LEN + DECODE_STEPS,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = reference_logits(hf_model, token_ids)
    assert (cached_logits(loaded.model, token_ids) - expected).abs().max().item() <= 1e-4


def test_mixed_file_reports_its_tensor_types(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(build_hf_model("llama-gqa"), path, MIXES["q4_1-mixed"])
    types = load_gguf(path).tensor_types
    assert set(types) == {"F32", "Q4_1", "Q8_0"}


def test_unpermute_inverts_llama_cpp_permutation():
    from tests.helpers import _permute_for_gguf

    weight = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    permuted = torch.from_numpy(_permute_for_gguf(weight, 4))
    assert torch.equal(unpermute_qk(permuted, 4), torch.from_numpy(weight))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'falcon' is not supported"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(path)
