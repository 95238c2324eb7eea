"""Character-level tokenizers built locally with the ``tokenizers`` library (no downloads).

Every character of the alphabet is one token; anything else maps to ``<unk>``. Encoding
prepends ``<bos>`` (``add_special_tokens=False`` turns that off), and decoding concatenates
characters. The chat template has no role markers, to keep sequences short for tiny
models: it renders ``<bos>``, then each message's content, with ``<eos>`` after each
assistant message. Assistant content is wrapped in ``{% generation %}`` so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` yields an SFT loss mask.
"""

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Arithmetic, fractions and decimals, and the lowercase letters of tags like <answer>.
EMBEDDED_ALPHABET = string.digits + "+-*/=().,:? \n<>" + string.ascii_lowercase

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer(alphabet: str, model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Ids are the special tokens in ``SPECIAL_TOKENS`` order (pad=0, bos=1, eos=2, unk=3),
    then the alphabet's characters in order, so the same alphabet always gives the same ids."""
    if len(set(alphabet)) != len(alphabet):
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ValueError(f"alphabet has duplicate characters {duplicates}: each character must appear once")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One piece per character, newlines included (a plain "." would not match them).
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def embedded_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the embedded toy task (vocabulary of 55 tokens)."""
    return build_char_tokenizer(EMBEDDED_ALPHABET)
