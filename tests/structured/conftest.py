import pytest

from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.vocabulary import build_grammar_vocabulary
from tests.helpers import TINY_VOCAB
from tests.server.inprocess import tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_vocabulary():
    """llguidance's view of the tiny character tokenizer over the tiny models' 160 logits."""
    return build_grammar_vocabulary(tiny_tokenizer(), TINY_VOCAB)


@pytest.fixture()
def compiler(tiny_vocabulary):
    return GrammarCompiler(tiny_vocabulary)
