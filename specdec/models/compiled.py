"""Methods compiled as one graph each (torch.compile), and called past dynamo once compiled.

Before every call of a compiled function dynamo checks its guards: ~6,800 of them for the default
verifier's token pass (every parameter, cache and module attribute it reads), ~0.4 ms of a ~3 ms
1-token pass (by hand, on an AMD EPYC). Between the passes of a loaded model none of what they
check changes, except what this code changes on purpose: grad and inference mode, a model's
feature layers, and the caches it runs on (a new runner). So, as vLLM's compiled models do, once a
call has compiled (or found) its code, later calls with the same key run that code directly: the
method's bytecode as dynamo rewrote it, which calls the compiled graph. A call with a new key goes
through dynamo (its guards, a recompile if they fail) and its code is kept for that key. A model
must therefore not be changed after its first compiled call other than through what the key holds.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Hashable, Iterable

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def compile_graph(fn, device: torch.device):
    """fn compiled as one graph, cached under $SPECDEC_HOME/inductor. The caller marks its batch
    dimensions unbacked, so one graph serves every batch."""
    from specdec.models.default import use_compile_cache

    use_compile_cache()  # where nothing has fixed it yet (load_model sets it first)
    # no size asserts: ~600 shape checks a call, ~0.4 ms of a 1-token pass. On a CPU the graph's
    # wrapper is C++: in Python its ~1,000 statements a call (buffers, views, op calls) cost a
    # 1-token pass ~0.3-0.8 ms of ~5 (by hand). Built apart from the kernels, the wrapper
    # compiles at -O1: the first compile takes ~45 s rather than ~85 s, for the same speed
    cpu = device.type == "cpu"
    options = {"size_asserts": False, "cpp_wrapper": cpu, "cpp_wrapper_build_separate": cpu}
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


def tensor_key(t: Tensor) -> tuple:
    """What dynamo's guards check of an input tensor whose dimensions are all static."""
    return t.dtype, t.device, t.shape, t.stride()


class CompiledMethod:
    """A bound method compiled as one graph; called with its arguments (not self).

    key(*args): what, besides the arguments' batch dimensions, the compiled code depends on.
    unbacked(*args): the tensors whose first dimension is the batch (one graph serves any)."""

    def __init__(self, method, key: Callable[..., Hashable], unbacked: Callable[..., Iterable[Tensor]]):
        self._owner, self._func = method.__self__, method.__func__
        self._dynamo = compile_graph(method, next(self._owner.parameters()).device)
        self._key, self._unbacked = key, unbacked
        self._direct: dict[Hashable, types.FunctionType | None] = {}

    def __call__(self, *args):
        k = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), self._key(*args))
        fn = self._direct.get(k)
        if fn is not None:
            return fn(self._owner, *args)
        for t in self._unbacked(*args):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        out = self._dynamo(*args)
        if k not in self._direct:
            self._direct[k] = self._code_for(args)
        return out

    def _code_for(self, args) -> types.FunctionType | None:
        """The rewritten method whose guards these arguments pass (None: always through dynamo)."""
        code = self._func.__code__
        frame = dict(zip(code.co_varnames[: code.co_argcount], (self._owner, *args)))
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            for entry in _debug_get_cache_entry_list(code):
                if entry.guard_manager.check(frame):
                    f = self._func
                    return types.FunctionType(entry.code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        except Exception as e:  # another torch: dynamo's own path still works
            log.warning("compiled %s is called through dynamo (%s)", self._func.__qualname__, e)
        return None
