"""Chat templates rendered in Jinja's sandbox with limits on time, loop steps and sizes.

A chat template is code shipped in the model folder. transformers renders it in Jinja's sandbox,
which blocks escapes into Python but not work: two nested `range(99999)` loops never end, and
`'x' * 10**10` asks for 10 GB. Here the same templates render in the same sandbox, configured as
transformers 5 configures it (trim_blocks, lstrip_blocks, loop controls, the `generation` tag,
its tojson, raise_exception, strftime_now and namespace), with every step of the render counted:

- a deadline (`SECONDS`), checked at every loop iteration, call, attribute or item lookup,
  operator, filter and piece of output. The check is cooperative: no thread is killed, no signal
  is used, so any thread may render, on any OS. What runs between two checks is one Python-level
  operation, and the size limits keep each of those small;
- sizes: no string, list or output may exceed `max_chars`, the longest text that can still fit
  the model's context (context x the longest token in characters), and no repetition, power,
  format width or integer argument may ask for more before it runs;
- loop iterations: at most `max_chars` in all.

A subprocess could enforce a hard limit, but would cost a Python start (a second) per chat turn;
SIGALRM works only on the main thread. Every limit raises a one-line `HybridError`.
"""

import functools
import re
import time
import weakref
from contextvars import ContextVar
from datetime import datetime
from itertools import chain

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

from mlx_hybrid.errors import HybridError
from mlx_hybrid.limits import POSITION_BOUND

SECONDS = 5.0  # a chat template renders in milliseconds; one still running after this is hostile or broken
_budget: ContextVar = ContextVar("template_budget")  # [deadline, iterations left, max_chars] of the render running here
_longest: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> longest token, in characters


def _limit(what: str) -> HybridError:
    return HybridError(f"the chat template was stopped: {what}")


def _tick():
    if time.monotonic() > _budget.get()[0]:
        raise _limit(f"it ran longer than {SECONDS:g} s")


def _check_size(value):
    """value, unless it is a string or container longer than the render may produce."""
    max_chars = _budget.get()[2]
    if isinstance(value, (str, list, tuple, dict)) and len(value) > max_chars:
        raise _limit(f"it built a value of {len(value)} items, more than the {max_chars} characters the model's context can hold")
    return value


def _check_count(value):
    """An integer operand or argument (a repetition, a width, a range) that asks for more than the render may produce."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _budget.get()[2]:
        raise _limit(f"it asked for a count of {value}, more than the {_budget.get()[2]} characters the model's context can hold")
    return value


class _Generation(Extension):
    """transformers' `{% generation %}` tag (marks the assistant's text for training masks): the
    body renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed names (a way towards Python internals)."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot hold underscore-prefixed names, got {name!r}")


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the render's budget checked at every step (module docstring)."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"])
        self.filters["tojson"] = _tojson
        self.filters = {name: _guarded_filter(f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                            range=self.guarded_range)

    def guarded_range(self, *args):
        for a in args:
            _check_count(a)
        return self.guard_iter(safe_range(*args))

    def guard_iter(self, iterable):
        """A loop's iterable, each step counted against the budget."""
        budget = _budget.get()
        for item in iterable:
            budget[1] -= 1
            if budget[1] < 0:
                raise _limit(f"its loops ran more than {budget[2]} iterations")
            _tick()
            yield item

    def guard_value(self, value):
        _tick()
        return _check_size(value)

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*" and isinstance(left, (str, list, tuple)) != isinstance(right, (str, list, tuple)):
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(n, int) and len(seq) * n > _budget.get()[2]:
                raise _limit(f"it repeated a value {n} times, more than the {_budget.get()[2]} characters the model's context can hold")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left), 2).bit_length() * right > 64 * _budget.get()[2]:
                raise _limit(f"it raised {left} to the power {right}")
        if operator == "%" and isinstance(left, str):
            for width, precision in _FORMAT_WIDTH.findall(left):
                _check_count(int(width or 0))
                _check_count(int(precision or 0))
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        _tick()
        for a in chain(args, kwargs.values()):
            _check_count(a)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)


def _guarded_filter(f):
    @functools.wraps(f)  # keeps Jinja's pass_context/pass_environment marks
    def filtered(*args, **kwargs):
        _tick()
        for a in chain(args, kwargs.values()):
            _check_count(a)
        return _check_size(f(*args, **kwargs))

    return filtered


class _GuardLoops(jinja2.visitor.NodeTransformer):
    """Every for-loop iterates through `guard_iter`, every `~` concatenation through `guard_value`:
    loops over anything but range, and string building, would otherwise run unchecked."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("guard_iter"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("guard_value"), [node], [], None, None)


@functools.lru_cache(maxsize=1)
def _environment() -> LimitedSandbox:
    return LimitedSandbox()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _environment()
    return env.from_string(_GuardLoops().visit(env.parse(source)))


def longest_token(tokenizer) -> int:
    """The most characters one token decodes to (its string in the vocabulary is at least that long)."""
    if tokenizer not in _longest:
        _longest[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return _longest[tokenizer]


def render(tokenizer, messages: list[dict], context: int | None = None, add_generation_prompt: bool = True) -> str:
    """The tokenizer's chat template applied to messages, ending where the assistant speaks (unless
    add_generation_prompt is False), with the variables transformers passes (the special tokens,
    add_generation_prompt) and mlx-lm's thinking switch. context: the model's, in tokens; it
    bounds the rendering's size."""
    try:
        template = _compile(tokenizer.get_chat_template())
    except jinja2.TemplateSyntaxError as e:
        raise HybridError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    except (ValueError, TypeError) as e:
        raise HybridError(f"no usable chat template ({str(e).splitlines()[0]})") from None
    max_chars = longest_token(tokenizer) * (context or POSITION_BOUND)
    variables = {
        **tokenizer.special_tokens_map,
        "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
        "add_generation_prompt": add_generation_prompt,
        getattr(tokenizer, "_thinking_kwarg", "enable_thinking"): getattr(tokenizer, "has_thinking", False),
    }
    token = _budget.set([time.monotonic() + SECONDS, max_chars, max_chars])
    try:
        parts, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > max_chars:
                raise _limit(f"its output passed {max_chars} characters, more than the model's context can hold")
            _tick()
            parts.append(piece)
        return "".join(parts)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError, MemoryError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HybridError(f"the chat template failed: {reason}") from None
    finally:
        _budget.reset(token)
