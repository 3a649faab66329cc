"""Layer graphs of arbitrary PyTorch modules, traced on the meta device (no weights, no
real memory): one node per block the model runs (the root's children, with
ModuleList / ModuleDict / Sequential containers opened), edges where one block's output
reaches another's input (skip connections and encoder-decoder links included), and per
node what the planner needs:

- `forward_flops`, `backward_flops`: FlopCounterMode's counts for the example inputs;
- `parameters`, `parameter_bytes`: the node's own weights (a shared weight counts once,
  at its first user);
- `saved_bytes`: activations autograd saves for backward while the node runs
  (saved-tensor hooks; a view counts as the tensor it views, once; weights and their
  views excluded);
- `elementwise_bytes`: what the node's ops without a FLOP formula (elementwise, norms,
  softmax, copies) read and write in forward: its memory-bound work;
- `output_bytes`: what the node hands on;
- `linears`: its nn.Linear layers by name, with the tensor-parallel split their name
  suggests (`column`, `row`, or None; Megatron-LM's roles: q/k/v/gate/up column-wise,
  o/down row-wise);
- `signature`: class and weight shapes; equal signatures are repeats of one block.

Glue that runs in the root's own forward between blocks (an added position table, a
residual add, a reshape) belongs to no node: it runs beside the latest block it reads
from, and its other inputs become edges into that block.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)
from torch.utils.weak import WeakIdKeyDictionary

COLUMN_NAMES = re.compile(r"(^|[._])(q|k|v|wq|wk|wv|q_proj|k_proj|v_proj|query|key|value|qkv|c_attn|in_proj|"
                          r"gate|gate_proj|up|up_proj|w1|w3|fc1|c_fc)$")
ROW_NAMES = re.compile(r"(^|[._])(o|wo|o_proj|out_proj|dense|c_proj|down|down_proj|w2|fc2)$")


def blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The root's children in definition order, with containers opened, and so are the
    wrappers that hold a stack of layers (a Hugging Face `model` around its `layers`
    ModuleList). A Sequential inside a stack is one of its layers, and stays whole."""
    out = []
    stacks = (nn.ModuleList, nn.ModuleDict)

    def opens(module: nn.Module, in_stack: bool) -> bool:
        if isinstance(module, stacks) or any(isinstance(c, stacks) for c in module.children()):
            return True
        return isinstance(module, nn.Sequential) and not in_stack

    def visit(prefix: str, module: nn.Module, in_stack: bool) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if opens(child, in_stack):
                visit(full + ".", child, in_stack or isinstance(child, stacks))
            else:
                out.append((full, child))

    visit("", root, False)
    return out


INPUT = ""   # the tag of the model's own inputs


def _cpu_flash_forward(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _grouped_mm(a_shape, b_shape, *args, **kwargs) -> int:
    """torch._grouped_mm (MoE experts in one call; executor.models.MoE.experts): each
    row (or column) of the grouped 2-D operand meets one group's matrix, so the FLOPs are
    those of one matmul over all rows; two 3-D operands are a batched matmul."""
    if len(a_shape) == 2 and len(b_shape) == 3:      # [M, K] x [G, K, N] -> [M, N]
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:      # [G, M, K] x [K, N] -> [M, N]
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    if len(a_shape) == 2:                             # [M, K] x [K, N] -> [G, M, N], K grouped
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


# FlopCounterMode counts the CUDA fused attention kernels; the fake CPU device the trace
# runs on takes the CPU flash kernel, counted by the same formulas (the full s x s
# product, as the analytic graph counts it). It has no formula for torch._grouped_mm.
EXTRA_FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
    **({torch.ops.aten._grouped_mm: _grouped_mm} if hasattr(torch.ops.aten, "_grouped_mm") else {}),
}


def split_role(name: str) -> str | None:
    if COLUMN_NAMES.search(name):
        return "column"
    if ROW_NAMES.search(name):
        return "row"
    return None


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


@dataclass
class _Flow:
    """One tensor handed from a block (or the model's inputs) to later blocks: sent
    across every stage boundary from its source to its last reader, once."""

    source: str
    num_bytes: int
    last_reader: int = -1   # position in the execution order


class _Provenance(TorchDispatchMode):
    """Tags every tensor made outside the blocks (glue) with one block: the latest of
    the blocks its inputs came from, whose stage computes it. The glue's other inputs
    must reach that stage, so `link(flow, block)` records them as read there: a residual
    stream added up in the root's forward is one edge per block, not an edge from
    every earlier block."""

    def __init__(self, tags: WeakIdKeyDictionary, inside: list[str], position: dict[str, int], tag, link,
                 traffic: dict[str, int], weights: set[int]):
        super().__init__()
        self.tags, self.inside, self.position, self.tag, self.link = tags, inside, position, tag, link
        self.traffic, self.weights = traffic, weights

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside:
            # Inside a block: the bytes every op without a FLOP formula (elementwise,
            # norms, softmax, copies) reads and writes. Views, and queries that return
            # no tensor (a fake tensor's device), move nothing; weights are
            # left out (an embedding reads its rows, not its table; a norm's scale is
            # small beside its activations).
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if outputs and func.overloadpacket not in flop_registry and func.overloadpacket not in EXTRA_FLOP_FORMULAS \
                    and not func.is_view:
                read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in self.weights]
                name = self.inside[-1]
                self.traffic[name] = self.traffic.get(name, 0) + _nbytes(read) + _nbytes(outputs)
        else:
            flows = {id(f): f for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor) and (f := self.tags.get(t)) is not None}
            if flows:
                latest = max((f.source for f in flows.values()), key=self.position.__getitem__)
                for flow in flows.values():
                    if flow.source != latest:
                        self.link(flow, latest)
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self.tag(t, latest)
        return out


def _is_meta_trace(example_inputs, example_kwargs) -> bool:
    inputs = [t for t in tree_leaves((example_inputs, example_kwargs)) if isinstance(t, torch.Tensor)]
    return bool(inputs) and all(t.is_meta for t in inputs)


def _fake_state(module: nn.Module, mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    """Fake CPU stand-ins for every weight and buffer (meta or real): the trace runs
    without memory and without touching a weight, while each op takes the kernel a real
    device would (scaled_dot_product_attention its fused kernel, which keeps no score
    matrix, where the meta device would decompose it). A tensor shared by several names
    gets one stand-in, so ties stay tied."""
    stand_ins: dict[int, torch.Tensor] = {}
    state = {}
    with mode:
        for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
            if id(t) not in stand_ins:
                fake = _fake_like(t)
                stand_ins[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
            state[name] = stand_ins[id(t)]
    return state


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """Under a FakeTensorMode: a fake CPU tensor of t's shape, dtype and strides."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)


def _first_tensor(output) -> torch.Tensor:
    """The default loss reads the output's first tensor (a ModelOutput's logits)."""
    if isinstance(output, torch.Tensor):
        return output
    values = list(output.values()) if isinstance(output, dict) else output
    return next(t for t in tree_leaves(values) if isinstance(t, torch.Tensor))


def trace_module(module: nn.Module, example_inputs: tuple, loss_fn: Callable | None = None,
                 example_kwargs: dict | None = None) -> nx.DiGraph:
    """Run `module` forward and backward on `example_inputs` (meta tensors, or real ones
    for a module already on a device) and return its layer graph. The loss is
    `loss_fn(output)`, by default the sum of the output."""
    nodes = dict(blocks(module))
    graph = nx.DiGraph(name=type(module).__name__)
    tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
    inside: list[str] = []
    saved: dict[str, int] = {}
    seen_saved: dict[str, WeakIdKeyDictionary] = {}
    fake = FakeTensorMode() if _is_meta_trace(example_inputs, example_kwargs) else contextlib.nullcontext()
    state = _fake_state(module, fake) if isinstance(fake, FakeTensorMode) else {}
    if state:
        with fake:
            example_inputs, example_kwargs = tree_map_only(torch.Tensor, _fake_like, (example_inputs, example_kwargs))
    weights = {id(p) for p in module.parameters()} | {id(t) for t in state.values()}
    owner: dict[int, str] = {}
    order: list[str] = []
    hooks = []

    # The model's inputs are tagged INPUT, before every block: a block deep in the model
    # that reads one (a decoder reading its target tokens) needs it sent through every
    # stage before its own.
    position: dict[str, int] = {INPUT: -1}
    traffic: dict[str, int] = {}
    inputs: dict[str, int] = {}
    flows: list[_Flow] = []

    def tag(t: torch.Tensor, source: str) -> None:
        flows.append(_Flow(source, _nbytes(t)))
        tags[t] = flows[-1]

    def link(flow: _Flow, target: str) -> None:
        """`target` reads the flow's tensor: an edge, and the flow reaches that far."""
        flow.last_reader = max(flow.last_reader, position[target])
        if flow.source == INPUT:
            inputs[target] = inputs.get(target, 0) + flow.num_bytes
        elif graph.has_edge(flow.source, target):
            graph.edges[flow.source, target]["bytes"] += flow.num_bytes
        else:
            graph.add_edge(flow.source, target, bytes=flow.num_bytes)

    for t in tree_leaves((example_inputs, example_kwargs)):
        if isinstance(t, torch.Tensor):
            tag(t, INPUT)

    def pre_hook(name):
        def hook(mod, args, kwargs):
            if name not in graph:
                position[name] = len(order)
                order.append(name)
                graph.add_node(name, module_type=type(mod).__name__, calls=0)
            graph.nodes[name]["calls"] += 1
            read = {id(f): f for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and (f := tags.get(t)) is not None and f.source != name}
            for flow in read.values():
                link(flow, name)
            inside.append(name)
        return hook

    def post_hook(name):
        def hook(mod, args, kwargs, output):
            inside.pop()
            graph.nodes[name]["output_bytes"] = _nbytes(output)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    tag(t, name)
        return hook

    def pack(t: torch.Tensor):
        # A saved view keeps its base alive: count the base, once. A weight's transpose
        # (what a matmul saves) is the weight, not an activation.
        base = t._base if t._base is not None else t
        if inside and id(base) not in weights:
            name = inside[-1]
            seen = seen_saved.setdefault(name, WeakIdKeyDictionary())
            if base not in seen:
                seen[base] = True
                saved[name] = saved.get(name, 0) + _nbytes(base)
        return t

    for name, mod in nodes.items():
        hooks.append(mod.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
        hooks.append(mod.register_forward_hook(post_hook(name), with_kwargs=True))
    try:
        # One FlopCounterMode around forward and backward: it attributes backward FLOPs
        # to modules only when it saw their forward.
        with fake, FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as flops:
            with _Provenance(tags, inside, position, tag, link, traffic, weights), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output = torch.func.functional_call(module, state, tuple(example_inputs), example_kwargs or {})
                loss = loss_fn(output) if loss_fn else _first_tensor(output).float().sum()
            forward = {k: sum(v.values()) for k, v in flops.get_flop_counts().items()}
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    total = {k: sum(v.values()) for k, v in flops.get_flop_counts().items()}
    root = type(module).__name__

    for name in order:
        mod = nodes[name]
        own = []
        for p in mod.parameters():
            if id(p) not in owner:
                owner[id(p)] = name
                own.append(p)
        key = f"{root}.{name}"
        data = graph.nodes[name]
        data.update(
            forward_flops=float(forward.get(key, 0)),
            backward_flops=float(total.get(key, 0) - forward.get(key, 0)),
            parameters=sum(p.numel() for p in own),
            parameter_bytes=sum(p.numel() * p.element_size() for p in own),
            saved_bytes=saved.get(name, 0),
            elementwise_bytes=traffic.get(name, 0),
            linears={n: split_role(n) for n, m in mod.named_modules() if isinstance(m, nn.Linear)},
            signature=(type(mod).__name__, tuple((n, tuple(p.shape)) for n, p in mod.named_parameters())),
        )
    unused = [p for p in module.parameters() if id(p) not in owner]
    graph.graph["glue_parameters"] = sum(p.numel() for p in unused)   # the root's own, or blocks never run
    graph.graph["order"] = order
    graph.graph["input_bytes"] = {name: inputs[name] for name in order if name in inputs}
    # (first cut, last cut + 1, bytes) of every tensor that outlives its block: cut c
    # lies after block c.
    graph.graph["flows"] = sorted((max(position[f.source], 0), f.last_reader, f.num_bytes)
                                  for f in flows if f.last_reader > max(position[f.source], 0))
    graph.graph["total_forward_flops"] = float(forward.get("Global", 0))
    graph.graph["total_backward_flops"] = float(total.get("Global", 0) - forward.get("Global", 0))
    return graph


def repeats(graph: nx.DiGraph) -> dict[tuple, list[str]]:
    """Nodes grouped by signature: a transformer's layers form one group."""
    groups: dict[tuple, list[str]] = {}
    for name in graph.graph["order"]:
        groups.setdefault(graph.nodes[name]["signature"], []).append(name)
    return groups
