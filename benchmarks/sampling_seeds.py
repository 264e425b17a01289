"""vLLM sampling with a seed per request against one seeded generation RNG for the whole batch.

    python -m benchmarks.sampling_seeds [--model DIR] [--prompts 64] [--n 4] [--tokens 32] [--reps 3]

The engine used to give every request its own seed (``SamplingParams(seed=...)``): vLLM then draws
each seeded request's noise with its own generator, one small kernel per request and decode step
(its sampler says so: "this is slow"). Now the batch draws from the generation RNG, re-seeded once
per call (``rlhf_hpc.rollout.vllm_engine``). Same prompts, same sampling, both modes in one process
(in-process vLLM, one engine), chunked prefill off for both (the CPU build dies with per-request
seeds under chunked prefill). Reported: best wall time of ``--reps`` generate() calls and tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from rlhf_hpc.data.synthetic_tasks import addition_rows
from rlhf_hpc.models.real_model import prepare

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sampling_seeds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face model directory (default: python -m rlhf_hpc.models.real_model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = args.model or str(prepare())
    tok = AutoTokenizer.from_pretrained(model)
    rows = addition_rows(9, args.prompts, seed=0)
    prompts = [
        TokensPrompt(
            prompt_token_ids=tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for r in rows
    ]
    on_gpu = torch.cuda.is_available()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=16384,
        max_num_seqs=256,
        skip_tokenizer_init=True,
        seed=0,
        **({} if on_gpu else {"block_size": 32}),
    )
    common = dict(n=args.n, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, detokenize=False)

    def per_request():
        params = [SamplingParams(seed=1000 + i * args.n, **common) for i in range(len(prompts))]
        return llm.generate(prompts, params, use_tqdm=False)

    def engine_seeded():
        torch.manual_seed(1000)
        return llm.generate(prompts, SamplingParams(**common), use_tqdm=False)

    tokens = args.prompts * args.n * args.tokens
    results = {}
    engine_seeded()  # warm-up
    for name, fn in (("seed per request", per_request), ("one seeded RNG (now)", engine_seeded)):
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        results[name] = min(times)
        print(f"{name:>22}: {min(times):.2f} s for {tokens} tokens ({tokens / min(times):.0f} tokens/s)", flush=True)
    a, b = results.values()
    print(f"speed-up: {a / b:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
