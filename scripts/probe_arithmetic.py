"""How well does SmolLM2-135M-Instruct do arithmetic before any training? The probe behind the
choice of `conf=smollm2_arithmetic`'s task (README, "The real-model preset").

For each task and system prompt: greedy replies (chat template, float32) to N problems, and
  accuracy          the reply is well-formed and right (the preset's reward),
  well-formed       the reply is the number alone, or after the sum written out ("7 * 8 = 56"),
  among well-formed accuracy / well-formed: what the model knows once the format is set aside,
  last number       the reply's last number is right (a lenient reading: `47 + 5 = 52` counts).

    .venv/bin/python scripts/probe_arithmetic.py --problems 96
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_cli.data.tasks import ARITHMETIC_TASKS, arithmetic_rows
from grpo_cli.models.sources import resolve_model

# conf/reward/arithmetic.yaml's layout: the number alone, or after the sum written out.
WELL_FORMED = re.compile(r"\s*(\d+ ?[-+*] ?\d+ ?= ?)?\d+\.?\s*")
LAST_NUMBER = re.compile(r"-?\d+")
SYSTEM_PROMPTS = {
    "model default": None,
    "calculator": "You are a calculator. Reply with the number only.",
}


def greedy_replies(model, tokenizer, messages_list: list[list[dict]], max_new_tokens: int) -> list[str]:
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages_list]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def sampled_replies(model, tokenizer, messages_list, max_new_tokens: int, samples: int) -> list[list[str]]:
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages_list]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
        )
    replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return [replies[i * samples : (i + 1) * samples] for i in range(len(texts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=96)
    parser.add_argument("--tasks", default=",".join(ARITHMETIC_TASKS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument(
        "--samples", type=int, default=0, help="also pass@k of k sampled replies (temperature 1, last number)"
    )
    parser.add_argument("--system", default=",".join(SYSTEM_PROMPTS))
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="or a checkpoint folder of a run")
    parser.add_argument("--by-operator", action="store_true", help="accuracy of each operator apart")
    parser.add_argument("--show", type=int, default=3, help="replies printed per task")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print(f"{'task':<10} {'system prompt':<14} {'acc':>5} {'formed':>6} {'among':>5} {'last#':>5}  s")
    for task in args.tasks.split(","):
        pool = arithmetic_rows(task, "eval")
        rows = random.Random(0).sample(pool, min(args.problems, len(pool)))
        for label in args.system.split(","):
            system = SYSTEM_PROMPTS[label]
            start = time.perf_counter()
            messages = [
                ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": r["prompt"]}]
                for r in rows
            ]
            replies = [reply.strip() for reply in greedy_replies(model, tokenizer, messages, args.max_new_tokens)]
            formed = [bool(WELL_FORMED.fullmatch(reply)) for reply in replies]
            last = [(LAST_NUMBER.findall(reply) or [""])[-1] == r["answer"] for reply, r in zip(replies, rows)]
            right = [ok and well for ok, well in zip(last, formed)]
            acc, n_formed = sum(right) / len(rows), sum(formed)
            among = sum(right) / n_formed if n_formed else float("nan")
            print(
                f"{task:<10} {label:<14} {acc:5.2f} {n_formed / len(rows):6.2f} {among:5.2f} "
                f"{sum(last) / len(rows):5.2f}  {time.perf_counter() - start:.0f}"
            )
            if args.samples:
                torch.manual_seed(0)
                sampled = sampled_replies(model, tokenizer, messages, args.max_new_tokens, args.samples)
                solved = [
                    any((LAST_NUMBER.findall(reply) or [""])[-1] == r["answer"] for reply in group)
                    for group, r in zip(sampled, rows)
                ]
                mean_right = sum(
                    (LAST_NUMBER.findall(reply) or [""])[-1] == r["answer"]
                    for group, r in zip(sampled, rows)
                    for reply in group
                )
                print(
                    f"    sampled: pass@{args.samples} {sum(solved) / len(rows):.2f}, mean {mean_right / len(rows) / args.samples:.2f}"
                )
            if args.by_operator:
                for op in "+-*":
                    picked = [ok for ok, r in zip(right, rows) if f" {op} " in r["prompt"]]
                    if picked:
                        print(f"    {op}: accuracy {sum(picked) / len(picked):.2f} on {len(picked)}")
            for r, reply in list(zip(rows, replies))[: args.show]:
                print(f"    {r['prompt']!r} -> {reply[:60]!r} (answer {r['answer']})")


if __name__ == "__main__":
    main()
