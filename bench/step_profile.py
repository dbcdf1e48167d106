"""Where a decode step goes: weight matmuls, attention, other ops, Python; against the physical floor.

One request decodes after a W2 (512-token) or W4 (4,096-token) prompt, and
W1's 32 requests decode together, drafting off. The step time is measured plain, as the
engine runs it (a Llama-family model's layers in one C++ call where it can:
kvserve/model/decoder_stack.py), and with the layers called one by one from
Python; then the one-by-one steps run with every C++ kernel call timed (kvserve/kernels) and under
torch's profiler for the torch ops: weights = the quantized matmuls (or fp32 / bf16 GEMMs), attention =
the decode kernel plus writing the new K/V, other ops = every other torch op
or kernel, Python = the rest of the profiled step; the four are scaled to
the plain one-by-one step's time (the timing slows the profiled steps down). The stack runs the same
kernels, so what it saves is the Python between them. The floor is the bytes a step must read (the
linear weights it multiplies, plus the K/V it attends over) divided by this
machine's memory bandwidth, measured here by summing a 1 GiB tensor on 2 MiB pages (workloads.read_bandwidth).
Where the layers run as one stack, the plain step is also split where it runs ("in place"): the stack's
ops timed inside its C++ call (decoder_stack.time_stack_ops), the head's call, and the rest of the step;
and that rest is timed alone (the layers skipped, the head's logits reused) with the caches warm and after
a step's bytes have streamed through them: a real step's Python runs on caches its weights just flushed.

    .venv/bin/python bench/step_profile.py [--model PATH] [--weights-dtype auto] [--steps 40] [--workloads W2 W4 W1]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from types import ModuleType

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.kernels import build, ops
from kvserve.model import decoder_stack
from kvserve.model.layers import Linear
from kvserve.model.loader import load_model
from workloads import commit_pool, freeze_setup, greedy, probe_buffer, random_prompts, read_bandwidth, save

WEIGHT_OPS = {"quant_matmul", "kquant_matmul_", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul"}
# the kernels, and the new K/V's write
ATTENTION_OPS = {"paged_decode", "paged_decode_quant", "store_kv_", "aten::index_copy_", "aten::_to_copy"}
WORKLOADS = {"W2": (512, 1), "W4": (4096, 1), "W1": (256, 32)}  # prompt tokens, requests


class _TimedKernels(ModuleType):
    """The kernels module with every call timed (seconds per name)."""

    def __init__(self, inner: ModuleType) -> None:
        super().__init__(inner.__name__)
        self.inner, self.seconds = inner, defaultdict(float)

    def __getattr__(self, name: str):
        function = getattr(self.inner, name)

        def timed(*args):
            started = time.perf_counter()
            result = function(*args)
            self.seconds[name] += time.perf_counter() - started
            return result
        return timed


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes the linear layers hold: what every decode step reads once."""
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, Linear)
               for p in m.parameters(recurse=False))


def _plain_step_s(engine: Engine, steps: int) -> float:
    for _ in range(5):
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - started) / steps


def stack_in_place(engine: Engine, model: torch.nn.Module, steps: int) -> dict | None:
    """The plain step as the engine runs it, split where it runs: the decoder stack's ops timed inside the
    one C++ call (decoder_stack.STACK_OPS), the head's call (final norm and output projection), and the
    rest (embedding, metadata, scheduling, sampling: the engine's Python). None where the model's layers
    do not run as a stack."""
    stack = model.decoder_stack()
    if stack is None:
        return None
    head_s = 0.0
    compute_logits = model.compute_logits

    def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
        nonlocal head_s
        started = time.perf_counter()
        logits = compute_logits(hidden)
        head_s += time.perf_counter() - started
        return logits

    model.compute_logits = timed_logits
    decoder_stack.time_stack_ops(stack, True)
    try:
        for _ in range(5):
            engine.step()
        head_s = 0.0
        decoder_stack.stack_op_times(stack)  # the warm-up's, dropped
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - started) / steps
        parts = {name: seconds / steps for name, seconds in decoder_stack.stack_op_times(stack).items()}
    finally:
        decoder_stack.time_stack_ops(stack, False)
        del model.compute_logits
    return {"step_s": step_s, "stack_ops": parts, "head": head_s / steps,
            "rest": step_s - sum(parts.values()) - head_s / steps}


def rest_warm_and_cold(engine: Engine, model: torch.nn.Module, steps: int, step_bytes: int) -> dict | None:
    """What the rest of a step (everything but the layers and the head: embedding, metadata, scheduling,
    sampling, outputs, stats) costs with the caches warm, and after `step_bytes` (what a step reads) have
    streamed through them, as the layers' weights do in a real step. The layers are skipped (in place: the
    forward takes them as run) and the head answers with the logits it gave once, so the tokens are garbage:
    run it last, on a request about to be aborted. The flushed figure is the step with the flush less the
    flush timed alone. None for a model whose layers carry recurrent state (its forward always runs them)."""
    if model.has_recurrent_state:
        return None
    flush = probe_buffer(max(step_bytes // 4, 1))
    streaming = False
    logits_by_rows: dict[int, torch.Tensor] = {}
    compute_logits = model.compute_logits

    def skipped_layers(x: torch.Tensor, positions: torch.Tensor, kv: object) -> bool:
        if streaming:
            flush.sum()
        return True

    def same_logits(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] not in logits_by_rows:
            logits_by_rows[hidden.shape[0]] = compute_logits(hidden)
        return logits_by_rows[hidden.shape[0]].clone()

    model.run_layers_at_once, model.compute_logits = skipped_layers, same_logits
    try:
        warm = _plain_step_s(engine, steps)
        streaming = True
        cold = _plain_step_s(engine, steps)
        started = time.perf_counter()
        for _ in range(steps):
            flush.sum()
        streamed = (time.perf_counter() - started) / steps
    finally:
        del model.run_layers_at_once, model.compute_logits
    return {"warm": warm, "cold": max(cold - streamed, 0.0), "streamed_bytes": step_bytes}


def profile_steps(engine: Engine, steps: int) -> dict:
    stacked_s = _plain_step_s(engine, steps)
    timed = _TimedKernels(ops.kernels())
    decoder_stack.ENABLED = False  # the kernels called one by one, each timed
    try:
        step_s = _plain_step_s(engine, steps)
        build._state["module"] = timed
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled_s = (time.perf_counter() - started) / steps
    finally:
        build._state["module"] = timed.inner
        decoder_stack.ENABLED = True
    torch_ops = {event.key: event.self_cpu_time_total / 1e6 for event in prof.key_averages()}
    kernel = dict(timed.seconds)
    weights = sum(kernel.pop(name, 0.0) for name in list(kernel) if name in WEIGHT_OPS)
    weights += sum(torch_ops.pop(name, 0.0) for name in list(torch_ops) if name in WEIGHT_OPS)
    attention = sum(kernel.pop(name, 0.0) for name in list(kernel) if name in ATTENTION_OPS)
    attention += sum(torch_ops.pop(name, 0.0) for name in list(torch_ops) if name in ATTENTION_OPS)
    other = sum(kernel.values()) + sum(torch_ops.values())
    parts = {"weights": weights / steps, "attention": attention / steps, "other ops": other / steps}
    parts["python"] = max(profiled_s - sum(parts.values()), 0.0)
    # Timing every call slows the profiled steps down: the parts are scaled to the plain step's time.
    return {"step_s": stacked_s, "layers_one_by_one_s": step_s,
            **{name: value * step_s / profiled_s for name, value in parts.items()}}


def _in_place_line(split: dict) -> str:
    ops_ms = ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in split["stack_ops"].items())
    return (f"step {split['step_s'] * 1e3:.2f} ms = the stack {sum(split['stack_ops'].values()) * 1e3:.2f} ({ops_ms}) "
            f"+ head {split['head'] * 1e3:.2f} + the rest (embedding, metadata, scheduling, sampling) "
            f"{split['rest'] * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or checkpoint directory (default: the embedded model)")
    parser.add_argument("--weights-dtype", default="auto")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    if ops.kernels() is None:
        raise SystemExit("the C++ kernels are not built here: nothing to break down")
    print(f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads", flush=True)
    loaded = load_model(args.model, weights_dtype=args.weights_dtype)
    bandwidth = read_bandwidth(repeats=5)
    weight_bytes = linear_bytes(loaded.model)
    print(f"linear weights {loaded.linear_dtype}: {weight_bytes / 2**20:.1f} MiB read per step; "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    freeze_setup()
    results = {}
    for name in args.workloads:
        prompt_len, batch = WORKLOADS[name]
        # Drafting off: every step is one token per request, whatever the greedy text repeats.
        engine = Engine(EngineConfig(kv_cache_memory="2GiB", speculative="off"), loaded=loaded)
        commit_pool(engine)  # as a server does while it idles: no step faults a fresh page of it in
        for prompt in random_prompts(batch, prompt_len, seed=prompt_len):
            engine.add_request(prompt, greedy(args.steps * 4 + 200))
        while any(r.num_computed_tokens < prompt_len for r in engine.stats().requests):  # every prefill first
            engine.step()
        in_place = stack_in_place(engine, loaded.model, args.steps)  # before the profiler has run in the process
        row = profile_steps(engine, args.steps)
        row["in_place"] = in_place
        kv_bytes = batch * (prompt_len + args.steps) * engine.kv_spec.bytes_per_token
        row["floor_s"] = (weight_bytes + kv_bytes) / bandwidth
        row["rest"] = rest_warm_and_cold(engine, loaded.model, args.steps, weight_bytes + kv_bytes)  # last: garbage
        results[name] = row
        print(f"{name} decode step ({batch} x ~{prompt_len} tokens, KV {engine.kv_spec.dtype}): "
              f"{row['step_s'] * 1e3:.2f} ms; with the layers one by one "
              f"{row['layers_one_by_one_s'] * 1e3:.2f} ms = weights {row['weights'] * 1e3:.2f} + attention "
              f"{row['attention'] * 1e3:.2f} + other ops {row['other ops'] * 1e3:.2f} + Python "
              f"{row['python'] * 1e3:.2f} ms; floor (weights + KV read at {bandwidth / 1e9:.0f} GB/s) "
              f"{row['floor_s'] * 1e3:.2f} ms", flush=True)
        if row["in_place"] is not None:
            print(f"  {name} in place: {_in_place_line(row['in_place'])}", flush=True)
        if row["rest"] is not None:
            rest = row["rest"]
            print(f"  {name} the rest alone (layers skipped, the head's logits reused): {rest['warm'] * 1e3:.2f} ms "
                  f"with the caches warm, {rest['cold'] * 1e3:.2f} ms after the step's "
                  f"{rest['streamed_bytes'] / 2**20:.0f} MiB streamed through them", flush=True)
        for request_id in [r.request_id for r in engine.stats().requests]:
            engine.abort(request_id)
    print(f"wrote {save('step_profile', {'args': vars(args), 'bandwidth_bytes_s': bandwidth, 'results': results})}")


if __name__ == "__main__":
    main()
