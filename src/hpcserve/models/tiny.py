"""A tiny random-weight Llama with a BPE tokenizer trained on text shipped in this package.

Built locally on first use (no downloads), cached, never committed. head_dim 64 because vLLM's CPU
attention kernels reject smaller heads; 4 attention heads and 2 KV heads so tensor parallel 2 divides them.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock

from hpcserve.core.paths import cache_root

TINY_VERSION = "1"  # bump when the recipe changes: a new cache folder is built
CORPUS = Path(__file__).with_name("corpus.txt")


def tiny_model_path() -> Path:
    """The tiny model's folder, built on first use (safe against concurrent builders)."""
    target = cache_root() / f"tiny-llama-v{TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").is_file():
            build_tiny_model(target)
    return target


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_model(target: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    # Built on first use, often inside a command whose stderr the user reads: no progress bars there.
    transformers_logging.disable_progress_bar()
    tmp = target.with_name(target.name + ".partial")
    tokenizer = _train_tokenizer()
    # A chat template so /v1/chat/completions works like on real instruction models.
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    tokenizer.save_pretrained(tmp)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        torch_dtype="float32",  # type: ignore[call-arg]  # accepted at run time: transformers' older name of dtype
    )
    LlamaForCausalLM(config).save_pretrained(tmp)
    tmp.rename(target)
