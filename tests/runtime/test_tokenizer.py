"""The character tokenizer, its chat template, and loading tokenizers from a config."""

import pytest

from tigon.runtime.config import ConfigError, ModelConfig
from tigon.runtime.tokenizer import CHARACTERS, SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "10+5="},
    {"role": "assistant", "content": "15"},
]


def test_vocabulary_and_special_tokens(tokenizer):
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS) == 100
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id] == [
        0,
        1,
        2,
        3,
    ]
    assert len(set(tokenizer.get_vocab().values())) == 100


def test_one_token_per_character_and_round_trip(tokenizer):
    text = "Hello, world!\n  12+34=46 ~{}[]\\\"'`"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_bos_only_with_special_tokens_and_unknown_characters(tokenizer):
    assert tokenizer("ab")["input_ids"] == [tokenizer.bos_token_id] + tokenizer.encode("ab", add_special_tokens=False)
    ids = tokenizer.encode("a\té", add_special_tokens=False)
    assert ids[1:] == [tokenizer.unk_token_id] * 2
    assert tokenizer.encode("x<eos>", add_special_tokens=False)[-1] == tokenizer.eos_token_id


def test_chat_template_renders_roles_and_eos_after_each_turn(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<bos><|system|>\nYou add.<eos><|user|>\n1+2=<eos><|assistant|>\n3<eos>"
        "<|user|>\n10+5=<eos><|assistant|>\n15<eos>"
    )
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><|system|>\nYou add.<eos><|user|>\n1+2=<eos><|assistant|>\n"
    assert text.startswith(prompt)


def test_chat_template_generation_markers_mask_assistant_content(tokenizer):
    encoded = tokenizer.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, keep in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if keep]
    assert tokenizer.convert_ids_to_tokens(masked) == ["3", "<eos>", "1", "5", "<eos>"]


def test_chat_template_rejects_unknown_role(tokenizer):
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_load_char_tokenizer():
    tokenizer = load_tokenizer(ModelConfig(config_name="llama", tokenizer="char"))
    assert len(tokenizer) == 100 and tokenizer.chat_template


def test_load_tokenizer_directory_round_trip(tmp_path):
    original = build_char_tokenizer()
    original.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(ModelConfig(config_name="llama", tokenizer=str(tmp_path / "tok")))
    text = "7*8=56\n"
    assert loaded(text)["input_ids"] == original(text)["input_ids"]
    assert loaded.chat_template == original.chat_template
    assert loaded.pad_token_id == original.pad_token_id == 0


def test_load_tokenizer_defaults_to_model_path(tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path)
    assert len(load_tokenizer(ModelConfig(path=str(tmp_path)))) == 100


def test_missing_tokenizer_directory_names_the_path(tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(ConfigError, match="model.tokenizer: .*no-such-tokenizer does not exist"):
        load_tokenizer(ModelConfig(config_name="llama", tokenizer=str(missing)))


def test_pad_token_falls_back_to_eos(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(ModelConfig(config_name="llama", tokenizer=str(tmp_path)))
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == loaded.eos_token_id == 2
