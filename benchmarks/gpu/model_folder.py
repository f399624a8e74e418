"""A Llama-3.1-8B-shaped model folder, optionally with real bf16 safetensors of random values.

usage: model_folder.py DIR [--weights] [--shards 4] [--layers 32 --hidden 4096 --inter 14336 --heads 32
                         --kv-heads 8 --vocab 128256 --max-pos 8192] [--tokenizer words|tiny] [--device cuda]

The project's one builder of model folders for benchmarks (the tests' tiny model is the package's own:
hpcserve.models.tiny, `builtin:tiny-llama`).

- config.json: LlamaForCausalLM, the 8B shape, vocab 128256 (the real vocabulary size, so the checkpoint is
  the real 16.06 GB: embed_tokens and lm_head are 2 x 1.05 GB of it).
- A tokenizer with exactly that vocabulary: id 0 '<s>', 1 '</s>', 2 '<unk>', every other id N is the word
  'wN' (WordLevel, split on whitespace, no BOS added). Any id sequence decodes to 'wA wB ...' and encodes
  back to exactly the same ids, so prompts of an exact token length (and exact shared prefixes) are plain
  strings: what vllm-router's cache_aware policy (it matches request text) and vLLM's prefix cache both see.
- --tokenizer tiny: the tiny model's BPE tokenizer and chat template instead, vocab its size (about 1,000):
  the folder `vllm bench serve`'s random prompts were measured on in ttft_h200.sh and run_h200.sh.
- --weights: model-0000K-of-0000N.safetensors (HF names, bf16, N(0, 0.02), norms 1) plus
  model.safetensors.index.json. Each tensor is drawn on the GPU, copied to the host and written straight
  into the file (own safetensors writer: header + raw bytes, no second copy), then fsync'd. Prints timings.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time
from pathlib import Path


def build_tokenizer(target: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(target)
    ids = [5, 100, vocab_size - 1, 3]
    assert hf.encode(hf.decode(ids), add_special_tokens=True) == ids, "tokenizer does not round-trip"


def copy_tiny_tokenizer(target: Path) -> int:
    """The tiny model's tokenizer files (built on first use); returns its vocabulary size."""
    import shutil

    from transformers import AutoTokenizer

    from hpcserve.models.tiny import tiny_model_path

    tiny = tiny_model_path()
    for item in tiny.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, target / item.name)
    return len(AutoTokenizer.from_pretrained(tiny))


def tensor_specs(a) -> list[tuple[str, list[int], str]]:
    """(name, shape, init) in checkpoint order. init: 'normal' or 'ones'."""
    hd = a.hidden // a.heads
    specs = [("model.embed_tokens.weight", [a.vocab, a.hidden], "normal")]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", [a.hidden], "ones"),
                  (p + "self_attn.q_proj.weight", [a.heads * hd, a.hidden], "normal"),
                  (p + "self_attn.k_proj.weight", [a.kv_heads * hd, a.hidden], "normal"),
                  (p + "self_attn.v_proj.weight", [a.kv_heads * hd, a.hidden], "normal"),
                  (p + "self_attn.o_proj.weight", [a.hidden, a.heads * hd], "normal"),
                  (p + "post_attention_layernorm.weight", [a.hidden], "ones"),
                  (p + "mlp.gate_proj.weight", [a.inter, a.hidden], "normal"),
                  (p + "mlp.up_proj.weight", [a.inter, a.hidden], "normal"),
                  (p + "mlp.down_proj.weight", [a.hidden, a.inter], "normal")]
    specs += [("model.norm.weight", [a.hidden], "ones"), ("lm_head.weight", [a.vocab, a.hidden], "normal")]
    return specs


def numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def split_shards(specs, n_shards: int) -> list[list]:
    total = sum(numel(s) for _, s, _ in specs)
    shards, cur, acc = [], [], 0
    for spec in specs:
        cur.append(spec)
        acc += numel(spec[1])
        if acc >= total * (len(shards) + 1) / n_shards and len(shards) < n_shards - 1:
            shards.append(cur)
            cur = []
    if cur:
        shards.append(cur)
    return shards


def write_shard(path: Path, specs, device: str, gen) -> tuple[int, float, float]:
    """Own safetensors writer: 8-byte header length, JSON header, then the raw bf16 bytes."""
    import torch

    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        nbytes = numel(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * ((8 - len(hbytes) % 8) % 8)
    t_gen = t_write = 0.0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for name, shape, init in specs:
            t0 = time.perf_counter()
            if init == "ones":
                t = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
            host = t.to("cpu").view(torch.int16).numpy()
            del t
            t1 = time.perf_counter()
            f.write(memoryview(host).cast("B"))
            t_gen += t1 - t0
            t_write += time.perf_counter() - t1
        t0 = time.perf_counter()
        f.flush()
        os.fsync(f.fileno())
        t_write += time.perf_counter() - t0
    return 8 + len(hbytes) + off, t_gen, t_write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--weights", action="store_true")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--max-pos", type=int, default=8192)
    ap.add_argument("--tokenizer", choices=["words", "tiny"], default="words")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    target = Path(a.dir)
    target.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.tokenizer == "tiny":
        a.vocab = copy_tiny_tokenizer(target)
    else:
        build_tokenizer(target, a.vocab)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden,
              "intermediate_size": a.inter, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
              "num_key_value_heads": a.kv_heads, "head_dim": a.hidden // a.heads, "vocab_size": a.vocab,
              "max_position_embeddings": a.max_pos, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
              "tie_word_embeddings": False}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    report = {"dir": str(target), "vocab": a.vocab, "tokenizer_s": round(time.perf_counter() - t0, 2)}
    if a.weights:
        import torch

        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        shards = split_shards(tensor_specs(a), a.shards)
        weight_map, total, t_gen, t_write = {}, 0, 0.0, 0.0
        t_all = time.perf_counter()
        for k, specs in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            size, g, w = write_shard(target / fname, specs, device, gen)
            total += size
            t_gen += g
            t_write += w
            weight_map.update({name: fname for name, _, _ in specs})
        index = {"metadata": {"total_size": sum(numel(s) * 2 for _, s, _ in tensor_specs(a))}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        wall = time.perf_counter() - t_all
        report.update({"device": device, "shards": len(shards), "bytes": total, "gb": round(total / 1e9, 3),
                       "draw_and_d2h_s": round(t_gen, 2), "write_and_fsync_s": round(t_write, 2),
                       "wall_s": round(wall, 2), "write_gb_s": round(total / 1e9 / max(t_write, 1e-9), 2)})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
