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


def test_fewshot_needs_the_chat_template(tiny_dir):
    with pytest.raises(ConfigError) as err:
        chain_sum(fewshot=SHOTS, template="plain").check()
    assert str(err.value) == (
        "data.fewshot is shown as earlier chat turns, and data.template=plain prompts without the chat "
        "template: use another data.template or drop data.fewshot"
    )
    with pytest.raises(HpcrlError, match="has no chat template"):
        make_encoder(tiny_dir, chain_sum(fewshot=SHOTS))  # the tiny model's tokenizer has none
