"""Fixtures for the unit tests: the default model's real tokenizer, loaded once; a store
database of each kind for a module's store tests."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from services.common.tokenizer import TextTokenizer
from tests.postgres import database_url
from tests.unit.detok_helpers import load_text_tokenizer


@pytest.fixture(scope="module")
def text_tokenizer() -> TextTokenizer:
    return load_text_tokenizer()


@pytest.fixture(scope="module")
def tok(text_tokenizer) -> Tokenizer:
    return text_tokenizer.tokenizer


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def url(request, tmp_path_factory):
    """A store database for the module's tests, on SQLite and on a throwaway PostgreSQL server."""
    with database_url(request.param, tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])) as url:
        yield url
