"""A recording stand-in for the part of the MLflow API that grpo_cli.log_backends uses."""

from types import SimpleNamespace

calls = []


def set_experiment(name):
    calls.append(("set_experiment", name))


def start_run(run_id=None, run_name=None):
    calls.append(("start_run", run_id, run_name))
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id or "fake-run-1"))


def log_dict(dictionary, artifact_file):
    calls.append(("log_dict", artifact_file))


def log_metrics(metrics, step=None):
    calls.append(("log_metrics", metrics, step))


def log_text(text, artifact_file):
    calls.append(("log_text", text, artifact_file))


def end_run():
    calls.append(("end_run",))
