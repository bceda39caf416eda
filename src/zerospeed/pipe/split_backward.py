"""The zero-bubble split of one block's backward into an input-gradient and a weight-gradient part.

``BackwardInput`` must give the previous stage its gradient as early as possible and ``BackwardWeight``
must compute the weight gradients later without redoing any of the first part's work (else the split
costs more compute than the bubble it removes). Autograd runs the input part when asked only for the
block inputs' gradients: it executes just the graph nodes on paths to those inputs, and of each node
only the outputs those paths need (a ``Linear``'s node computes ``dX`` and skips ``dW``). Where such a
node also feeds a path to a weight (the *boundary*), a pre-hook keeps the gradient arriving at it.
The weight part then starts autograd at each boundary node with what it kept, restricted to the
weights below that node's weight side: it evaluates the node's weight outputs (``dW = dYᵀX`` from the
retained graph) and the short paths below them, nothing of the input part twice. One call per
boundary node, because a node above another (``fc2`` above ``fc1``) would otherwise pass its gradient
down the input side again and count it twice. A block that uses one weight both below and beside its
input path (a weight shared inside the block) gets no split: its weight part is its whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class DeferredWeights:
    """What one block's weight-gradient part starts from: per start, its gradient edges, their
    gradients and the weights below it."""

    starts: list[tuple[list[GradientEdge], list[torch.Tensor | None], list[nn.Parameter]]] = \
        field(default_factory=list)

    def run(self) -> None:
        """Accumulate the block's weight gradients (into ``.grad``, through the usual hooks)."""
        for edges, grads, params in self.starts:
            if edges and params:
                torch.autograd.backward(edges, grads, inputs=params)


def _node(tensor: torch.Tensor) -> Node:
    return get_gradient_edge(tensor).node


_NONE: frozenset[Node] = frozenset()


def _reach(roots: Sequence[Node], inputs: set[Node], params: set[Node]
           ) -> dict[Node, tuple[bool, frozenset[Node]]]:
    """For every node below ``roots``: whether it reaches a block input, and the weights' nodes it
    reaches (without recursion: block graphs can be deep)."""
    reach: dict[Node, tuple[bool, frozenset[Node]]] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if node in reach:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in reach)
            continue
        to_input = node in inputs
        below = frozenset((node,)) if node in params else _NONE
        for child in children:
            child_in, child_params = reach[child]
            to_input = to_input or child_in
            below = below | child_params if child_params else below
        reach[node] = (to_input, below)
    return reach


def _sides(node: Node, reach: dict[Node, tuple[bool, frozenset[Node]]]) -> tuple[frozenset[Node], frozenset[Node]]:
    """The weights below ``node`` off its input path, and those below it along its input path."""
    weight_side, input_side = _NONE, _NONE
    for child, _ in node.next_functions:
        if child is None:
            continue
        to_input, below = reach[child]
        if to_input:
            input_side = input_side | below
        else:
            weight_side = weight_side | below
    return weight_side, input_side


def backward_input(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], params: Sequence[nn.Parameter]
                   ) -> tuple[tuple[torch.Tensor | None, ...], DeferredWeights]:
    """The gradients of ``inputs`` (``None`` where unused) from ``outs`` with ``grads``, and what the
    weight part needs later. ``inputs`` must be leaves that require grad."""
    roots = [_node(out) for out in outs]
    param_of = {_node(p): p for p in params}
    reach = _reach(roots, {_node(t) for t in inputs}, set(param_of))
    boundary: dict[Node, frozenset[Node]] = {}
    for node, (to_input, _) in reach.items():
        if to_input:
            weight_side, input_side = _sides(node, reach)
            if weight_side & input_side:  # a weight shared across the input path: no exact split
                found = torch.autograd.grad(list(outs), list(inputs), list(grads), retain_graph=True,
                                            allow_unused=True)
                return found, backward_weights_later(outs, grads, params)
            if weight_side:
                boundary[node] = weight_side
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keeper(node: Node) -> Any:
        def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            kept[node] = grad_outputs
        return keep

    handles = [node.register_prehook(keeper(node)) for node in boundary]
    try:
        found = torch.autograd.grad(list(outs), list(inputs), list(grads), retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    deferred = DeferredWeights()
    for node, below in boundary.items():
        pairs = [(GradientEdge(node, i), g) for i, g in enumerate(kept.get(node, ())) if g is not None]
        if pairs:  # (a node autograd skipped received no gradient: nothing below it either)
            deferred.starts.append(([e for e, _ in pairs], [g for _, g in pairs], [param_of[n] for n in below]))
    for out, grad, root in zip(outs, grads, roots):
        to_input, below = reach[root]
        if not to_input and below:  # an output that depends on weights only: all of it is the weight part
            deferred.starts.append(([get_gradient_edge(out)], [grad], [param_of[n] for n in below]))
    return found, deferred


def backward_weights_later(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                           params: Sequence[nn.Parameter]) -> DeferredWeights:
    """A block with no input that needs a gradient (token ids on the first stage): the whole backward is
    the weight part."""
    return DeferredWeights(starts=[([get_gradient_edge(out) for out in outs], list(grads), list(params))])


__all__ = ["DeferredWeights", "backward_input", "backward_weights_later"]
