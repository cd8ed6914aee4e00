"""Compressed-resident weights: the decoder layers' streams stay on the device and each layer is
decoded into a small pool of scratch slots just before it runs (docs/RESIDENT.md). Read me first.

    side stream     decode L0 -> slot 0 | decode L1 -> slot 1 |(waits: L0 done) decode L2 -> slot 0 |
    compute stream       wait L0 | L0 forward | wait L1 | L1 forward | wait L2 | L2 forward ...

* The model is transformers' own, untouched. A forward pre-hook on decoder layer i waits for its
  decode, points the layer's parameters at its slot (the slot tensors are the parameters; no
  copy), and queues the decode of layer i + 1; a forward hook records when the slot is free.
* Layer i decodes into slot i % slots. A decode waits, on the side stream, for the slot's last
  user to finish; a layer whose slot is still held by the running layer (layer 0 of the next
  forward when the layer count is odd) is decoded at its own pre-hook instead.
* Decodes are prepared launches (cuda_ext.Prepared, mode INDEXED: pieces of the resident index,
  codec/resident.py): no allocation, no host work but the launch. Their statuses are copied to
  pinned memory on the side stream and checked once the forward's decodes have completed.
* On the CPU there are no streams: one slot, decoded by the C++ twin in the pre-hook.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import cuda_ext
from codec.constants import CODEC_FLOAT, LANES, SEGMENT_STEPS
from cuda_ext import plans

ENTRY_STEPS = 256                  # the resident index's piece: 32 x 256 weights


@dataclass
class CompressedLayer:
    """One decoder layer's float-coded tensors, kept compressed on the device."""

    index: int                     # the layer number
    plan: plans.Plan               # its float tensors; data holds their bytes [plan.start, plan.end)
    data: torch.Tensor
    entries: cuda_ext.DeviceIndex  # the resident index, recorded by the load's decode

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.entries.nbytes


def estimate_bytes(entries, slots: int) -> int:
    """Device bytes a model takes in compressed-resident mode, from its header: kept streams of the
    decoder layers' float tensors, their index, `slots` scratch slots, and the rest decoded."""
    kept = [e for e in entries if e.layer is not None and e.codec == CODEC_FLOAT]
    streams = sum(r["length"] for e in kept for r in e.streams.values())
    index = sum(e.params.n_segments * (SEGMENT_STEPS // ENTRY_STEPS) * (LANES + 1) * 4 for e in kept)
    per_layer: dict[int, int] = {}
    for e in kept:
        per_layer[e.layer] = per_layer.get(e.layer, 0) + e.nbytes
    kept_ids = {id(e) for e in kept}
    rest = sum(e.nbytes for e in entries if id(e) not in kept_ids)
    return streams + index + slots * max(per_layer.values(), default=0) + rest


def keep_layer(index: int, plan: plans.Plan, data: torch.Tensor, path=None) -> tuple[CompressedLayer, dict]:
    """Keep a layer's float tensors compressed (`data`: the bytes of `plan`, on the device): one
    decode checks them and records the resident index. Returns the layer and its raw-coded
    tensors (norms: small), which stay decoded."""
    tensors, entries = cuda_ext.build_index(plan, data, ENTRY_STEPS, path)
    floats = {e.name for e in plan.float_entries}
    return CompressedLayer(index, plans.select(plan, floats), data, entries), \
        {k: v for k, v in tensors.items() if k not in floats}


def slot_spec(layers: list[CompressedLayer], prefixes: dict[int, str]) -> dict[str, tuple[tuple, torch.dtype]]:
    """{name relative to its layer: (shape, dtype)} over every compressed layer; the layers must agree."""
    spec: dict[str, tuple[tuple, torch.dtype]] = {}
    for c in layers:
        for e in c.plan.float_entries:
            rel, want = e.name[len(prefixes[c.index]):], (tuple(e.shape), e.torch_dtype)
            if spec.setdefault(rel, want) != want:
                raise ValueError(f"{e.name}: {want} differs from the other layers' {spec[rel]}")
    return spec


def layer_prefix(layer: CompressedLayer) -> str:
    """"model.layers.3." for layer 3: its tensors' common name prefix up to the layer number."""
    name = layer.plan.float_entries[0].name
    marker = f".{layer.index}."
    return name[:name.index(marker) + len(marker)]


def attach(model: torch.nn.Module, layers: list[CompressedLayer], device: torch.device, slots: int,
           on_forward: Callable[[float], None] | None = None) -> "LayerSchedule":
    """A schedule for `model`'s compressed layers (not yet installed: see LayerSchedule)."""
    prefixes = {c.index: layer_prefix(c) for c in layers}
    modules = {i: model.get_submodule(p[:-1]) for i, p in prefixes.items()}
    return LayerSchedule(modules, prefixes, layers, device, slots, on_forward)


class LayerSchedule:
    """Decodes each compressed layer into a scratch slot one layer ahead of its use."""

    def __init__(self, modules: dict[int, torch.nn.Module], prefixes: dict[int, str], layers: list[CompressedLayer],
                 device: torch.device, slots: int = 2, on_forward: Callable[[float], None] | None = None):
        self.cuda = device.type == "cuda"
        self.n_slots = slots if self.cuda else 1
        self.modules, self.layers, self.on_forward = modules, layers, on_forward or (lambda seconds: None)
        spec = slot_spec(layers, prefixes)
        self.slots = [{rel: torch.empty(shape, dtype=dtype, device=device) for rel, (shape, dtype) in spec.items()}
                      for _ in range(self.n_slots)]
        self.prefixes = prefixes
        self.targets = [self._targets(modules[c.index], prefixes[c.index], c) for c in layers]
        self.jobs = [[cuda_ext.Prepared(c.plan, c.data, [slot[t[2]] for t in targets], plans.MODE_INDEXED, c.entries)
                      for slot in self.slots] for c, targets in zip(layers, self.targets)]
        self.params = [{name: torch.nn.Parameter(t, requires_grad=False) for name, t in slot.items()}
                       for slot in self.slots]
        self.holder: list[int | None] = [None] * self.n_slots
        self.issued = [False] * len(layers)
        self.seconds = 0.0
        if self.cuda:
            self.side = torch.cuda.Stream(device)
            self.decoded = [torch.cuda.Event() for _ in layers]
            self.released = [torch.cuda.Event() for _ in range(self.n_slots)]
            self.host_status = [[torch.zeros_like(j.status, device="cpu").pin_memory() for j in row] for row in self.jobs]
            self.groups: list[list[tuple[torch.cuda.Event, torch.cuda.Event, int, int]]] = [[]]   # per forward
        self.handles = []

    @staticmethod
    def _targets(module: torch.nn.Module, prefix: str, layer: CompressedLayer):
        """(submodule, attribute, name relative to the layer) of each of the layer's float tensors."""
        out = []
        for e in layer.plan.float_entries:
            rel = e.name[len(prefix):]
            parent, _, leaf = rel.rpartition(".")
            out.append((module.get_submodule(parent) if parent else module, leaf, rel))
        return out

    @property
    def scratch_bytes(self) -> int:
        return sum(t.nbytes for slot in self.slots for t in slot.values())

    @property
    def compressed_bytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def placeholders(self) -> dict[str, torch.Tensor]:
        """Every compressed parameter pointed at slot 0, for building the model (nothing on meta)."""
        return {self.prefixes[c.index] + rel: self.slots[0][rel] for c, targets in zip(self.layers, self.targets)
                for _, _, rel in targets}

    def install(self) -> None:
        for k, c in enumerate(self.layers):
            module = self.modules[c.index]
            self.handles.append(module.register_forward_pre_hook(lambda m, a, k=k: self._before(k)))
            self.handles.append(module.register_forward_hook(lambda m, a, o, k=k: self._after(k)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ---- the hooks ---------------------------------------------------------------------------
    def _before(self, k: int) -> None:
        slot = k % self.n_slots
        if k == 0 and self.cuda:
            self._harvest()
            self.groups.append([])
        if not self.issued[k]:
            self._issue(k)
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.decoded[k])
        self.issued[k] = False
        for (module, leaf, rel) in self.targets[k]:
            module._parameters[leaf] = self.params[slot][rel]
        self.holder[slot] = k
        nxt = (k + 1) % len(self.layers)
        if self.cuda and not self.issued[nxt] and self.holder[nxt % self.n_slots] is None:
            self._issue(nxt)

    def _after(self, k: int) -> None:
        slot = k % self.n_slots
        if self.cuda:
            self.released[slot].record(torch.cuda.current_stream())
        self.holder[slot] = None
        if k == len(self.layers) - 1 and not self.cuda:
            self.on_forward(self.seconds)
            self.seconds = 0.0

    def _issue(self, k: int) -> None:
        slot = k % self.n_slots
        job = self.jobs[k][slot]
        if not self.cuda:
            t0 = time.perf_counter()
            job.run()
            job.check()
            self.seconds += time.perf_counter() - t0
            self.issued[k] = True
            return
        with torch.cuda.stream(self.side):
            self.side.wait_event(self.released[slot])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.side)
            job.run()
            self.host_status[k][slot].copy_(job.status, non_blocking=True)
            end.record(self.side)
            self.decoded[k].record(self.side)
        self.groups[-1].append((start, end, k, slot))
        self.issued[k] = True

    def _harvest(self) -> None:
        """Earlier forwards' decodes, once complete: one time observation each, and their statuses
        (a decode's status is read before its slot is decoded into again: that waits for this)."""
        while self.groups and self.groups[0] and self.groups[0][-1][1].query():
            group = self.groups.pop(0)
            for _, _, k, slot in group:
                job = self.jobs[k][slot]
                plans.raise_on_status(job.plan, self.host_status[k][slot], job.path)
            self.on_forward(sum(a.elapsed_time(b) for a, b, _, _ in group) / 1e3)
        self.groups = [g for g in self.groups if g] or [[]]
