"""tokenizer.ChatTemplate: compiled once, rendered per conversation (pure Python, no model)."""
from __future__ import annotations

import pytest

from services.common.tokenizer import ChatTemplate

SOURCE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_each_conversation_renders_its_own_text_with_the_template_compiled_once():
    template = ChatTemplate(SOURCE, "<s>", "</s>")
    first = template.render([{"role": "user", "content": "Hi"}])
    compiled = template._compiled
    second = template.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Ok?"}],
                             add_generation_prompt=False)
    assert first == "<s><user>Hi<assistant>"
    assert second == "<s><system>Be terse.<user>Ok?"
    assert compiled is not None and template._compiled is compiled


def test_raise_exception_in_a_template_is_a_value_error_every_time():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x",
                            None, None)
    for _ in range(2):
        with pytest.raises(ValueError, match="chat template error: user first"):
            template.render([{"role": "assistant", "content": "no"}])
    assert template.render([{"role": "user", "content": "yes"}]) == "x"
