"""Streaming a checkpoint into a model built on the meta device, one tensor at a time.

A model is built on the meta device (no memory, no init), `materialize`
gives its parameters uninitialized CPU storage, and `stream_weights` hands
each checkpoint tensor to its parameter's `weight_loader` (kvserve.model.layers)
as the source yields it: only one checkpoint tensor is alive beside the model
at any time, and nothing is fused by concatenation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.model.layers import Linear, WeightShapeError

# (fused parameter's module name, checkpoint module name, shard id), vLLM's
# `stacked_params_mapping`: e.g. ("qkv_proj", "q_proj", "q").
StackedParams = Sequence[tuple[str, str, Any]]
# checkpoint name -> (parameter, shard id or None)
Targets = dict[str, tuple[nn.Parameter, Any]]


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> None:
    """Give every meta parameter real, uninitialized storage (torch.empty: pages are touched only when loaded).

    The parameter's attributes (its `weight_loader`) carry over; a parameter
    shared by two modules stays shared. Buffers must be real already (they
    are computed from the config, not loaded).
    """
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
                real.__dict__.update(param.__dict__)
                replaced[id(param)] = real
            module._parameters[name] = replaced[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                raise RuntimeError(f"buffer {module_name}.{name} is on the meta device: build it on the CPU")


def hf_name(param_name: str) -> str:
    """A Hugging Face causal LM's checkpoint name for one of our parameter names."""
    return param_name if param_name.startswith("lm_head.") else "model." + param_name


def checkpoint_targets(model: nn.Module, stacked: StackedParams = (),
                       checkpoint_name: Callable[[str], str] = hf_name) -> Targets:
    """Every checkpoint name the model expects, in parameter order, with the parameter and shard it fills.

    Only parameters with a `weight_loader` are checkpoint tensors; a fused
    parameter expects one checkpoint tensor per shard.
    """
    targets: Targets = {}
    for param_name, param in model.named_parameters():
        if not hasattr(param, "weight_loader"):
            continue
        name = checkpoint_name(param_name)
        shards = [(name.replace(f".{fused}.", f".{part}."), shard) for fused, part, shard in stacked
                  if f".{fused}." in name]
        for target_name, shard in shards or [(name, None)]:
            targets[target_name] = (param, shard)
    return targets


def stream_weights(weights: Iterable[tuple[str, torch.Tensor]], targets: Targets,
                   ignore: Callable[[str], bool] = lambda name: False,
                   extra: Mapping[str, Callable[[torch.Tensor], None]] | None = None) -> None:
    """Load each (checkpoint name, tensor) into its target, exactly once each.

    `ignore` names tensors a checkpoint may carry that are not needed (a tied
    checkpoint's copy of lm_head, saved rotary buffers); `extra` routes
    tensors that are not parameters (GGUF `rope_freqs`) to a handler.
    Raises ModelLoadError naming a missing, repeated, misshapen or unexpected weight.
    """
    extra = extra or {}
    pending = dict(targets)
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            if name in extra:
                extra[name](tensor)
                continue
            target = pending.pop(name, None)
            if target is None:
                if name in targets:
                    raise ModelLoadError(f"checkpoint has weight {name!r} more than once")
                if not ignore(name):
                    unexpected.append(name)
                continue
            param, shard = target
            try:
                param.weight_loader(param, tensor, shard)
            except WeightShapeError as exc:
                raise ModelLoadError(f"weight {name!r} has shape {exc.actual}, expected {exc.expected}") from None
    if pending:
        first = next(iter(pending))
        more = f" (and {len(pending) - 1} more)" if len(pending) > 1 else ""
        raise ModelLoadError(f"weight {first!r} is missing from the checkpoint{more}")
    if unexpected:
        names = ", ".join(sorted(unexpected)[:5])
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected weights, e.g. {names}")


def parameter_count(model: nn.Module, tied_head: nn.Module | None = None) -> int:
    """The model's parameter count, whatever format its linear layers hold.

    A linear layer counts its logical weight (rows x columns, + bias), not the
    tensors its format keeps; `tied_head`, a head sharing the embedding's
    weight (or a converted copy of it), counts nothing of its own.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not tied_head]
    not_counted = {id(p) for m in linears for p in m.parameters(recurse=False)}
    if tied_head is not None:  # its converted copy, not the embedding it shares in fp32
        elsewhere = {id(p) for m in model.modules() if m is not tied_head for p in m.parameters(recurse=False)}
        not_counted |= {id(p) for p in tied_head.parameters(recurse=False)} - elsewhere
    count = sum(p.numel() for p in model.parameters() if id(p) not in not_counted)
    return count + sum(m.input_size * m.output_size + (m.output_size if m.has_bias else 0) for m in linears)


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the model's parameters hold, by dtype name (e.g. {"float32": 538_000_000}), largest first."""
    held: dict[str, int] = {}
    for param in model.parameters():
        dtype = str(param.dtype).removeprefix("torch.")
        held[dtype] = held.get(dtype, 0) + param.numel() * param.element_size()
    return dict(sorted(held.items(), key=lambda item: -item[1]))
