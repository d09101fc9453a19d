"""The Hydra entry points: `grpo-train` (pipeline.run) and `grpo-filter` (prompt_filter), both
composing the same config tree (conf/config.yaml: presets, groups, overrides).

Bad input ends the same way whoever finds it: one message naming the key or file and what to
do, exit code 2, no traceback. The finders are Hydra while composing (unknown key, wrong type,
unknown preset, override syntax, a run folder it cannot create), OmegaConf resolving an
interpolation, and our own `validate` and loading code (ConfigError). With HYDRA_FULL_ERROR=1
the error is re-raised instead, so Python prints the whole traceback (and exits 1).
The whole catalogue, with each message: docs/ERRORS.md.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
import hydra._internal.utils as hydra_internal
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError
from rich.console import Console

from grpo_cli.config import ConfigError, register_configs, schema_keys, schema_type

CONFIG_ERROR_EXIT_CODE = 2


def config_dir() -> str:
    """The `conf/` folder at the top of the project (this package is installed editable)."""
    return str(Path(__file__).resolve().parents[2] / "conf")


register_configs()
_task_started = False  # set once Hydra hands over a composed config; OSErrors before are Hydra's set-up
_program = "grpo-train"  # the console script being run: the prefix of its error messages


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def train(cfg: DictConfig) -> None:
    with _command(cfg):
        from grpo_cli.validation import validate

        validate(cfg, check_files=False)  # a broken rule is said before torch and transformers load
        from grpo_cli.pipeline import run

        run(cfg)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def filter_prompts(cfg: DictConfig) -> None:
    with _command(cfg):
        from grpo_cli.tools.prompt_filter import filter_file

        filter_file(cfg)


@contextlib.contextmanager
def _command(cfg: DictConfig) -> Iterator[None]:
    """What every command does with its composed config first; our input errors end in `fail`."""
    global _task_started
    _task_started = True
    # Per-shard bars would drown the command's own output. The variable (not transformers'
    # disable_progress_bar) keeps transformers out of the process until a command needs it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        with open_dict(cfg):  # before resolving: `${trainer.output_dir}` elsewhere means the run folder
            if not cfg.trainer.output_dir:
                cfg.trainer.output_dir = HydraConfig.get().runtime.output_dir
        resolve_interpolations(cfg)
        yield
    except ConfigError as error:
        if HydraConfig.get().mode == RunMode.MULTIRUN and os.environ.get("HYDRA_FULL_ERROR") != "1":
            # say it now, and let the sweep's other jobs run
            _print_error(str(error))
            raise SweepJobFailed(str(error)) from None
        fail(str(error), error)


class SweepJobFailed(Exception):
    """A job of a `-m` sweep stopped on bad input (already printed). An Exception, not SystemExit:
    Hydra records the job as failed and runs the next; after the sweep it raises the first one,
    and the command exits 2."""


def main() -> None:
    """`grpo-train`: fine-tune with GRPO."""
    _serve("grpo-train", train)
    if "WORLD_SIZE" in os.environ:  # a torchrun worker: its exit needs care (end_worker_process)
        from grpo_cli.distributed import end_worker_process

        end_worker_process()


def filter_main() -> None:
    """`grpo-filter`: keep the prompts whose sampled rewards differ (prompt_filter)."""
    _serve("grpo-filter", filter_prompts)


def _serve(program: str, hydra_main: Callable[[], None]) -> None:
    """Run a `@hydra.main` function with Hydra's own input errors reported like ours.

    Hydra prints its composition errors itself and exits 1, inside `run_and_report`, the one
    function every Hydra command (run, multirun, --cfg, shell completion) goes through; wrapping
    it is the only place that sees them. Should a Hydra release move it, those errors fall back
    to Hydra's wording and exit code 1, and tests/test_errors.py fails.
    """
    global _program
    _program = program
    original = getattr(hydra_internal, "run_and_report", None)
    if original is None:
        hydra_main()
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        return original(lambda: _reporting_input_errors(func))

    hydra_internal.run_and_report = run_and_report
    try:
        hydra_main()
    except ValueError as error:  # Hydra checks its own flags before run_and_report
        if not str(error).startswith("Only one of"):
            raise
        fail(
            f"{error}: e.g. `{program} --cfg hydra hydra/launcher=slurm_gpu` prints the composed "
            "config, `-m` alone runs the sweep.",
            error,
        )
    finally:
        hydra_internal.run_and_report = original


def _reporting_input_errors(func: Callable[[], Any]) -> Any:
    try:
        return func()
    except SweepJobFailed as error:  # every job has run; each failure was printed as it came
        fail(f"a job of the sweep stopped (the others ran; each failure is printed above). The first: {error}", error)
    except CompactHydraException as error:  # Hydra's class for errors meant for the user
        fail(hydra_error_message(error), error)
    except OSError as error:
        if _task_started or not error.filename:
            raise  # a bug or a failure during the run: Hydra prints its (trimmed) traceback
        fail(
            f"Cannot create the run folder {error.filename}: {error.strerror}. Point hydra.run.dir "
            "(hydra.sweep.dir with -m) at a folder you can write to.",
            error,
        )


def fail(message: str, error: BaseException) -> NoReturn:
    """Bad input is the user's to fix: say what and where, no traceback (unless asked for)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    _print_error(message)
    sys.exit(CONFIG_ERROR_EXIT_CODE)


def _print_error(message: str) -> None:
    console = Console(stderr=True, highlight=False, soft_wrap=True)  # paths stay whole when copied
    console.print(f"[bold red]{_program}: error[/]", end=" ")
    console.print(message, markup=False)  # messages quote values such as [q_proj, v_proj]


def resolve_interpolations(cfg: DictConfig) -> None:
    """Resolve every `${...}` now, so a broken one is reported by key before anything loads."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as error:
        key = _unresolvable_key(cfg, OmegaConf.to_container(cfg, resolve=False)) or "a value"
        raise ConfigError(
            f"{key}: its interpolation cannot be resolved ({_first_line(error)}). Fix the "
            "${...} reference (it names another key, e.g. ${trainer.seed}) or give a plain value."
        ) from None


def _unresolvable_key(node: Any, raw: Any, prefix: str = "") -> str | None:
    """The dotted key of the first value whose `${...}` fails to resolve (OmegaConf's error
    does not always say)."""
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        path = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}.{key}".lstrip(".")
        try:
            child = node[key]
        except OmegaConfBaseException:
            return path
        found = _unresolvable_key(child, value, path)
        if found:
            return found
    return None


def hydra_error_message(error: CompactHydraException) -> str:
    """One paragraph for Hydra's composition errors: the key or preset, and what to do."""
    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        options = [o for o in error.options or [] if not o.startswith("base_")]
        if group and options:
            return (
                f"{group}={name}: there is no preset '{name}' in group '{group}' (no "
                f"conf/{group}/{name}.yaml). The {group} presets are: {', '.join(options)}."
            )
        return f"{_first_line(error)}. `{_program} --help` lists the groups and their presets."
    if isinstance(cause, ConfigKeyError) or (isinstance(cause, AttributeError) and key):
        # OmegaConf names the first unknown part (`trainers`); Hydra's message the whole key.
        overridden = re.search(r"Could not override '([^']+)'", str(error))
        key = overridden.group(1) if overridden else key
        close = difflib.get_close_matches(key or "", schema_keys(), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}?" if close else ""
        where = "--hydra-help" if str(key).startswith("hydra.") else "--help"
        return (
            f"{key} is not a config key.{hint} `{_program} {where}` lists every key; "
            "check the spelling and the group (e.g. trainer.beta, sampler.group_size)."
        )
    if isinstance(cause, ValidationError) and key:
        wanted = schema_type(key)
        takes = f" {key} takes {wanted}." if wanted else ""
        return f"{key}: {_first_line(cause)}.{takes} Fix the value on the command line or in your preset."
    if isinstance(error, OverrideParseException):
        return (
            f"Cannot parse the override {error.override!r}: {_first_line(error)}. Write key=value; "
            "quote values with spaces, brackets or braces, e.g. 'trainer.beta={start: 0.05, end: 0.02}'."
        )
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


if __name__ == "__main__":
    main()
