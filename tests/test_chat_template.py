import pytest

from kiln.native.chat_template import ChatTemplate, TemplateError, template_for


def test_default_model_template_renders_chatml(default_model):
    out = template_for(default_model).render([{"role": "user", "content": "Hi"}])
    assert out.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_template_is_a_clear_error():
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplate(None)


def test_sandbox_blocks_python_internals():
    t = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_raise_exception_reaches_the_caller():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}")
    with pytest.raises(TemplateError, match="first must be user"):
        t.render([{"role": "assistant", "content": "x"}])


def test_bad_message_shape_is_named():
    with pytest.raises(TemplateError, match=r"messages\[1\]"):
        ChatTemplate("{{ messages }}").render([{"role": "user", "content": "a"}, "oops"])
