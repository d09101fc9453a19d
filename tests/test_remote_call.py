"""The wire between the model's code and its tests (rewards/remote_call.py), as pure functions:
what crosses, what the tests' side builds from it, and what it refuses."""

from __future__ import annotations

import collections
import enum
import json
import math

import pytest

from grpo_cli.rewards.remote_call import MAX_DEPTH, Remote, RemoteError, WireError, _as_plain, _rebuilt, decode, encode


def _refuse(value, depth):
    raise WireError(f"not plain: {type(value).__name__}")


def _across(value):
    """What the tests' side holds after `value` went through JSON text."""
    return decode(json.loads(json.dumps(encode(value, _refuse))), handle=None)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -7,
        2**100,
        1.5,
        "text",
        b"\x00\xff",
        1 + 2j,
        [1, [2, [3]]],
        (1, "a"),
        (),
        {1: "one", (2, 3): [4]},
        {"a": {"b": None}},
        {1, 2},
        frozenset({"x"}),
        [(1,), {2: (3,)}],
    ],
)
def test_plain_values_cross_as_themselves_with_their_types(value):
    back = _across(value)
    assert back == value
    assert type(back) is type(value)  # a tuple stays a tuple, an int key stays an int


def test_non_finite_floats_cross():
    nan, inf, minus_inf = _across([math.nan, math.inf, -math.inf])
    assert math.isnan(nan) and inf == math.inf and minus_inf == -math.inf


def test_the_encoding_tags_what_json_lacks():
    # Hand-written: a tuple, a dict with a non-string key and bytes, each as a one-key object.
    assert encode((1, {2: b"\x01"}), _refuse) == {"tuple": [1, {"dict": [[2, {"bytes": "01"}]]}]}


class AlwaysEqual:
    def __eq__(self, other):
        return True


class EqualInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("value", [AlwaysEqual(), EqualInt(3), [1, AlwaysEqual()], len])
def test_anything_but_exact_builtin_types_goes_to_the_other_path(value):
    # On the tests' side that path raises (arguments) or makes a handle (the solution's objects).
    with pytest.raises(WireError, match="not plain"):
        encode(value, _refuse)


def test_the_solution_side_coerces_subclasses_and_numpy_to_plain_values():
    np = pytest.importorskip("numpy")
    Point = collections.namedtuple("Point", "x y")

    class Colour(enum.IntEnum):
        RED = 1

    assert _as_plain(EqualInt(3)) == (3,) and type(_as_plain(EqualInt(3))[0]) is int
    assert _as_plain(Point(1, 2)) == ((1, 2),) and type(_as_plain(Point(1, 2))[0]) is tuple
    assert _as_plain(Colour.RED) == (1,)
    assert _as_plain(collections.Counter("aab")) == ({"a": 2, "b": 1},)
    assert _as_plain(np.int64(5)) == (5,) and type(_as_plain(np.int64(5))[0]) is int
    assert _as_plain(np.array([[1, 2]])) == ([[1, 2]],)
    assert _as_plain(AlwaysEqual()) is None and _as_plain(len) is None


@pytest.mark.parametrize(
    "data",
    [
        {"tuple": "ab"},  # a body of the wrong kind
        {"set": [[1]]},  # an unhashable item
        {"dict": [[1]]},  # not a pair
        {"bytes": "zz"},
        {"float": "1e400"},  # only nan, inf and -inf are tagged
        {"complex": [1, 2]},  # parts must be floats
        {"tuple": [], "set": []},  # two tags
        {"object": 1},  # an unknown tag
    ],
)
def test_malformed_data_is_refused(data):
    with pytest.raises(WireError):
        decode(data, handle=None)


def test_nesting_is_bounded_both_ways():
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(WireError, match="deeper"):
        encode(deep, _refuse)
    data: object = []
    for _ in range(MAX_DEPTH + 5):
        data = [data]
    with pytest.raises(WireError, match="deeper"):
        decode(data, handle=None)


def test_a_handle_is_a_remote_that_compares_by_identity():
    remote = decode({"handle": [0, "Anything"]}, handle=lambda body: Remote(None, *body))
    assert isinstance(remote, Remote) and remote != remote._wire() and remote == remote
    assert bool(remote) and repr(remote) == "<the solution's Anything>"


@pytest.mark.parametrize(
    ("reply", "kind", "text"),
    [
        (["ValueError", "bad n"], ValueError, "bad n"),
        (["KeyError", "'k'"], KeyError, "'k'"),
        (["MyOwnError", "boom"], RemoteError, "MyOwnError: boom"),
        # StopIteration would end a map() or a generator of the tests early, silently: not rebuilt.
        (["StopIteration", ""], RemoteError, "StopIteration: "),
        (["SystemExit", "0"], RemoteError, "SystemExit: 0"),  # not an Exception: not rebuilt
        (["print", "x"], RemoteError, "print: x"),  # a builtin, not an exception type
    ],
)
def test_the_solutions_exceptions_are_rebuilt_from_builtin_types_only(reply, kind, text):
    error = _rebuilt(reply)
    assert type(error) is kind and error.args == (text,)
