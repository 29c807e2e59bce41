"""A small real Hugging Face tokenizer with a chat template, written to a directory (for LocalTokenizer tests)."""
from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}")
WORDS = ["<unk>", "<s>", "</s>", "system", "user", "assistant", ":", "hello", "world", "be", "brief", "?", "hi",
         "what", "is", "it"]


def build_chat_tokenizer(directory: Path, template: str | None = TEMPLATE) -> Path:
    """Write ``tokenizer.json`` (word-level over :data:`WORDS`, ``<s>`` / ``</s>`` special) and
    ``tokenizer_config.json`` (with ``template`` as the chat template) into ``directory``; return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
