"""A Llama-3.1-8B-shaped model folder for `--load-format dummy` runs: config.json plus the tiny
model's tokenizer (weights are random: vLLM's dummy loader never reads any). Usage: make_llama8b.py DIR"""

import json
import shutil
import sys
from pathlib import Path

from transformers import AutoTokenizer

from hpcserve.models.tiny import tiny_model_path

target = Path(sys.argv[1])
target.mkdir(parents=True, exist_ok=True)
tiny = tiny_model_path()
for item in tiny.iterdir():
    if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
        shutil.copy(item, target / item.name)
vocab = len(AutoTokenizer.from_pretrained(tiny))
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "vocab_size": vocab, "max_position_embeddings": 8192,
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
          "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}
(target / "config.json").write_text(json.dumps(config))
print(target, "vocab", vocab)
