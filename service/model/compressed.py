"""Compressed-resident weights: the decoder layers' streams stay on the device and each module's
weights are decoded into a small ring of scratch buffers just before the module runs
(docs/RESIDENT.md). Read me first.

    side stream     decode q -> buffer 0 | decode k -> buffer 1 |(waits: q done) decode v -> buffer 0 |
    compute stream       wait q | q_proj | wait k | k_proj | wait v | v_proj ...

* The model is transformers' own, untouched. A unit is one module's compressed tensors (a Linear's
  weight): a forward pre-hook waits for the unit's decode, points the module's parameters at its
  buffer (the buffer views are the parameters; no copy) and queues the next unit's decode; a forward
  hook records when the buffer is free again. Scratch buffers are one Linear large, not one layer: a 7B
  model's ring is 2 x 90 MB, so the weights stay under 0.70 of bf16.
* The next unit is the one that ran after this one last time (the first forward follows archive
  order), so any execution order is served; a unit with no free buffer decodes at its own pre-hook.
  A forward's decodes stay inside it: the side stream first waits for everything queued before
  the forward (a graph replay reading the buffers, say), and the last unit does not prefetch the
  next forward's first.
* Decodes are prepared launches (cuda_ext.Prepared, mode INDEXED: pieces of the resident index,
  codec/resident.py): no allocation, no host work but the launch. Their statuses are copied to
  pinned memory on the side stream and checked once the forward's decodes have completed.
* So a forward can be captured as a CUDA graph (the paged engine's decode steps): the hooks run
  once, at capture, and the graph holds the fork to the side stream, each decode and each wait.
  A captured forward keeps no timings and no statuses (event timing and reading back need the
  host); the load checked every stream, and eager forwards (prompt steps) go on checking.
* On the CPU there are no streams: one buffer, decoded by the C++ twin in the pre-hook.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import cuda_ext
from codec.constants import CODEC_FLOAT, LANES, SEGMENT_STEPS
from cuda_ext import plans

from ..errors import LoadFailed
from . import fixed, quantized

ENTRY_STEPS = 256                  # the resident index's piece: 32 x 256 weights
LARGE_ENTRY_STEPS = 512            # pieces of a tensor of LARGE weights or more
LARGE = 1 << 25
SMALL_ENTRY_STEPS = 64             # pieces of a module of under 1 / SMALL_SHARE of the largest's weights
SMALL_SHARE = 4
ALIGN = 256                        # each tensor's place in a scratch buffer


def entry_steps(e) -> int:
    """The piece size of a tensor's resident index. An index entry (32 states and a word offset,
    132 bytes) costs 0.8 % of the bf16 bytes at 256 steps. A tensor of 2^25 weights or more (a 7B
    model's MLP matrices) has over 4096 pieces of 256 steps: more than one wave of the ~3200 warps
    an H100 holds (24 a multiprocessor), so its decode takes two waves of 256 steps -- as long as
    one wave of 512-step pieces, whose index is half as large."""
    return LARGE_ENTRY_STEPS if e.params.n >= LARGE else ENTRY_STEPS


def _module(e) -> str:
    return e.name.rpartition(".")[0]


def _scratch_bytes(e) -> int:
    """A tensor's place in a scratch buffer: its bytes, aligned."""
    return -(-e.nbytes // ALIGN) * ALIGN


def piece_steps(kept: list) -> dict[str, int]:
    """Each kept tensor's piece size, decided per module (a module's tensors are decoded together,
    from one index: a large weight's bias takes the weight's pieces): its largest tensor's
    entry_steps, or 64 for a module of under a quarter of the largest module's weights -- GQA's k
    and v projections (an 8B model's 1024 x 4096): too few 256-step pieces to fill the GPU, so each
    warp's 256 steps are the decode's latency, and 64-step pieces take it from 0.037 to 0.022 ms
    (H200 and H100, docs/BENCHMARKS.md) for 3.2 % of their bf16 bytes, 0.09 % of the model's."""
    steps: dict[str, int] = {}
    weights: dict[str, int] = {}
    for e in kept:
        m = _module(e)
        steps[m] = max(steps.get(m, 0), entry_steps(e))
        weights[m] = weights.get(m, 0) + e.params.n
    most = max(weights.values(), default=0)
    for m, n in weights.items():
        if n * SMALL_SHARE < most:
            steps[m] = SMALL_ENTRY_STEPS
    return {e.name: steps[_module(e)] for e in kept}


@dataclass
class IndexedPlan:
    """Float tensors of one layer that share a resident index (one piece size)."""

    plan: plans.Plan               # data holds their bytes [plan.start, plan.end)
    index: cuda_ext.DeviceIndex    # recorded by the load's decode


@dataclass
class CompressedLayer:
    """One decoder layer's float-coded tensors, kept compressed on the device."""

    index: int                     # the layer number
    data: torch.Tensor             # the layer's archive bytes
    parts: list[IndexedPlan]

    @property
    def float_entries(self) -> list:
        return [e for part in self.parts for e in part.plan.float_entries]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + sum(part.index.nbytes for part in self.parts)


def stays_compressed(e) -> bool:
    """Whether compressed-resident mode keeps a tensor compressed: a decoder layer's float-coded
    bf16/fp16/fp32 matrix (what decode_pieces decodes in pieces; a norm's vector, 0.01 % of a
    layer, stays decoded, as the paged engine's Triton step reads it without calling its module).
    GGUF matrices stay their blocks (quantized.py); every other codec -- raw, fp8, int8 -- is
    decoded at load, as in decoded mode."""
    return e.layer is not None and e.codec == CODEC_FLOAT and e.dtype in plans.DTYPE_CODES and len(e.shape) >= 2


def kept_entries(entries, form: str = "indexed", native: bool = True) -> tuple[list, list]:
    """The tensors a load in compressed mode keeps compressed: GGUF matrices as their blocks, and
    float matrices in `form` (the fixed-rate form's, or else a decoder layer's streams). Block
    modules and FixedLinears are llama.py's: a model served by transformers' classes (`native`
    False: llama.native_config) gets both decoded (build.finish, fixed.attach); its streams are
    decoded by hooks on any model. Empty lists: the model is held decoded."""
    blocks = [e for e in entries if quantized.keeps(e)] if native else []
    if form == "fixed":
        return blocks, [e for e in entries if fixed.keeps(e) and e.layer is not None] if native else []
    return blocks, [e for e in entries if stays_compressed(e)]


def estimate_bytes(entries, scratch: int, form: str = "indexed", host: frozenset[str] = frozenset(),
                   native: bool = True) -> int:
    """Device bytes a model takes in compressed-resident mode, from its header: what
    `kept_entries` keeps -- GGUF matrices' blocks and their scratch (quantized.py); float matrices
    in the fixed-rate form (fixed.py), or else the decoder layers' kept streams, their index and
    `scratch` scratch buffers -- and the rest counted decoded (outside the layers, a head and the
    embedding too), but for the tensors the fixed form keeps on the host (`host`:
    fixed.host_names, if the form holds them)."""
    blocks, floats = kept_entries(entries, form, native)
    ids = {id(e) for e in blocks + floats}
    rest = sum(e.nbytes for e in entries if id(e) not in ids and not (e.name in host and fixed.keeps(e)))
    held = fixed.estimate_bytes(floats) if form == "fixed" else _indexed_bytes(entries, floats, scratch)
    return quantized.estimate_bytes(blocks) + held + rest


def kept_spans(entries) -> list[tuple[int, int]]:
    """The archive byte ranges this mode holds on the device: each decoder layer's batch of
    streams (plans.layer_groups, as ring.layer_batches reads them) where it keeps a tensor of it,
    whole, as the pipeline read it (its norms' streams and the gaps between streams too)."""
    return [plans.stream_range(g) for g in plans.layer_groups(entries) if any(stays_compressed(e) for e in g)]


def _indexed_bytes(entries, kept: list, scratch: int) -> int:
    """The kept layers' bytes (kept_spans), their resident index and `scratch` buffers of the
    largest module."""
    streams = sum(end - start for start, end in kept_spans(entries))
    steps = piece_steps(kept)
    index = sum(e.params.n_segments * (SEGMENT_STEPS // steps[e.name]) * (LANES + 1) * 4 for e in kept)
    per_module: dict[str, int] = {}
    for e in kept:
        per_module[_module(e)] = per_module.get(_module(e), 0) + _scratch_bytes(e)
    return streams + index + scratch * max(per_module.values(), default=0)


def keep_layer(index: int, entries: list, span: tuple[int, int], data: torch.Tensor,
               path=None) -> tuple[CompressedLayer, dict]:
    """Keep a layer's float tensors compressed (`data`: its archive bytes [start, end) = span, on
    the device): a decode per piece size checks them and records their resident index. Returns the
    layer and its other tensors (norms: small), which stay decoded."""
    start, end = span
    kept = [e for e in entries if stays_compressed(e)]
    steps_of = piece_steps(kept)
    tensors, parts = {}, []
    for steps in sorted(set(steps_of.values())):
        plan = plans.build([e for e in kept if steps_of[e.name] == steps], path, start, end)
        decoded, idx = cuda_ext.build_index(plan, data, steps, path)
        tensors.update(decoded)
        parts.append(IndexedPlan(plan, idx))
    rest = [e for e in entries if not stays_compressed(e)]
    if rest:
        tensors.update(cuda_ext.decode_plan(plans.build(rest, path, start, end), data, path))
    floats = {e.name for e in kept}
    return CompressedLayer(index, data, parts), {k: v for k, v in tensors.items() if k not in floats}


@dataclass
class Unit:
    """The compressed tensors of one module (a Linear's weight, bias): decoded together, just before
    the module runs, into one scratch buffer of the ring."""

    module: torch.nn.Module
    leaves: list[tuple[str, int, tuple, torch.dtype]]   # attribute, byte offset in a scratch buffer, shape, dtype
    plan: plans.Plan
    layer: CompressedLayer
    index: cuda_ext.DeviceIndex
    nbytes: int


def units_of(model: torch.nn.Module, layers: list[CompressedLayer]) -> list[Unit]:
    """One unit per module that owns compressed tensors, in archive order."""
    out = []
    for c in layers:
        part_of = {e.name: part for part in c.parts for e in part.plan.float_entries}
        by_module: dict[str, list] = {}
        for e in sorted(c.float_entries, key=lambda e: e.streams["exp"]["offset"]):
            by_module.setdefault(_module(e), []).append(e)
        for path, entries in by_module.items():                 # one part a module (piece_steps)
            leaves, size = [], 0
            for e in entries:
                leaves.append((e.name.rpartition(".")[2], size, tuple(e.shape), e.torch_dtype))
                size += _scratch_bytes(e)
            part = part_of[entries[0].name]
            try:
                module = model.get_submodule(path)
            except AttributeError:             # not this architecture's (decoded mode's assemble says the same)
                raise LoadFailed(f"tensors unknown to {type(model).__name__}: {[e.name for e in entries][:5]}") from None
            out.append(Unit(module, leaves, plans.select(part.plan, [e.name for e in entries]),
                            c, part.index, size))
    return out


def attach(model: torch.nn.Module, layers: list[CompressedLayer], device: torch.device, scratch: int,
           on_forward: Callable[[float], None] | None = None) -> "UnitSchedule":
    """A schedule for `model`'s compressed layers (not yet installed: see UnitSchedule)."""
    return UnitSchedule(units_of(model, layers), device, scratch, on_forward)


class UnitSchedule:
    """Decodes each unit into a free scratch buffer of a ring, one unit ahead of its use.

    A buffer is free once the unit that held it has run (its forward hook records a CUDA event that
    the next decode into the buffer waits for). The unit to prefetch is the one that ran after this
    one last time (the first forward follows archive order), so any execution order works."""

    def __init__(self, units: list[Unit], device: torch.device, scratch: int = 2,
                 on_forward: Callable[[float], None] | None = None):
        self.cuda = device.type == "cuda"
        self.units, self.on_forward = units, on_forward or (lambda seconds: None)
        self.n_scratch = max(scratch, 1) if self.cuda else 1
        size = max(u.nbytes for u in units)
        self.scratch = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.n_scratch)]
        self.params = [[[torch.nn.Parameter(self._view(buf, off, shape, dtype), requires_grad=False)
                         for _, off, shape, dtype in u.leaves] for buf in self.scratch] for u in units]
        self.jobs = [[cuda_ext.Prepared(u.plan, u.layer.data, [p.data for p in self.params[k][s]], plans.MODE_INDEXED,
                                        u.index) for s in range(self.n_scratch)] for k, u in enumerate(units)]
        self.next_of = {k: (k + 1) % len(units) for k in range(len(units))}
        self.free, self.buffer_of = list(range(self.n_scratch)), [-1] * len(units)
        self.issued, self.prev, self.first = [False] * len(units), None, None
        self.entered = 0                                           # units whose forward started and has not ended
        self.seconds, self.handles = 0.0, []
        self.capturing = False                                     # this forward is being captured
        self.fresh = [False] * self.n_scratch                      # released in this forward
        if self.cuda:
            self.side = torch.cuda.Stream(device)
            self.decoded = [torch.cuda.Event() for _ in units]
            self.released = [torch.cuda.Event() for _ in range(self.n_scratch)]
            self.host_status = [[torch.zeros_like(j.status, device="cpu").pin_memory() for j in row] for row in self.jobs]
            self.groups: list[list[tuple]] = [[]]                  # each forward's decodes

    @staticmethod
    def _view(buf: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        return buf[offset:offset + n].view(dtype).view(shape)

    @property
    def layers(self) -> list[CompressedLayer]:
        return list({id(u.layer): u.layer for u in self.units}.values())

    @property
    def linears_only(self) -> bool:
        """Whether every unit is a Linear's: the modules that every step calls (the paged engine's
        Triton step reads the norms' weights without calling them, so no hook would fire there)."""
        return all(isinstance(u.module, torch.nn.Linear) for u in self.units)

    @property
    def scratch_bytes(self) -> int:
        return sum(s.nbytes for s in self.scratch)

    @property
    def compressed_bytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def placeholders(self) -> dict[str, torch.Tensor]:
        """Every compressed parameter, pointed at scratch buffer 0, for building the model (nothing on meta)."""
        return {e.name: p.data for k, u in enumerate(self.units)
                for e, p in zip(u.plan.float_entries, self.params[k][0])}

    def install(self) -> None:
        for k, u in enumerate(self.units):
            self.handles.append(u.module.register_forward_pre_hook(lambda m, a, k=k: self._before(k)))
            self.handles.append(u.module.register_forward_hook(lambda m, a, o, k=k: self._after(k)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ---- the hooks ---------------------------------------------------------------------------
    def _before(self, k: int) -> None:
        if self.first is None:
            self.first = k
        if k == self.first:
            self._forward_starts()
        self.entered += 1
        if self.prev is not None:
            self.next_of[self.prev] = k                         # learn the execution order
        self.prev = k
        if not self.issued[k]:
            self._issue(k)
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.decoded[k])
        self.issued[k] = False
        for (leaf, _, _, _), p in zip(self.units[k].leaves, self.params[k][self.buffer_of[k]]):
            self.units[k].module._parameters[leaf] = p
        nxt = self.next_of[k]
        if self.cuda and self.free and not self.issued[nxt] and nxt != self.first:
            self._issue(nxt)

    def _after(self, k: int) -> None:
        self.entered -= 1
        buf = self.buffer_of[k]
        if self.cuda:
            self.released[buf].record(torch.cuda.current_stream())
            self.fresh[buf] = True
        self.free.append(buf)

    def _recover(self) -> None:
        """The last forward raised between a module's two hooks: that module kept its scratch
        buffer (and on CUDA the unit after it may hold one, decoded ahead), so every later forward
        would fail. Every buffer is free again, and the failure was that step's alone. On CUDA a
        decode issued ahead may still be running on the side stream: the next decode into its
        buffer is queued behind it on that stream, and this forward's fork waits for the failed
        one's reads. (A module that some forwards skip keeps its decode ahead: not a failure.)"""
        self.free, self.issued = list(range(self.n_scratch)), [False] * len(self.units)
        self.prev, self.entered = None, 0

    def _issue(self, k: int) -> None:
        buf = self.free.pop(0)
        self.buffer_of[k], self.issued[k] = buf, True
        job = self.jobs[k][buf]
        if not self.cuda:
            t0 = time.perf_counter()
            job.run()
            job.check()
            self.seconds += time.perf_counter() - t0
            return
        with torch.cuda.stream(self.side):
            if self.fresh[buf]:                                   # else the forward's fork covers it
                self.side.wait_event(self.released[buf])
            if self.capturing:
                job.run()
                self.decoded[k].record(self.side)
                return
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.side)
            job.run()
            self.host_status[k][buf].copy_(job.status, non_blocking=True)
            end.record(self.side)
            self.decoded[k].record(self.side)
        self.groups[-1].append((start, end, k, buf))

    def _forward_starts(self) -> None:
        """The side stream forks from the compute stream (it waits for all queued before this
        forward); then one observation per earlier forward: its decode time, once its decodes
        completed (on the GPU, with their statuses: a decode's status is read before its buffer is
        reused, which waits for the forward that reads it). None while capturing."""
        if self.entered:
            self._recover()
        if not self.cuda:
            if self.seconds:
                self.on_forward(self.seconds)
            self.seconds = 0.0
            return
        self.capturing = torch.cuda.is_current_stream_capturing()
        self.fresh = [False] * self.n_scratch
        self.side.wait_stream(torch.cuda.current_stream())
        if self.capturing:
            return
        while self.groups and self.groups[0] and self.groups[0][-1][1].query():
            group = self.groups.pop(0)
            for _, _, k, buf in group:
                plans.raise_on_status(self.jobs[k][buf].plan, self.host_status[k][buf], self.jobs[k][buf].path)
            self.on_forward(sum(a.elapsed_time(b) for a, b, _, _ in group) / 1e3)
        self.groups = [g for g in self.groups if g] + [[]]
