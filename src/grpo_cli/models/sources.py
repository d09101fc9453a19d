"""Where a model's folder is: built-in names and GGUF files become folders in the cache.

`resolve_model` is the one place that turns `model.name_or_path` into something
`from_pretrained` reads: `builtin:tiny-addition` (built here, grpo_cli.models.tiny),
`builtin:smollm2-135m-instruct` (a real model from a PyPI wheel, grpo_cli.models.pretrained), a `.gguf`
file (converted once, grpo_cli.models.pretrained); a folder or hub id is returned as it is.
"""

from __future__ import annotations

from pathlib import Path

from grpo_cli.models.cache import cache_root

BUILTIN_PREFIX = "builtin:"


def builtin_names() -> list[str]:
    from grpo_cli.models.pretrained import WHEEL_MODELS
    from grpo_cli.models.tiny import TINY_MODELS

    return [BUILTIN_PREFIX + name for name in [*TINY_MODELS, *WHEEL_MODELS]]


def resolve_model(name_or_path: str) -> str:
    """`builtin:NAME` or a `.gguf` file -> its folder in the cache (made now if missing);
    anything else unchanged. ConfigError for an unknown built-in name or a failed fetch.
    The memory planner resolves through here too: it reads the real config.json of a built-in
    model (fetched if need be), never a preset's numbers that may belong to another model."""
    from grpo_cli.config import ConfigError

    if name_or_path.startswith(BUILTIN_PREFIX):
        from grpo_cli.models.pretrained import WHEEL_MODELS, wheel_model_folder
        from grpo_cli.models.tiny import TINY_MODELS, tiny_model_folder

        name = name_or_path[len(BUILTIN_PREFIX) :]
        if name in TINY_MODELS:
            return tiny_model_folder(name, cache_root())
        if name in WHEEL_MODELS:
            return wheel_model_folder(name, cache_root())
        raise ConfigError(
            f"model.name_or_path={name_or_path}: no built-in model of that name; the built-in "
            f"models are {', '.join(builtin_names())}."
        )
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        from grpo_cli.models.pretrained import gguf_folder

        return gguf_folder(path, cache_root())
    return name_or_path
