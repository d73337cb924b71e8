"""Measured memory and time of each decoder layer, the embedding and the head of a bench config on one GPU: what
the planner's memory model (engine/37_planner) and its time profile (engine/38_steptime) are checked against.

For each layer of a short cut of the model (a few layers, so every layer kind appears), one micro-batch runs forward
stage by stage (engine/32 `LayerRun`, the local dispatcher), then the loss, then backward layer by layer. Around
each layer it records the bytes the allocator holds after its forward minus before (what the layer keeps for
backward, its output included), the transient peak above that during its forward, the transient peak above the
bytes held when its backward starts, and the time of each stage (CUDA events). The first pass warms up (compiles);
the second is measured. Gradients of the first pass stay allocated, so the transients are activations only.

usage: PYTHONPATH=. python3 benchmarks/layer_probe.py CONFIG LAYERS [KEY=VALUE ...]  -> one JSON line per layer"""
import json
import sys

import torch

from pith_lit.engine.stages import LayerRun
from pith_lit.models.protocol import head_loss
from pith_lit.train.config import load_config
from pith_lit.train.trainer import build_run

GiB = 2 ** 30


CUDA = torch.cuda.is_available()   # on a CPU (a dry run of the script on a tiny config) bytes read 0


def mem():
    if not CUDA:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def peak():
    return torch.cuda.max_memory_allocated() if CUDA else 0


def reset():
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


class Event:
    "A CUDA timing event, or the host clock on a CPU."
    def __init__(self):
        self.e = torch.cuda.Event(enable_timing=True) if CUDA else None

    def record(self):
        if CUDA:
            self.e.record()
        else:
            import time
            self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return self.e.elapsed_time(other.e) if CUDA else (other.t - self.t) * 1e3


def probe(config: str, layers: int, overrides: list[str]) -> list[dict]:
    over = [f"model.num_hidden_layers={layers}", "run.dir=/tmp/layer_probe", "ckpt.resume=false", "ckpt.every=-1",
            "log.tensorboard=false"] + overrides
    cfg = load_config(config, over)
    run = build_run(cfg)
    model, t = run.model, cfg.train
    B, S = t.micro_batch, t.seq_len
    dev = run.device
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (B, S), device=dev, generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (B, S), device=dev, generator=g)
    positions = torch.arange(S, device=dev)
    out = []
    for measured in (False, True):
        recs = []
        ev = Event
        m0 = mem()
        h0 = model.prolog(ids)
        emb = mem() - m0
        h = h0.detach().requires_grad_()
        runs = []
        for key, layer in model.model.layers.items():
            r = LayerRun(layer, key, run.dispatcher)
            before = mem()
            reset()
            times = {}
            for kind, fn in r.forward(h, positions):
                a, b = ev(), ev()
                a.record(); fn(); b.record()
                times[fn.__name__.lstrip("_")] = (a, b)
            after = mem()
            rec = dict(layer=int(key), moe=r.routing is not None, kept=after - before,
                       fwd_peak=peak() - after, times=times)
            recs.append(rec)
            runs.append(r)
            h = r.h_out
        before = mem()
        reset()
        hl = h.detach().requires_grad_()
        a, b = ev(), ev()
        a.record(); loss = head_loss(model, hl, labels); b.record()
        head = dict(kept=mem() - before, fwd_peak=peak() - mem(), times={"loss": (a, b)})
        before = mem()
        reset()
        a, b = ev(), ev()
        a.record(); loss.backward(); b.record()
        head.update(bwd_peak=peak() - before, bwd_left=mem() - before)
        head["times"]["loss_backward"] = (a, b)
        grad = hl.grad
        for r, rec in zip(reversed(runs), reversed(recs)):
            before = mem()
            reset()
            for kind, fn in r.backward(grad):
                a, b = ev(), ev()
                a.record(); fn(); b.record()
                rec["times"][fn.__name__.lstrip("_")] = (a, b)
            grad = r.grad_in
            rec.update(bwd_peak=peak() - before, bwd_freed=before - mem())
        a, b = ev(), ev()
        a.record(); h0.backward(grad); b.record()
        head["times"]["embed_backward"] = (a, b)
        del runs, h, hl, loss, grad, h0
        mem()
        if measured:
            tokens = B * S
            for rec in recs + [dict(head, layer="head")]:
                rec["times"] = {k: round(a.elapsed_time(b), 3) for k, (a, b) in rec["times"].items()}
                for k in ("kept", "fwd_peak", "bwd_peak", "bwd_freed", "bwd_left"):
                    if k in rec:
                        rec[k + "_per_token"] = round(rec[k] / tokens, 1)
                rec.update(config=config, overrides=overrides, tokens=tokens)
                out.append(rec)
            out.append(dict(layer="embedding", kept_per_token=round(emb / tokens, 1), config=config,
                            overrides=overrides, tokens=tokens))
    t0, t1 = Event(), Event()
    t0.record(); run.optimizer.step(); t1.record(); mem()
    t0.record(); run.optimizer.step(); t1.record(); mem()
    out.append(dict(layer="optimizer", ms=round(t0.elapsed_time(t1), 3), config=config, overrides=overrides,
                    params=sum(p.numel() for p in model.parameters()), static_gib=round(mem() / GiB, 3)))
    return out


if __name__ == "__main__":
    for rec in probe(sys.argv[1], int(sys.argv[2]), sys.argv[3:]):
        print(json.dumps(rec), flush=True)
