"""Build a tiny random-weight chat model for real-engine tests (no model hub needed).

The model is a 4-layer Qwen2 (hidden size 256, about 5M parameters, bf16) with a byte-level BPE tokenizer of
8,192 tokens trained on the local Python standard library sources and a ChatML chat template. Its answers are
noise; what matters for cpmemory is that a real vLLM server tokenizes, caches prefixes and emits KV events for it.

Run with the vLLM venv's interpreter (it needs torch, transformers and tokenizers)::

    /root/.cache/cpmemory/vllm-venv/bin/python scripts/build_tiny_model.py /root/.cache/cpmemory/tiny-model
"""
from __future__ import annotations

import argparse
import glob
import os
import sysconfig
import time

VOCABULARY_SIZE = 8192
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('')) + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(corpus_files: list[str]):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCABULARY_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(corpus_files, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def build_model(tokenizer, seed: int, hidden: int = 256, intermediate: int = 768, layers: int = 4, heads: int = 4):
    """Create the random-weight Qwen2 model (bf16, tied embeddings, 2 KV heads)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=VOCABULARY_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=end_of_turn,
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = end_of_turn
    return model


def main() -> None:
    """Parse arguments, build the tokenizer and the model, save both into the output folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="folder to write the model into")
    parser.add_argument("--seed", type=int, default=0)
    # the default shape is the CI model's; a wider one (e.g. --hidden 1024 --intermediate 4096 --layers 2 --heads 8,
    # the same 2 KiB of KV cache per token) spends most of its prefill in linear layers, as large models do
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    arguments = parser.parse_args()
    started = time.perf_counter()
    corpus = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
    tokenizer = train_tokenizer(corpus)
    tokenizer.save_pretrained(arguments.output)
    model = build_model(tokenizer, arguments.seed, arguments.hidden, arguments.intermediate, arguments.layers,
                        arguments.heads)
    model.save_pretrained(arguments.output)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    print(f"built {arguments.output}: {parameters} parameters, vocabulary {len(tokenizer)}, "
          f"{time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
