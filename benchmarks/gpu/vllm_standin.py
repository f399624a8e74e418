"""`vllm serve` played by hpcserve's stand-in with a prefix cache (hpcserve.testing.standin --kv-tokens),
for CPU dry runs of routing_device.sh (no GPU, no vLLM): it takes vLLM's arguments.

    ROUTING_VLLM="python3 benchmarks/gpu/vllm_standin.py" bash benchmarks/gpu/routing_device.sh ...
    python3 vllm_standin.py serve MODEL --port P [--kv-cache-memory-bytes B] [--max-num-seqs S]
                            [--served-model-name m] [...]   (other vLLM flags are accepted and ignored)

The cache holds B / 131072 tokens (the Llama-3.1-8B shape's KV bytes a token), so hits follow a router's
choices as vLLM's would; --max-num-seqs is the stand-in's slots. Time: --prefill-us per uncached prompt
token, --decode-ms per output token (no GPU shared: this checks the scripts, it measures nothing).
It logs `GPU KV cache size: N tokens` as vLLM does (routing_device.sh reads it).
"""

from __future__ import annotations

import argparse
import os

from aiohttp import web

from hpcserve.testing.standin import BLOCK_TOKENS, make_app

BYTES_PER_TOKEN = 131072  # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes
DEFAULT_KV_BYTES = 8 * 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="m")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prefill-us", type=float, default=float(os.environ.get("STANDIN_PREFILL_US", "20")))
    parser.add_argument("--decode-ms", type=float, default=float(os.environ.get("STANDIN_DECODE_MS", "2")))
    args, ignored = parser.parse_known_args()
    kv_tokens = (args.kv_cache_memory_bytes or DEFAULT_KV_BYTES) // BYTES_PER_TOKEN // BLOCK_TOKENS * BLOCK_TOKENS
    print(f"vllm_standin: ignoring {' '.join(ignored)}", flush=True)
    print(f"INFO GPU KV cache size: {kv_tokens:,} tokens", flush=True)
    app = make_app(f"vllm{args.port}", token_delay_s=args.decode_ms / 1000, slots=args.max_num_seqs,
                   model=args.served_model_name, kv_tokens=kv_tokens, prefill_s_per_token=args.prefill_us / 1e6,
                   seed=args.port)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
