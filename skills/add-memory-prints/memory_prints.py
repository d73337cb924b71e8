"""`memory_prints`: while active, every layer's forward and backward (in the trainer's plain loop, and engine/32's
`LayerRun` under DualPipeV), every loss and every optimizer step says how much memory the allocator holds and its
peak so far, on GPUs (a CPU has no allocator statistics, so the lines show the points only). Observation only: it
wraps `LayerRun`'s stage methods, the trainer's `head_loss` and `run_layers` and an optimizer step hook, and restores
them on exit. It changes no value, only the timing (it synchronises at each line). Import it with this folder on
sys.path: `sys.path.insert(0, "skills/add-memory-prints"); from memory_prints import memory_prints`."""
from contextlib import contextmanager

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from pith_lit.engine.planner import GiB
from pith_lit.engine.stages import LayerRun
from pith_lit.train import trainer


@contextmanager
def memory_prints(say=print):
    "While active: say the allocated memory and its peak so far after each layer, loss and optimizer step."
    cuda = torch.cuda.is_available()

    def point(label: str) -> None:
        if cuda:
            torch.cuda.synchronize()
            used, peak = torch.cuda.memory_allocated() / GiB, torch.cuda.max_memory_allocated() / GiB
            say(f"memory after {label}: allocated {used:.2f} GiB, peak so far {peak:.2f} GiB")
        else:
            say(f"memory after {label}: (no allocator statistics on the CPU)")

    originals = {name: getattr(LayerRun, name) for name in ("_stage1", "_stage5", "_stage1_backward")}

    def after(name: str, what: str):
        def wrapped(self):
            originals[name](self)
            if name != "_stage1" or self.routing is None:   # a dense layer's forward ends with stage 1
                point(f"layer {self.key} {what}")
        return wrapped

    loss, layered = trainer.head_loss, trainer.run_layers

    def loss_then_point(*args, **kwargs):
        out = loss(*args, **kwargs)
        point("the loss")
        return out

    def layer_by_layer(layers, h, positions, dispatcher):   # the plain loop: autograd runs the backward
        routings = []
        for i, layer in enumerate(layers):
            if h.requires_grad:   # its gradient exists once layer i's backward is done
                h.register_hook(lambda grad, i=i: point(f"layer {i} backward"))
            h, r = layered([layer], h, positions, dispatcher)
            routings += r
            point(f"layer {i} forward")
        return h, routings

    for name, what in (("_stage1", "forward"), ("_stage5", "forward"), ("_stage1_backward", "backward")):
        setattr(LayerRun, name, after(name, what))
    trainer.head_loss, trainer.run_layers = loss_then_point, layer_by_layer
    hook = register_optimizer_step_post_hook(lambda *a: point("the optimizer step"))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(LayerRun, name, fn)
        trainer.head_loss, trainer.run_layers = loss, layered
        hook.remove()
