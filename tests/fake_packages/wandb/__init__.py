"""A recording stand-in for the part of the wandb API that grpo_cli.log_backends uses."""

calls = []


class Table:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


class Run:
    def log(self, data, step=None):
        calls.append(("log", data, step))

    def finish(self):
        calls.append(("finish",))


def init(project=None, name=None, dir=None, config=None, id=None, resume=None):
    calls.append(("init", {"project": project, "name": name, "dir": dir, "config": config, "id": id, "resume": resume}))
    return Run()
