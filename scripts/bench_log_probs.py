"""The update's log-prob pass at a real vocabulary: the LM head run by chunks on the hidden
states (algorithm/log_probs.py, the default) against the model's own [N, T + 1, V] logits.

    python scripts/bench_log_probs.py                    # V = 49152 and 151936, both paths, fp32
    python scripts/bench_log_probs.py --layers 24        # the full depth of Qwen2.5-0.5B
    python scripts/bench_log_probs.py --bf16             # under bfloat16 autocast

The model is Qwen2.5-0.5B's shape (hidden 896, MLP 4864, 14 heads, 2 key/value heads, tied
embeddings), randomly initialised and built here, with `--layers` decoder layers (4 by
default: the vocabulary's cost does not depend on depth, the decoder's grows linearly with
it), at each vocabulary size. One micro-batch of the update: 4 prompts x G = 4 completions,
130 prompt tokens shared by each group, 256 completion tokens; one policy forward and backward
(a full fine-tune, the loss the sum of the log-probs) after a warm-up pass that allocates the
gradients. Each case runs in its own process; reported: the peak RSS of that process above
its RSS before the pass (the update's activations and backward temporaries: the weights,
their gradients and the inputs are already resident), the median seconds of a pass, and the
ratio of the two vocabularies' peaks, per path.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from bench_step import cpu_line  # scripts/ is on the path of a script run from it

SCRIPTS = Path(__file__).resolve().parent
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
VOCABS = (49152, 151936)  # SmolLM2's, Qwen2.5's
PROMPTS, GROUP, PROMPT_TOKENS, NEW_TOKENS = 4, 4, 130, 256


def rss_now() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one_case(vocab: int, through_head: bool, layers: int, bf16: bool, repeats: int, out) -> None:
    """Runs in its own process: puts (peak bytes above the resident state, median seconds)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(SCRIPTS.parent / "src"))
    from grpo_cli.algorithm.log_probs import completion_log_probs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, num_hidden_layers=layers, **QWEN_05B)).train()
    count = PROMPTS * GROUP
    prompt = torch.randint(0, vocab, (PROMPTS, PROMPT_TOKENS)).repeat_interleave(GROUP, dim=0)
    completion = torch.randint(0, vocab, (count, NEW_TOKENS))
    rows = (prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def one_pass() -> float:
        start = time.perf_counter()
        with autocast:
            log_probs, _ = completion_log_probs(model, *rows, 1.0, False, GROUP, through_head)
        log_probs.sum().backward()
        return time.perf_counter() - start

    one_pass()  # the gradients now exist (zeroed in place below, never freed)
    seconds = []
    for _ in range(repeats):
        for parameter in model.parameters():
            parameter.grad.zero_()
        resident = rss_now()
        seconds.append(one_pass())
    out.put((peak_rss() - resident, statistics.median(seconds)))


def run(vocab: int, through_head: bool, layers: int, bf16: bool, repeats: int) -> tuple[int, float]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=one_case, args=(vocab, through_head, layers, bf16, repeats, out))
    process.start()
    result = out.get(timeout=3600)
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the Qwen2.5-0.5B shape (24 in full)")
    parser.add_argument(
        "--bf16", action="store_true", help="bfloat16 autocast (the CPU's bf16 units where it has them)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per case, after the warm-up")
    args = parser.parse_args()
    import torch

    print(f"CPU: {cpu_line()}; torch {torch.__version__}; {'bf16 autocast' if args.bf16 else 'float32'}")
    print(
        f"Qwen2.5-0.5B shape, {args.layers} layers; {PROMPTS} prompts x G = {GROUP}, P = {PROMPT_TOKENS}, T = {NEW_TOKENS}"
    )
    print("| path | V | update peak above resident | s/pass |")
    print("|---|---|---|---|")
    for through_head, name in ((True, "head by chunks"), (False, "full logits")):
        peaks = {}
        for vocab in VOCABS:
            peak, seconds = run(vocab, through_head, args.layers, args.bf16, args.repeats)
            peaks[vocab] = peak
            print(f"| {name} | {vocab} | {peak / 2**30:.2f} GiB | {seconds:.2f} |", flush=True)
        print(f"| {name} | ratio | {peaks[VOCABS[1]] / peaks[VOCABS[0]]:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
