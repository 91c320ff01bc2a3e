"""docs/configuration.md is the config dataclasses' setting() fields, rendered (config_doc.py): the
manual and the code cannot drift apart, and no key goes undocumented."""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from services.common import config
from services.common.config_doc import TABLES, keys, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_manual_is_what_the_code_says():
    assert DOC.read_text() == render(), "run: python -m services.common.config_doc > docs/configuration.md"


def test_every_table_of_the_config_is_in_the_manual():
    documented = {cls for _, cls, _ in TABLES}
    dataclasses = {obj for obj in vars(config).values()
                   if isinstance(obj, type) and is_dataclass(obj) and obj is not config.Bounds}
    assert dataclasses - documented == {config.ServiceConfig}     # its keys show in each service's table


@pytest.mark.parametrize("cls", [cls for _, cls, _ in TABLES], ids=lambda cls: cls.__name__)
def test_every_key_says_what_it_does(cls):
    nested = {f.name for f in fields(cls) if not f.metadata}
    assert all(f.metadata["doc"] for f in keys(cls))
    assert all(is_dataclass(f.default_factory()) or isinstance(f.default_factory(), list)
               for f in fields(cls) if f.name in nested), "a nested table, not a key without setting()"
