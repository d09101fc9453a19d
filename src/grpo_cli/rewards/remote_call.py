"""The wire between the model's code and the tests that judge it: two processes, plain values.

`code_execution` runs every test in two sandboxes joined by two pipes (docs/SANDBOX.md, "Two
processes"):
- the *solution* process runs the model's code, then `serve_solution` answers calls on a pipe;
- the *tests* process runs `run_tests`: the row's test snippet, in which every public name the
  model's code defined stands as a value or a `Remote` that calls across the pipe. Its own exit
  code and an end marker that only it knows give the verdict.

Only plain values cross: None, bool, int, float, complex, str, bytes, and lists, tuples, dicts,
sets and frozensets of them, as JSON with a tag for each type JSON lacks. The tests' side builds
them with the builtin constructors alone, so no object of the model's code ever exists in the
tests' process: an `__eq__` that is always true, a patched `isinstance`, a read of the caller's
frame or of the tests' source have nothing to act on. Anything else the model's code hands over
(a function, a class, an instance, a generator) stays in the solution process and crosses as a
handle: the tests can call it and read its attributes, and compare it only by identity.

Everything that comes from the solution's side is hostile, its first message too: the model's
code shares a process with `serve_solution` and can write to the pipe itself.

This file imports only the standard library: its text is copied into both sandboxed programs
(whose interpreter runs with -I and cannot import grpo_cli), and the unit tests import it.
"""

import builtins
import json
import keyword
import math
import os
import sys
import traceback
import types

MAX_MESSAGE_BYTES = 16 << 20  # one call's arguments or one reply, as JSON
MAX_DEPTH = 100  # nesting of containers in one value
# Types that cross as themselves, with their JSON tag where JSON has no type of its own.
TAGGED = {tuple: "tuple", set: "set", frozenset: "frozenset", dict: "dict", bytes: "bytes", complex: "complex"}


class WireError(Exception):
    """A value that cannot cross, a malformed message, or a solution process that is gone."""


class RemoteError(Exception):
    """An exception the solution raised whose type is not rebuilt here: its own types, and
    StopIteration outside `next()` (else it would end a `map()` in the tests early, silently)."""

    def __init__(self, name, message):
        super().__init__(f"{name}: {message}")
        self.name = name


def encode(value, other, depth=0):
    """`value` as JSON-ready data. Exact builtin types only (subclasses are not plain: their
    methods are someone's code); anything else goes to `other(value, depth)`.

    >>> encode((1, [2.5, None], {"a": b"\\x00"}), other=None)
    {'tuple': [1, [2.5, None], {'dict': [['a', {'bytes': '00'}]]}]}
    """
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode(item, other, depth + 1) for item in value]
    if kind in (tuple, set, frozenset):
        return {TAGGED[kind]: [encode(item, other, depth + 1) for item in value]}
    if kind is dict:
        return {
            "dict": [[encode(key, other, depth + 1), encode(item, other, depth + 1)] for key, item in value.items()]
        }
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [encode(value.real, other, depth), encode(value.imag, other, depth)]}
    return other(value, depth)


def decode(data, handle, depth=0):
    """The value that `encode` wrote, built from builtin types only; a handle's body goes to
    `handle(body)`. Raises WireError on anything `encode` does not write."""
    if depth > MAX_DEPTH:
        raise WireError(f"a value nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(item, handle, depth + 1) for item in data]
    if kind is not dict or len(data) != 1:
        raise WireError(f"not a value this wire writes: {str(data)[:80]}")
    [(tag, body)] = data.items()
    try:
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            items = [decode(item, handle, depth + 1) for item in body]
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(body) is list:
            return {
                decode(key, handle, depth + 1): decode(item, handle, depth + 1)
                for key, item in (_pair(entry) for entry in body)
            }
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "complex" and type(body) is list and len(body) == 2:
            real, imag = (decode(part, handle, depth + 1) for part in body)
            if type(real) is float and type(imag) is float:
                return complex(real, imag)
        if tag == "handle":
            return handle(body)
    except (TypeError, ValueError) as error:  # an unhashable key or set item, bad hex
        raise WireError(f"a malformed {tag}: {error}") from None
    raise WireError(f"not a value this wire writes: {str(data)[:80]}")


def _pair(entry):
    if type(entry) is not list or len(entry) != 2:
        raise WireError("a dict entry that is not a [key, value] pair")
    return entry


class Channel:
    """One end of the two pipes: newline-delimited JSON messages, each at most
    MAX_MESSAGE_BYTES."""

    def __init__(self, read_fd, write_fd):
        self.reader = os.fdopen(read_fd, "rb")
        self.writer = os.fdopen(write_fd, "wb")

    def send(self, message):
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if len(line) > MAX_MESSAGE_BYTES:
            raise WireError(f"a message of {len(line)} bytes (at most {MAX_MESSAGE_BYTES})")
        self.writer.write(line)
        self.writer.flush()

    def receive(self):
        """The next message, or None at the end of the pipe."""
        line = self.reader.readline(MAX_MESSAGE_BYTES + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            raise WireError(f"a message longer than {MAX_MESSAGE_BYTES} bytes, or cut off")
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as error:
            raise WireError(f"a message that is not JSON: {error}") from None
        if type(message) is not dict:
            raise WireError("a message that is not a JSON object")
        return message


# --- the solution's side: runs the model's code, answers calls ---------------------------------


def serve_solution(code, read_fd, write_fd):
    """Run `code` as __main__, send the names it defined, then answer calls until the tests'
    side closes its pipe. Errors become replies: this side trusts nothing and owes nothing."""
    channel = Channel(read_fd, write_fd)
    objects = []  # a handle is an index in here

    def as_handle(value, depth):
        plain = _as_plain(value)
        if plain is not None:  # depth + 1: a subclass whose int() is again a subclass ends
            return encode(plain[0], as_handle, depth + 1)
        objects.append(value)
        return {"handle": [len(objects) - 1, _describe(value)]}

    def by_handle(body):
        if type(body) is not list or not body or type(body[0]) is not int or not 0 <= body[0] < len(objects):
            raise WireError(f"no such handle: {str(body)[:40]}")
        return objects[body[0]]

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
        names = {}
        for name, value in list(namespace.items()):
            if not name.startswith("_") and not isinstance(value, types.ModuleType):
                names[name] = encode(value, as_handle)
        channel.send({"names": names})
    except BaseException as error:  # noqa: BLE001 - SystemExit too: the code did not load
        channel.send({"load_error": _error_text(error)})
        _leave()
    while True:
        message = channel.receive()
        if message is None:
            _leave()
        try:
            target = decode(message.get("target"), by_handle)
            if message.get("op") == "getattr":
                result = getattr(target, str(message.get("name")))
            else:
                args = decode(message.get("args", []), by_handle)
                kwargs = decode(message.get("kwargs", {"dict": []}), by_handle)
                result = target(*args, **{str(key): item for key, item in kwargs.items()})
            reply = {"value": encode(result, as_handle)}
        except BaseException as error:  # noqa: BLE001 - the model's code raised: tell the tests
            reply = {"error": [type(error).__name__, str(error)[:2000]]}
        channel.send(reply)


def _as_plain(value):
    """(the plain value, ) that a subclass of a plain type or a numpy value stands for, or None.
    Safe to ask here: whatever comes out is checked again on the tests' side."""
    for base in (bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset):
        if isinstance(value, base) and type(value) is not base:
            return (base(value),)  # IntEnum -> int, namedtuple -> tuple, Counter -> dict
    tolist = getattr(type(value), "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        plain = tolist(value)
        if type(plain) in (bool, int, float, complex, str, bytes, list):
            return (plain,)
    return None


def _describe(value):
    return f"{type(value).__name__} {getattr(value, '__name__', '')}".strip()[:80]


def _error_text(error):
    return "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]


def _leave():
    """End the solution's process now: threads its code started must not keep it alive."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the tests' side: runs the test snippet, calls across ---------------------------------------


class Remote:
    """Something of the solution's (a function, a class, an instance) on the tests' side. Calls
    and attribute reads cross the pipe; `==` is identity, since the solution's own `__eq__`
    never decides a test; iteration, len() and [] cross as calls of its methods."""

    __slots__ = ("_client", "_handle", "_description")

    def __init__(self, client, handle, description):
        self._client, self._handle, self._description = client, handle, description

    def __call__(self, *args, **kwargs):
        return self._client.request({"op": "call", "target": self._wire(), "args": list(args), "kwargs": kwargs})

    def __getattr__(self, name):
        if name in Remote.__slots__ or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)  # copy, pickle and friends probe these: not the solution's
        return self._remote_getattr(name)

    def _remote_getattr(self, name):
        return self._client.request({"op": "getattr", "target": self._wire(), "name": name})

    def _method(self, name):
        """The solution's method `name` of this object; TypeError when it has none, as Python
        says when a protocol is missing (list() asks for len() first and takes that as "no")."""
        try:
            return self._remote_getattr(name)
        except AttributeError:
            raise TypeError(f"{self!r} has no {name}") from None

    def __len__(self):
        return self._method("__len__")()

    def __getitem__(self, key):
        return self._method("__getitem__")(key)

    def __contains__(self, item):
        return self._method("__contains__")(item)

    def __iter__(self):
        return self._method("__iter__")()

    def __next__(self):
        try:
            return self._method("__next__")()
        except RemoteError as error:
            if error.name == "StopIteration":
                raise StopIteration from None
            raise

    def __bool__(self):
        return True  # as any object without __bool__ or __len__; not a call of __len__

    def __repr__(self):
        return f"<the solution's {self._description}>"

    def _wire(self):
        return {"handle": [self._handle, self._description]}


class Client:
    """The tests' end: sends calls, decodes replies into plain values and Remotes."""

    def __init__(self, read_fd, write_fd):
        self.channel = Channel(read_fd, write_fd)

    def remote(self, body):
        if type(body) is not list or len(body) != 2 or type(body[0]) is not int:
            raise WireError(f"a malformed handle: {str(body)[:40]}")
        return Remote(self, body[0], str(body[1]))

    def outgoing(self, value, depth):
        if type(value) is Remote:
            return value._wire()
        raise WireError(
            f"cannot send a {type(value).__name__} to the solution: only plain "
            f"values and the solution's own objects cross"
        )

    def receive(self):
        message = self.channel.receive()
        if message is None:
            raise WireError("the solution's process ended (it exited, crashed or was killed)")
        return message

    def request(self, message):
        for key in ("args", "kwargs"):
            if key in message:
                message[key] = encode(message[key], self.outgoing)
        self.channel.send(message)
        reply = self.receive()
        if "error" in reply:
            raise _rebuilt(reply["error"])
        if "value" not in reply:
            raise WireError("a reply with neither a value nor an error")
        return decode(reply["value"], self.remote)


def _rebuilt(error):
    """The solution's exception on this side: a builtin exception type stays itself (so tests
    may expect a ValueError), any other becomes a RemoteError naming it."""
    if type(error) is not list or len(error) != 2:
        return WireError("a malformed error reply")
    name, message = str(error[0]), str(error[1])
    kind = getattr(builtins, name, None)
    if (
        isinstance(kind, type)
        and issubclass(kind, Exception)
        and kind.__module__ == "builtins"
        and not issubclass(kind, (StopIteration, StopAsyncIteration))
    ):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError wants five arguments
            pass
    return RemoteError(name, message)


def run_tests(tests, read_fd, write_fd, marker):
    """Wait for the solution's names, run `tests` among them, then print `marker`: the caller
    counts the tests passed when this process exits 0 with the marker last in its output."""
    client = Client(read_fd, write_fd)
    hello = client.receive()
    if "load_error" in hello:
        sys.exit(f"the solution did not load: {str(hello['load_error'])[:2000]}")
    names = hello.get("names")
    if type(names) is not dict:
        raise WireError("a first message without the solution's names")
    namespace = {}
    for name, data in names.items():
        # The first message is the model's code's to forge (it can write to the pipe itself), so
        # only names it could define in public get in: no private or dunder name (`__builtins__`
        # would hand it every builtin the tests use), no keyword, and no builtin's name
        # (isinstance, len, sorted, ...): the tests' own tools stay the tests'.
        if (
            type(name) is str
            and name.isidentifier()
            and not name.startswith("_")
            and not keyword.iskeyword(name)
            and not hasattr(builtins, name)
        ):
            namespace[name] = decode(data, client.remote)
    namespace.update(__name__="__main__", __builtins__=builtins)  # last, whatever came before
    exec(compile(tests, "tests.py", "exec"), namespace)
    print(marker, flush=True)
