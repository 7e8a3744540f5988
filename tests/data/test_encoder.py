"""The loop's prompt encoder (``run/driver.py:make_encoder``): the chat template, ``data.fewshot`` as
earlier turns of the chat, and the plain path."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hpcrl.errors import ConfigError, HpcrlError
from hpcrl.run.driver import make_encoder
from tests.conftest import compose

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHOTS = {"1 + 2 =": "<answer>3</answer>", "4 - 1 =": "<answer>3</answer>"}


def chain_sum(**changes: object):
    data = compose("data=reasoning_gym_chain_sum").data
    for key, value in changes.items():
        setattr(data, key, value)
    return data


@pytest.fixture(scope="module")
def chat_dir(tiny_dir, tmp_path_factory):
    """The tiny model's tokenizer with a ChatML template."""
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = CHATML
    out = tmp_path_factory.mktemp("chat")
    tok.save_pretrained(out)
    return out


def test_prompts_go_through_the_chat_template_as_token_ids(chat_dir):
    data = compose("data=reasoning_gym_chain_sum").data
    encode, _pad = make_encoder(chat_dir, data)
    tok = AutoTokenizer.from_pretrained(chat_dir)
    ids = encode("7 + 1 =")
    assert all(isinstance(i, int) for i in ids)  # not a BatchEncoding's keys (transformers 5)
    want = "<|im_start|>user\n7 + 1 =<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok.encode(want, add_special_tokens=False)


def test_fewshot_problems_are_earlier_turns_through_the_template(chat_dir):
    encode, _pad = make_encoder(chat_dir, chain_sum(fewshot=SHOTS))
    tok = AutoTokenizer.from_pretrained(chat_dir)  # a character tokenizer: the text's order is kept
    tags = "\nGive your final answer between <answer> and </answer> tags."
    assert encode("7 + 1 =") == tok.encode(
        f"<|im_start|>user\n1 + 2 ={tags}<|im_end|>\n<|im_start|>assistant\n<answer>3</answer><|im_end|>\n"
        f"<|im_start|>user\n4 - 1 ={tags}<|im_end|>\n<|im_start|>assistant\n<answer>3</answer><|im_end|>\n"
        "<|im_start|>user\n7 + 1 =<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )


@pytest.mark.parametrize("key", ["fewshot", "system_prompt", "chat_template_kwargs"])
def test_chat_settings_need_the_chat_template(tiny_dir, key):
    value = {
        "fewshot": SHOTS,
        "system_prompt": "Be brief.",
        "chat_template_kwargs": {"enable_thinking": False},
    }[key]
    with pytest.raises(ConfigError) as err:
        chain_sum(**{key: value, "template": "plain"}).check()
    assert str(err.value) == (
        f"data.{key} goes through the chat template, and data.template=plain prompts without it: "
        f"use another data.template or drop data.{key}"
    )
    with pytest.raises(HpcrlError, match=f"has none: drop data.{key}"):
        make_encoder(tiny_dir, chain_sum(**{key: value}))  # the tiny model's tokenizer has none


THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)


def test_system_prompt_comes_first_and_template_kwargs_reach_the_template(chat_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(chat_dir)
    tok.chat_template = THINKING
    tok.save_pretrained(tmp_path)
    data = chain_sum(fewshot=dict(list(SHOTS.items())[:1]), system_prompt="Be brief.")
    data.chat_template_kwargs = {"enable_thinking": False}
    encode, _pad = make_encoder(tmp_path, data)
    tags = "\nGive your final answer between <answer> and </answer> tags."
    assert encode("7 + 1 =") == tok.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n1 + 2 ={tags}<|im_end|>\n<|im_start|>assistant\n<answer>3</answer><|im_end|>\n"
        "<|im_start|>user\n7 + 1 =<|im_end|>\n<|im_start|>assistant\n<think></think>",
        add_special_tokens=False,
    )


def test_a_template_file_wraps_each_problem_and_keeps_its_other_braces(tmp_path):
    from hpcrl.config.preflight import check_paths, check_template
    from hpcrl.data.templates import render_prompt

    path = tmp_path / "prompt.txt"
    path.write_text("Solve: {problem}\nAnswer in \\boxed{}.")
    data = chain_sum(template=str(path))
    check_template(data)
    check_paths(data)
    assert render_prompt(str(path), "2 + 2") == "Solve: 2 + 2\nAnswer in \\boxed{}."
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholder")
    with pytest.raises(ConfigError, match=r"must hold \{problem\} exactly once .* holds it 0 times"):
        check_paths(chain_sum(template=str(bad)))
    with pytest.raises(ConfigError, match=r"data.template=.*missing.txt: no such file"):
        check_paths(chain_sum(template=str(tmp_path / "missing.txt")))
    with pytest.raises(ConfigError, match=r"or a file ending in .txt, .jinja, .md"):
        check_template(chain_sum(template="nonsense"))
