"""Restore into the live model and optimizer: a template may hold the objects themselves.

A resume that builds its template from `opt.state_dict()` fails for every
stateful optimizer: a fresh one has no state yet (AdamW's moments and SGD's
momentum buffers appear at its first step), so its state dict has nowhere to
put the checkpoint's. Here a `torch.nn.Module` in the template stands for its
state dict (its parameters and buffers, filled in place), and a
`torch.optim.Optimizer` for its state dict once its state exists, created as
`torch.distributed.checkpoint.state_dict` creates it (`_init_optim_state`):
one `step()` with zero gradients at a learning rate of 0, which leaves the
parameters as they were; the gradients and learning rates are put back after.
The state is created for every parameter of the optimizer, also those that
will have none in the checkpoint (never given a gradient, frozen from the
start, or a checkpoint saved before the first step), so that a parameter
frozen after it stepped gets its saved state too; the entries the checkpoint
lacks are then dropped (`matching.MayBeAbsent`), as `set_state_dict` drops them.
The restore then fills those state tensors in place on their devices, like any
template's, and each optimizer loads its restored state dict (the saved
hyper-parameters; its state tensors are already the restored ones, so nothing
is copied), each module its extra state (`get_extra_state`), if it has any, and
the entries of its state dict that were copies, not its own tensors (a
`state_dict` hook that casts), through its `load_state_dict`.
When the restore fails, the state created for it is removed again: the
optimizer is left as fresh as it came.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from xlakit.checkpoint.file.matching import MayBeAbsent

_EXTRA_STATE = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


_KINDS = {"model": (torch.nn.Module, "torch.nn.Module"), "optimizer": (torch.optim.Optimizer, "torch.optim.Optimizer")}


def template_of(template: Any, **named: Any) -> tuple[Any, list[tuple[tuple, Any, bool]]]:
    """The template as plain state dicts, and where each live module or optimizer was (with whether
    xlakit created the optimizer's state).

    `named` (`model=`, `optimizer=`) are entries of the template under their own
    names (None: not given). No template and nothing named gives None. Raises
    ValueError when a name is given twice, TypeError for a named object of another kind.
    """
    named = {k: v for k, v in named.items() if v is not None}
    for name, value in named.items():
        kind, kind_name = _KINDS[name]
        if not all(isinstance(v, (kind, Mapping)) for v in (value if type(value) in (list, tuple) else [value])):
            raise TypeError(f"{name}= takes a {kind_name} or its state dict (or a list of them), got "
                            f"{type(value).__name__}; pass anything else inside the template")
    if named:
        if template is None:
            template = {}
        if not isinstance(template, Mapping):
            raise TypeError(f"model= and optimizer= are entries of the template, which must then be a dict; "
                            f"found a template of type {type(template).__name__}: pass them inside it instead")
        twice = sorted(named.keys() & template.keys())
        if twice:
            raise ValueError(f"{', '.join(map(repr, twice))} given both in the template and as a keyword; "
                             f"pass each once")
        template = {**template, **named}
    live: list[tuple[tuple, Any, bool]] = []
    try:
        return _expand(template, (), live), live
    except BaseException:
        _forget(live)
        raise


def fill(live: list[tuple[tuple, Any, bool]], restore: Callable[[], Any]) -> Any:
    """`restore()`'s result, settled into the live objects; on any failure (an interrupt too) the
    optimizer state created for it is removed again."""
    try:
        return settle(restore(), live)
    except BaseException:
        _forget(live)
        raise


def _forget(live: list[tuple[tuple, Any, bool]]) -> None:
    for _, obj, created in live:
        if created:
            obj.state.clear()


def settle(restored: Any, live: list[tuple[tuple, Any, bool]]) -> Any:
    """After the restore: each optimizer loads its restored state dict, each module its extra state."""
    for path, obj, _ in live:
        state = restored
        for key in path:
            state = state[key]
        if isinstance(obj, torch.optim.Optimizer):
            obj.load_state_dict(state)
        else:  # its own parameters and buffers were filled in place; the rest goes through the module
            own = _memory_of(obj)
            rest = type(state)((k, v) for k, v in state.items()
                               if k.endswith(_EXTRA_STATE) or not _filled_in_place(v, own))
            if rest:
                if hasattr(state, "_metadata"):
                    rest._metadata = state._metadata
                obj.load_state_dict(rest, strict=False)
    return restored


def _memory_of(module: torch.nn.Module) -> set[int]:
    """Where the module's parameters and buffers keep their values (devices with addresses)."""
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
            if t.device.type != "xla" and t.numel()}


def _filled_in_place(value: Any, own: set[int]) -> bool:
    """Whether a module's state-dict entry is its own tensor (filled by the restore itself), not a copy
    its `state_dict()` made (a hook that casts): only a copy needs `load_state_dict`. On XLA, where a
    state dict's detached aliases have no address, the entry is taken as the module's own."""
    if not isinstance(value, torch.Tensor) or value.device.type == "xla" or not value.numel():
        return True
    return value.untyped_storage().data_ptr() in own


def _expand(node: Any, path: tuple, live: list[tuple[tuple, Any, bool]]) -> Any:
    if isinstance(node, torch.nn.Module):
        live.append((path, node, False))
        return node.state_dict()
    if isinstance(node, torch.optim.Optimizer):
        created = create_state(node)
        live.append((path, node, created))
        state = node.state_dict()
        if created:  # the parameters the checkpoint holds no state for keep none
            state["state"] = MayBeAbsent(state["state"])
        return state
    if isinstance(node, Mapping):
        out = {k: _expand(v, (*path, k), live) for k, v in node.items()}
        return node if all(out[k] is v for k, v in node.items()) else out
    if type(node) in (list, tuple):
        out = [_expand(v, (*path, i), live) for i, v in enumerate(node)]
        return node if all(a is b for a, b in zip(out, node)) else type(node)(out)
    return node


def create_state(opt: torch.optim.Optimizer) -> bool:
    """Give an optimizer without state its state, as its first step would, leaving the parameters alone;
    whether it created any.

    An optimizer that has state (it stepped, or was restored) is left as it is. Every
    parameter gets state, a frozen one too (it may have stepped before it was frozen).
    Its parameters' gradients and its learning rates are put back afterwards.
    """
    if opt.state:
        return False
    params = [p for group in opt.param_groups for p in group["params"]
              if p.requires_grad or p.is_floating_point() or p.is_complex()]
    if not params:
        return False
    grads = [p.grad for p in params]
    rates = [group.get("lr") for group in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group, lr in zip(opt.param_groups, rates):
            if lr is not None:
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        opt.step()
    except Exception as e:
        opt.state.clear()  # what the failed step made: the optimizer had none
        e.add_note(f"xlakit created the state of {type(opt).__name__} for the restore by one step at a learning "
                   f"rate of 0 with zero gradients, as torch.distributed.checkpoint does; an optimizer whose step "
                   f"needs more (a closure) must take a real step first, then be restored")
        raise
    finally:
        for group, lr in zip(opt.param_groups, rates):
            if lr is not None:
                group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
    return bool(opt.state)
