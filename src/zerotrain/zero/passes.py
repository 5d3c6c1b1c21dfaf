"""What a stage-3 pass is, as the coordinator sees it: whether autograd is running a backward,
the recorded order of unit uses in a forward or a backward (which prefetching follows), when a
module's backward starts, and the tensors in a module's output."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import register_multi_grad_hook

if TYPE_CHECKING:
    from zerotrain.zero.partition import FlatParamUnit


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class UseOrder:
    """The recorded order of unit uses in one kind of pass, and where the current pass is."""

    def __init__(self):
        self.order: list[FlatParamUnit] = []
        self.recording = True
        self.pos = 0

    def start(self) -> None:
        self.pos = 0

    def see(self, unit: FlatParamUnit) -> bool:
        """Note a use; True when it matches the record (so prefetching ahead is meaningful)."""
        if self.recording:
            if unit not in self.order:
                self.order.append(unit)
            return False
        if self.pos < len(self.order) and self.order[self.pos] is unit:
            self.pos += 1
            return True
        if unit in self.order[: self.pos]:
            return True  # a repeated use (module called twice): the record still holds
        self.order, self.recording, self.pos = [unit], True, 0  # new path: record it again
        return False

    def finish(self) -> None:
        if self.recording and self.order:
            self.recording = False

    def upcoming(self):
        return self.order[self.pos :]

    @property
    def at_end(self) -> bool:
        """The recorded pass has no use left."""
        return not self.recording and self.pos >= len(self.order)


def before_backward_of(tensors, hook) -> None:
    """Call ``hook()`` once per backward pass, when autograd is about to run the first of the
    nodes that made ``tensors`` (a module's outputs): the module's backward starts there.

    A node pre-hook, not a tensor hook: autograd runs a node's tensor hooks first, and those
    include the release hooks of the module that consumed these outputs (registered on its
    inputs), so that module's frozen units are released before this one's are gathered (with a
    leaf block of a LoRA model, the other order held two blocks whole)."""
    fired = {"task": None}

    def once(*_):
        task = torch._C._current_graph_task_id()
        if fired["task"] != task:
            fired["task"] = task
            hook()

    for node in unique(t.grad_fn for t in tensors):
        node.register_prehook(once)
    leaves = [t for t in tensors if t.grad_fn is None]  # outputs that are leaf tensors
    if leaves:
        register_multi_grad_hook(leaves, once, mode="any")


def unique(items) -> list:
    out: list = []
    for item in items:
        if item is not None and all(item is not o for o in out):
            out.append(item)
    return out


def output_tensors(output):
    from torch.utils._pytree import tree_leaves

    if hasattr(output, "__dataclass_fields__") or hasattr(output, "to_tuple"):
        output = output.to_tuple() if hasattr(output, "to_tuple") else vars(output)
    return [t for t in tree_leaves(output) if torch.is_tensor(t)]
