"""Our GGUF container parser against the gguf package's reader."""

import gguf
import numpy as np
import pytest

from kvserve.errors import ModelLoadError
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.gguf_quants import ggml_type_name, tensor_nbytes
from kvserve.model.loader import embedded_model_path


def test_embedded_file_matches_the_gguf_reader():
    path = embedded_model_path()
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == field.contents(), key
    assert len(ours.tensors) == len(reader.tensors)
    for info, tensor in zip(ours.tensors, reader.tensors):
        assert info.name == tensor.name
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
        assert ggml_type_name(info.ggml_type) == tensor.tensor_type.name
        raw = ours.tensor_bytes(info, tensor_nbytes(ggml_type_name(info.ggml_type), info.shape))
        assert np.array_equal(raw, np.asarray(tensor.data).view(np.uint8).reshape(-1))


# Cut within the first key's length, within the first key, within the vocabulary.
@pytest.mark.parametrize("size", [30, 40, 100_000])
def test_truncated_file(tmp_path, size):
    path = embedded_model_path()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:size])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(cut)


def test_type_names_match_ggml():
    for qtype in gguf.GGMLQuantizationType:
        if qtype.value <= 30:
            assert ggml_type_name(qtype.value) == qtype.name
    assert ggml_type_name(9999) == "unknown type 9999"
