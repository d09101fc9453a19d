"""Build the tiny local model of the embedded default: nothing is downloaded, ever.

`builtin:tiny-addition` resolves (grpo_cli.models.sources) to a Hugging Face model folder built
here on first use:
1. a byte-level BPE tokenizer trained on the task's own text (digits split one per token);
2. a Qwen2-architecture model (hidden 128, 4 layers, ~0.6M parameters) with random weights;
3. a short supervised warm start on the task, stopped early on purpose (greedy accuracy ~30%)
   so that sampled groups disagree and GRPO has signal to learn from;
4. `save_pretrained` of both into the cache folder, written to a temporary folder then renamed,
   so a killed build never leaves a half folder behind.

The trainer then loads the folder through the ordinary `from_pretrained` path, like any model.
`python scripts/build_tiny_model.py OUT_DIR` builds one into a folder of your choice; the tests
use the same builder.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from grpo_cli.data.tasks import SYNTHETIC_TASKS
from grpo_cli.models.cache import save_folder_atomically
from grpo_cli.rewards.math import exact_match

EOS_TOKEN = "<|endoftext|>"
# Bump when the builder changes, so cached folders from an older builder are not reused.
BUILDER_VERSION = 1


@dataclass(frozen=True)
class TinySpec:
    task: str
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 300
    warm_start_steps: int = 100
    warm_start_batch: int = 32
    warm_start_lr: float = 5e-4
    seed: int = 0


TINY_MODELS: dict[str, TinySpec] = {
    "tiny-addition": TinySpec(task="addition"),
}


def tiny_model_folder(name: str, cache: Path) -> str:
    """The folder of TINY_MODELS[name] in `cache`, built now if missing."""
    folder = cache / f"{name}-v{BUILDER_VERSION}"
    if not (folder / "config.json").is_file():
        build_tiny_model(TINY_MODELS[name], folder)
    return str(folder)


def build_tiny_model(spec: TinySpec, folder: Path, log=print) -> Path:
    """Train tokenizer, init model, warm-start it, save both into `folder` (atomically)."""
    rows, _ = SYNTHETIC_TASKS[spec.task]
    texts = [row["prompt"] + " " + row["answer"] for row in rows()]
    log(f"Building tiny model '{spec.task}' into {folder} (first use only) ...")
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    model = init_model(spec, tokenizer)
    accuracy = warm_start(model, tokenizer, rows(), spec)
    log(f"  warm start: {spec.warm_start_steps} steps, greedy accuracy on all problems {accuracy:.2f}")

    save_folder_atomically(folder, model, tokenizer)
    return folder


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`; digits are split one per token, as in Qwen2's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=128,
    )


def init_model(spec: TinySpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def warm_start(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: list[dict], spec: TinySpec) -> float:
    """Supervised steps on `prompt answer<eos>`, loss on the answer tokens only.

    Returns the greedy accuracy over all `rows` afterwards.
    """
    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr, weight_decay=0.0)
    model.train()
    for _ in range(spec.warm_start_steps):
        batch = [rng.choice(rows) for _ in range(spec.warm_start_batch)]
        input_ids, labels = _supervised_batch(tokenizer, batch)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return greedy_accuracy(model, tokenizer, rows)


def _supervised_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + " answer" + eos` with labels -100 everywhere but the answer and eos."""
    sequences, label_rows = [], []
    for row in rows:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        answer_ids = tokenizer(" " + row["answer"])["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, sequences))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in label_rows])
    return input_ids, labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 4) -> float:
    encoded = tokenizer([row["prompt"] for row in rows], return_tensors="pt", padding=True)
    output = model.generate(
        **encoded,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(exact_match([], texts, [row["answer"] for row in rows])) / len(rows)
