"""The linear layers' packed weights gathered onto huge pages (kvserve.model.weight_pages): same logits,
every packed tensor in the one buffer, nothing moved where the OS gives no huge pages."""

import pytest
import torch

from kvserve import huge_pages
from kvserve.arith import round_up
from kvserve.model import weight_pages
from kvserve.model.layers import Linear
from kvserve.model.loader import load_model
from tests.helpers import TINY_VOCAB, build_hf_model, paged_logits, save_hf_model, write_gguf
from tests.model.test_kquant_linear import Q4_K_M
from tests.test_huge_pages import THP, madvised_huge

TOKENS = torch.randint(0, TINY_VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()


def _packed(model) -> list[torch.Tensor]:
    return [tensor for module in model.modules() if isinstance(module, Linear)
            for tensor in (*module._parameters.values(), *module._buffers.values())
            if tensor is not None and tensor.dtype is torch.uint8 and tensor.nbytes >= 4096]


@pytest.mark.skipif(not THP, reason="transparent huge pages are off here")
@pytest.mark.parametrize("source", ["int4", "int8", "q4_k_m"])
def test_gathered_weights_give_the_same_logits_from_one_buffer(source, tmp_path, monkeypatch):
    if source == "q4_k_m":
        path = tmp_path / "q4_k_m.gguf"
        write_gguf(build_hf_model("llama-wide"), path, Q4_K_M)
        weights = "auto"
    else:
        path, weights = save_hf_model(build_hf_model("llama-gqa"), tmp_path), source
    with monkeypatch.context() as patch:
        patch.setattr(weight_pages, "huge_page_buffer", lambda nbytes: None)
        ordinary = load_model(path, weights_dtype=weights).model
    gathered = load_model(path, weights_dtype=weights).model
    tensors = _packed(gathered)
    assert tensors and all(madvised_huge(tensor.data_ptr()) for tensor in tensors)
    start = min(tensor.data_ptr() for tensor in tensors)
    assert start % huge_pages.HUGE_PAGE == 0 and all(tensor.data_ptr() % 64 == 0 for tensor in tensors)
    assert len({tensor.untyped_storage().data_ptr() for tensor in tensors}) == 1  # one buffer
    assert torch.equal(paged_logits(ordinary, TOKENS, [9, 7]), paged_logits(gathered, TOKENS, [9, 7]))


def test_nothing_moves_where_the_os_gives_no_huge_pages(tmp_path, monkeypatch):
    model = load_model(save_hf_model(build_hf_model("llama-gqa"), tmp_path), weights_dtype="int4").model
    before = [tensor.data_ptr() for tensor in _packed(model)]
    monkeypatch.setattr(huge_pages, "_madvise", lambda: None)
    assert weight_pages.gather_linear_weights(model) == 0
    assert [tensor.data_ptr() for tensor in _packed(model)] == before


def test_a_tensor_two_layers_share_moves_once(tmp_path):
    model = load_model(save_hf_model(build_hf_model("llama-gqa"), tmp_path), weights_dtype="int4").model
    first, second = model.layers[0].self_attn.o_proj, model.layers[1].self_attn.o_proj
    second.packed = first.packed  # one tensor in two modules
    moved = weight_pages.gather_linear_weights(model)
    if not THP:
        assert moved == 0
        return
    assert first.packed.data_ptr() == second.packed.data_ptr()
    assert moved == sum(round_up(tensor.nbytes, 64) for tensor in {t.data_ptr(): t for t in _packed(model)}.values())
