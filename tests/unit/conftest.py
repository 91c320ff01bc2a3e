"""Fixtures for the unit tests: the default model's real tokenizer, loaded once."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from services.common.tokenizer import TextTokenizer
from tests.unit.detok_helpers import load_text_tokenizer


@pytest.fixture(scope="module")
def text_tokenizer() -> TextTokenizer:
    return load_text_tokenizer()


@pytest.fixture(scope="module")
def tok(text_tokenizer) -> Tokenizer:
    return text_tokenizer.tokenizer
