"""Tokenizers for training runs: tigon's character tokenizer, or a tokenizer by Hub id or directory.

    tokenizer = load_tokenizer(config.model)        # "char", a Hub id, or a directory with tokenizer files

The character tokenizer needs no download: one token per printable ASCII character and newline, plus
`<pad>`, `<bos>`, `<eos>` and `<unk>`. Like Llama's, it puts `<bos>` in front of `tokenizer(text)` (not in
front of `encode(..., add_special_tokens=False)`), and it carries a chat template:

    <bos><|system|>\\n{content}<eos><|user|>\\n{content}<eos><|assistant|>\\n{content}<eos>...

`add_generation_prompt=True` appends `<|assistant|>\\n`. The assistant's content and its `<eos>` sit inside
`{% generation %}` markers, so `apply_chat_template(..., return_assistant_tokens_mask=True)` works too; tigon's
data pipeline does not rely on those markers (most released templates lack them): it finds the assistant
spans by rendering prefixes of the conversation (see `tigon.runtime.data`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from .config import ModelConfig

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = ("\n",) + tuple(chr(code) for code in range(32, 127))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (vocabulary of 100) with a chat template; characters outside it become <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()  # join characters without spaces
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give the tokenizer a pad token if it lacks one: its eos token (padding never carries loss or attention)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has neither a pad token nor an eos token; "
                "add one to its special_tokens_map.json (e.g. pad_token) or use model.tokenizer: char"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer: model.tokenizer ('char', a Hub id, a local or object-store directory), else model.path."""
    source = model_config.tokenizer or model_config.path
    if source == "char":
        return build_char_tokenizer()
    if source is None:  # the config validator already forbids this; kept for configs built by hand
        raise ValueError("no tokenizer configured: set model.tokenizer to a Hub id, a local directory or 'char'")
    from transformers import AutoTokenizer

    from .hub import local_directory

    key = "model.tokenizer" if model_config.tokenizer else "model.path"
    directory = local_directory(source, model_config, key, tokenizer_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=model_config.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{key}: cannot load a tokenizer from {source} ({directory}): {error}; it needs tokenizer files "
            "(tokenizer.json or tokenizer_config.json), or set model.tokenizer: char for tigon's character tokenizer"
        ) from error
    return ensure_pad_token(tokenizer)
