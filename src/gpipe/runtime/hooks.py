"""A partition's forward hooks, run by its stage around the partition's layers once per
micro-batch, as ``nn.Module.__call__`` would: :class:`_PartitionCall` and :func:`_hooked`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    _global_forward_hooks,
    _global_forward_hooks_always_called,
    _global_forward_hooks_with_kwargs,
    _global_forward_pre_hooks,
)

__all__ = ["_PartitionCall", "_hooked"]


class _PartitionCall:
    """The forward hooks of one call of a partition, run around the stage's layers as
    ``nn.Module.__call__`` runs them (torch's global module hooks first): :meth:`enter` runs the
    pre-hooks on the partition's input, :meth:`exit` the hooks on its output, :meth:`failed` those
    registered with ``always_call=True`` that did not run when a layer raised."""

    def __init__(self, module: nn.Module, index: int) -> None:
        if module._backward_hooks or module._backward_pre_hooks:
            raise RuntimeError(
                f"partition {index} has a backward hook, which gpipe does not run: the stage calls the "
                "partition's layers one by one, not the partition. Register it on a layer of the "
                "partition (or on a tensor, with Tensor.register_hook) instead"
            )
        self.module = module
        self.index = index
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.called: set[int] = set()  # the always_call hooks that ran
        self.output: Any = None  # the output the hooks have made so far

    def enter(self, value: Any) -> Any:
        """The partition's input after its forward pre-hooks."""
        module = self.module
        args: tuple[Any, ...] = (value,)
        kwargs: dict[str, Any] = {}
        self.args = args
        for hook_id, hook in (*_global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()):
            if hook_id in module._forward_pre_hooks_with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {result}."
                        )
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
            self.args, self.kwargs = args, kwargs
        if len(args) != 1 or kwargs:
            given = f"{len(args)} positional arguments" + (f" and keyword arguments {sorted(kwargs)}" if kwargs else "")
            raise TypeError(
                f"the forward pre-hooks of partition {self.index} give it {given}, but an nn.Sequential takes "
                "one input (to pass several values, return ((a, b),) from the hook)"
            )
        return args[0]

    def exit(self, output: Any) -> Any:
        """The partition's output after its forward hooks."""
        module = self.module
        self.output = output
        for hook_id, hook in (*_global_forward_hooks.items(), *module._forward_hooks.items()):
            if hook_id in module._forward_hooks_always_called or hook_id in _global_forward_hooks_always_called:
                self.called.add(hook_id)
            if hook_id in module._forward_hooks_with_kwargs or hook_id in _global_forward_hooks_with_kwargs:
                result = hook(module, self.args, self.kwargs, output)
            else:
                result = hook(module, self.args, output)
            if result is not None:
                self.output = output = result
        return output

    def failed(self) -> None:
        """The partition's forward raised: run its ``always_call`` forward hooks that did not run,
        with the output so far (None if its layers raised; an exception from one of these hooks is
        a warning: the original one propagates)."""
        module = self.module
        for hooks, always, kwarg_ids in (
            (_global_forward_hooks, _global_forward_hooks_always_called, _global_forward_hooks_with_kwargs),
            (module._forward_hooks, module._forward_hooks_always_called, module._forward_hooks_with_kwargs),
        ):
            for hook_id, hook in list(hooks.items()):
                if hook_id not in always or hook_id in self.called:
                    continue
                self.called.add(hook_id)
                try:
                    if hook_id in kwarg_ids:
                        hook(module, self.args, self.kwargs, self.output)
                    else:
                        hook(module, self.args, self.output)
                except Exception as exc:
                    warnings.warn(
                        "module forward hook with ``always_call=True`` raised an exception that was silenced "
                        f"as another error was raised in forward: {exc}",
                        stacklevel=2,
                    )


def _hooked(layers: list[Callable[[Any], Any]], n: int, call: _PartitionCall) -> list[Callable[[Any], Any]]:
    """``layers`` (the partition's ``n`` layers, then maybe the loss) with the partition's forward
    hooks around its layers: the pre-hooks run in the first one's call, the hooks in the last one's."""
    if n:
        first = layers[0]
        layers[0] = lambda value: first(call.enter(value))
        last = layers[n - 1]  # (the wrapped first one, if it is the last too)
        layers[n - 1] = lambda value: call.exit(last(value))
    return layers
