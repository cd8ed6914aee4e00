"""The model runner (nano-vllm's `model_runner`): a step's sequences -> service/model/paged.py's
Context -> logits; a decode-only step on CUDA replays a captured graph.

Read me first.
* One CUDA graph per (batch bucket, width bucket): B rows padded up to a bucket of BATCH_BUCKETS,
  the block tables padded to a width of WIDTHS blocks (the keys a step gathers). Decode steps take
  buckets up to max_rows (the running batch); a step of short prompts as decode rows up to
  prompt_rows (the step's token budget, at most 512), whose graphs the idle engine captures
  last. Each graph owns its static inputs (ids, positions, slots, tables, lengths) and its
  picks; all share one memory pool and write their logits into the rows of one buffer (they
  never run at once, and a step's logits are read before the next replay). Held by each graph,
  the logits were most of the graphs' memory: a 7B's (V = 32 000) 140 graphs 1.5 GB.
* In compressed mode a bucket of 33-64 rows has two graphs: one where the fused decode-matmul
  takes every row (fixed.decode_only): decode rows, and whole prompts short enough that alone
  they are fused too (fixed.fused_prompt), so each row gets the sums it gets alone; and one for
  other prompts' rows, where the Linears decode their weights and call cuBLAS as a long prompt's
  prefill does (cuda_ext/fixedrate.py).
* Padded rows read and write only the cache's padding block and see one key, so they cannot
  touch a real row and never make an empty softmax.
* A graph is captured the first time its shape is needed, or ahead of need while the engine is
  idle (`capture_next`); `capture_seconds` adds up what captures cost.
* Steps on the CPU run eagerly: the same forward, not captured. So do steps with a prompt chunk,
  unless their chunks are short (their tokens read no more keys than a 256-token prompt's: a
  short prompt, or a prompt's tail past its prefix cache hits): then each prompt token is a
  decode row of its sequence, and the step replays the graph of its shape if one is captured.
  In compressed mode (service/model/compressed.py) the capture runs the modules' hooks once: the
  graph holds each Linear's decode on the side stream, one unit ahead, and the waits.
* On CUDA every step runs the forward's Triton kernels (`fused`, paged.Fused), captured or not;
  on the CPU the extension's twins of them (step_kernels.cpu_kernels), where built; elsewhere the
  modules'. A new process takes seconds to compile
  (or load) Triton's kernels, so they are warmed on a thread (`warm_later`) while the modules
  serve; the first step after that adopts them (`adopt`), dropping the graphs captured so far.

    ids, positions, slots [N]   tables [B, M]   lengths [B]   logits [B + P, V] float32
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model import device_wide, fixed, paged
from ..model.llama import LlamaForCausalLM
from .inputs import Chunk, Decode, StepInputs
from .logits import greedy

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WARM_AFTER_S = 1.0                 # an idle engine starts warming its kernels after this long (warm_later)
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket(n: int, sizes: tuple[int, ...], top: int) -> int:
    """The smallest size >= n (sizes capped at `top`, which is always one)."""
    return next((s for s in sizes if n <= s < top), top)


class Graph:
    """One captured decode step. Its inputs are views of one device buffer, filled by one copy from
    a pinned host buffer (two, used in turn: a step's copy may still be queued while the next
    step's inputs are written); in it, a row takes the previous launch's pick (`from_prev`, at
    `index` of it) or its host token (`ids`); out: logits, the greedy picks and their logprobs."""
    INPUTS = ("ids", "positions", "slots", "lengths", "index", "from_prev")

    def __init__(self, rows: int, width: int, pad_block: int, block_size: int, device: torch.device):
        k = len(self.INPUTS)
        self.rows = rows
        self.inputs = torch.zeros(rows * (k + width), dtype=torch.long, device=device)
        for name, view in zip(self.INPUTS, self.inputs[:k * rows].view(k, rows)):           # [b] each
            setattr(self, name, view)
        self.tables = self.inputs[k * rows:].view(rows, width)                               # [b, m]
        self.slots.fill_(pad_block * block_size)
        self.tables.fill_(pad_block)
        self.lengths.fill_(1)
        self.staging = [torch.empty_like(self.inputs, device="cpu", pin_memory=True) for _ in range(2)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None                                              # [b, V]
        self.picks: torch.Tensor | None = None                                               # [b] argmax
        self.logprobs: torch.Tensor | None = None                                            # [b]

    def context(self) -> paged.Context:
        return paged.Context(self.positions, self.slots, self.rows, self.tables, self.lengths)


@dataclass
class Launched:
    """A decode step queued on the device: its picks land in pinned memory when `done` fires."""
    rows: int
    done: torch.cuda.Event | None  # None: an eager launch, done already
    picks: torch.Tensor            # [b] int64, pinned
    logprobs: torch.Tensor         # [b] float32, pinned


class Runner(StepInputs):
    def __init__(self, model: LlamaForCausalLM, cache: paged.PagedCache, max_rows: int, max_blocks: int,
                 graphs: bool, fused=None, prompt_rows: int = 0):
        self.model, self.cache, self.max_rows, self.max_blocks = model, cache, max_rows, max_blocks
        self.prompt_rows = max(max_rows, min(prompt_rows, BATCH_BUCKETS[-1]))   # rows of a step's graph (`_shape`)
        self.fused = fused                       # cuda_ext/step_triton.py, or None: the modules (paged.py)
        self.device = cache.k.device
        self.use_graphs = graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int, bool], Graph] = {}  # (rows, width, fused)
        self.wide = fixed.decode_only_rows(model) if self.use_graphs else range(0)
        self.pool = None
        self.logits: torch.Tensor | None = None  # [prompt_rows, V] float32: every graph's logits (`_capture`)
        self.capture_seconds = 0.0
        self.turn = 0                            # which pinned buffers a step uses (they alternate)
        self.pipelined = self.use_graphs         # the scheduler may launch steps ahead (scheduler.py)
        self.last_host: list[int] = []           # an eager launch's picks
        self.warmed = threading.Event()          # clear while a `warm_later` warm-up waits or runs
        self.warmed.set()
        self._warm = self._later = None
        self._warm_at = 0.0
        self._warming: threading.Thread | None = None     # the warm-up's thread, joined by `close`
        self.on_warmed: Callable[[], None] | None = None     # the engine's wake-up (worker.py)
        if self.use_graphs:                      # the last launch's picks, read by the next launch's graph
            self.last_picks = torch.zeros(self.prompt_rows, dtype=torch.long, device=self.device)
            pinned = {"device": "cpu", "pin_memory": True}
            self.out = [(torch.empty(max_rows, dtype=torch.long, **pinned),
                         torch.empty(max_rows, dtype=torch.float32, **pinned)) for _ in range(2)]

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    # ---- kernels warmed beside serving -----------------------------------------------------------
    def warm_later(self, kernels, warm_up: Callable[[], object], after_s: float = WARM_AFTER_S) -> None:
        """Run `warm_up` (compiling `kernels`) on a thread once a step has been served, or after
        `after_s` (the engine idles that long at most: `warm_due_in`); `adopt` then switches the
        steps to them. Not at once: Triton's compile holds the GIL for seconds, and the first
        request (served by the modules meanwhile) would wait for it (H100: 2.1 s after ready)."""
        self.warmed.clear()
        self._later, self._warm_at = (kernels, warm_up), time.perf_counter() + after_s

    def start_warming(self, now: bool = False) -> None:
        """Start the warm-up if one is waiting and due (now: a step has been served)."""
        if self._later is None or (not now and time.perf_counter() < self._warm_at):
            return
        (kernels, warm_up), self._later = self._later, None
        self._warming = threading.Thread(target=self._warm_up, args=(kernels, warm_up), name="wcodec-step-kernels",
                                         daemon=True)
        self._warming.start()

    def warm_due_in(self) -> float | None:
        """Seconds until a waiting warm-up is due; None: none waits."""
        return None if self._later is None else max(0.0, self._warm_at - time.perf_counter())

    def _warm_up(self, kernels, warm_up: Callable[[], object]) -> None:
        try:
            warm_up()
            self._warm = kernels
        except Exception:                        # the modules go on serving
            logging.getLogger("wcodec.service").warning("the step kernels did not compile", exc_info=True)
        self.warmed.set()
        if self.on_warmed is not None:
            self.on_warmed()

    def adopt(self) -> bool:
        """Between steps (none launched ahead): take kernels warmed since; the graphs go (captured
        with the modules' kernels). True if it did."""
        if self._warm is None:
            return False
        self.fused, self._warm = self._warm, None
        self.graphs.clear()
        self.pool = self.logits = None
        return True

    # ---- a step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, decodes: list[Decode], chunks: list[Chunk]) -> torch.Tensor:
        """Logits [len(decodes) + sum(c.logit_rows), V]: each decode row's, then each chunk's last
        token's (every token's where `c.every`).
        A decode-only step replays its graph (captured now if it has none). So does a step whose
        short prompts go in as decode rows (`_as_decode_rows`) when its graph is captured already:
        the eager forward's host work was most of a short prompt's first token (H200, 2026-11-28).
        Either way, a step of whole fused prompts (`_fused_prompts`) fuses as a decode-only step."""
        if self.use_graphs and decodes and not chunks and len(decodes) <= self.max_rows:
            return self._replay(decodes, True)
        as_rows, fuse = self._prompts_as_rows(chunks), self._fused_prompts(chunks)
        if self.use_graphs and as_rows:
            rows = decodes + self._prompt_rows(chunks)
            if len(rows) <= self.prompt_rows and self._shape(rows, fuse) in self.graphs:
                return self._replay(rows, fuse)[self._last_rows(decodes, chunks)]
        ids, ctx = self._eager_inputs(decodes, chunks)
        fused_step = as_rows and fuse and ids.shape[0] in self.wide
        with fixed.decode_only(ids.shape[0]) if fused_step else contextlib.nullcontext():
            return paged.forward(self.model, ids, ctx, self.cache, self.fused)

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def _shape(self, decodes: list[Decode], fuse: bool) -> tuple[int, int, bool]:
        """The key of the graph that takes `decodes` (fuse: decode rows, or `_fused_prompts`'
        rows): its (rows, width) buckets, and whether such rows are in a bucket that fuses them.
        Over max_rows rows (a step's short prompts as decode rows), buckets up to prompt_rows."""
        n = len(decodes)
        rows = bucket(n, BATCH_BUCKETS, self.max_rows if n <= self.max_rows else self.prompt_rows)
        return rows, bucket(self._width(decodes), WIDTHS, self.max_blocks), fuse and rows in self.wide

    def _graph_for(self, decodes: list[Decode], prev_index: list[int] | None, fuse: bool) -> Graph:
        """The graph of this step's shape, its inputs queued: the host's (one copy from pinned
        memory), `prev_index[i]` >= 0: row i takes that row's pick of the previous launch."""
        key = self._shape(decodes, fuse)
        rows, width, _ = key
        g = self.graphs.get(key) or self._capture(*key)
        ids, positions, slots, tables, lengths = self._decode_inputs(decodes, rows, width)
        index = torch.tensor((prev_index or []) + [-1] * (rows - len(prev_index or [])), dtype=torch.long)
        staging = g.staging[self.turn % 2]
        self.turn += 1
        torch.cat([ids, positions, slots, lengths, index.clamp(min=0), (index >= 0).long(), tables.flatten()],
                  out=staging)
        g.inputs.copy_(staging, non_blocking=True)
        return g

    def _replay(self, decodes: list[Decode], fuse: bool) -> torch.Tensor:
        g = self._graph_for(decodes, None, fuse)
        g.graph.replay()
        return g.logits[:len(decodes)]

    @torch.inference_mode()
    def launch(self, decodes: list[Decode], prev_index: list[int] | None) -> Launched:
        """A decode-only step queued without waiting for it: each row's token is its host `token`,
        or where prev_index[i] >= 0 the previous launch's pick for that row, read on the device
        (a graph replay; without graphs, an eager step that waits: the same bookkeeping, for the
        CPU's tests). `picks(...)` gives its greedy picks."""
        n = len(decodes)
        if not self.use_graphs:
            tokens = [self.last_host[i] if i >= 0 else d.token for d, i in zip(decodes, prev_index or [-1] * n)]
            logits = self.run([Decode(t, d.position, d.table) for t, d in zip(tokens, decodes)], [])
            picks, logprobs = greedy(logits)
            self.last_host = picks.tolist()
            return Launched(n, None, picks, logprobs)
        g = self._graph_for(decodes, prev_index, True)
        g.graph.replay()
        picks, logprobs = self.out[self.turn % 2]
        picks[:n].copy_(g.picks[:n], non_blocking=True)
        logprobs[:n].copy_(g.logprobs[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(n, done, picks, logprobs)

    @staticmethod
    def picks(launched: Launched) -> list[tuple[int, float]]:
        """(token, logprob) of each row of a launched step, once it is done."""
        if launched.done is not None:
            launched.done.synchronize()
        n = launched.rows
        return list(zip(launched.picks[:n].tolist(), launched.logprobs[:n].tolist()))

    def _step_of_graph(self, g: Graph, fused: bool) -> torch.Tensor:
        """The captured step: ids from the host or the last picks, the forward (fused: the Linears'
        fused op on all its rows) into the rows of the shared logits (once they are allocated), the
        greedy picks."""
        ids = torch.where(g.from_prev.bool(), self.last_picks.index_select(0, g.index), g.ids)       # [b]
        out = None if self.logits is None else self.logits[:g.rows]
        with fixed.decode_only(g.rows) if fused else contextlib.nullcontext():
            logits = paged.forward(self.model, ids, g.context(), self.cache, self.fused, out)         # [b, V]
        g.picks, g.logprobs = greedy(logits)
        self.last_picks[:g.rows].copy_(g.picks)
        return logits

    def _capture(self, rows: int, width: int, fused: bool) -> Graph:
        t0 = time.perf_counter()
        g = Graph(rows, width, self.cache.pad_block, self.block_size, self.device)
        kept = self.last_picks.clone()                                    # a launch in flight may read them next
        logits = self._step_of_graph(g, fused)                            # warm-up: lazy inits outside the graph
        self.last_picks.copy_(kept)
        if self.logits is None:                  # every graph's logits, outside their pool (each graph's own
            self.logits = logits.new_empty(self.prompt_rows, logits.shape[1])   # were a 7B's 1.5 GB)
        del logits
        with device_wide.LOCK:                   # no other capture, and no device-wide sync, beside it
            torch.cuda.synchronize(self.device)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph, pool=self.pool, stream=device_wide.capture_stream(self.device),
                                  capture_error_mode="thread_local"):
                g.logits = self._step_of_graph(g, fused)
            if self.pool is None:
                self.pool = g.graph.pool()
            torch.cuda.synchronize(self.device)
        self.graphs[(rows, width, fused)] = g
        self.capture_seconds += time.perf_counter() - t0
        return g

    def shapes(self) -> list[tuple[int, int, bool]]:
        """Every graph key a step can take, narrow and few rows first: (rows, width, False), and
        (rows, width, True) too where decode rows (and whole short prompts) are fused (`self.wide`);
        then the buckets over max_rows that only steps of short prompts take, narrow first."""
        rows = sorted({bucket(n, BATCH_BUCKETS, self.max_rows) for n in range(1, self.max_rows + 1)})
        widths = sorted({bucket(n, WIDTHS, self.max_blocks) for n in range(1, self.max_blocks + 1)})
        prompts = sorted({bucket(n, BATCH_BUCKETS, self.prompt_rows) for n in range(self.max_rows + 1, self.prompt_rows + 1)})
        return [(r, w, f) for w in widths for r in rows for f in ((False, True) if r in self.wide else (False,))] \
            + [(r, w, False) for w in widths for r in prompts]

    @functools.cached_property
    def _shapes_total(self) -> int:
        return len(self.shapes())

    @property
    def shape_count(self) -> int:
        """How many graphs the idle engine captures (0 without graphs); read every step."""
        return self._shapes_total if self.use_graphs else 0

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture one graph not captured yet (the engine calls this while idle); False: none left."""
        self.start_warming()
        if not self.use_graphs or not self.warmed.is_set():      # no graphs of kernels about to go
            return False
        self.adopt()
        missing = next((s for s in self.shapes() if s not in self.graphs), None)
        if missing is None:
            return False
        if missing[0] <= self.max_rows:          # a decode step's: a failure reaches the worker, which stops graphs
            self._capture(*missing)
            return True
        try:                                     # a prompt step's bucket, captured last: optional
            self._capture(*missing)
        except Exception as e:                   # out of memory, say: such steps stay eager, decode steps replay
            # the exception's text, not the exception: a handler that keeps its records (pytest's) would
            # keep the traceback's frames, and with them the failed graph's tensors, alive
            logging.getLogger("wcodec.service").warning("capturing a %d-row prompt step failed (%s); prompt steps "
                                                        "over %d rows run eagerly", missing[0],
                                                        f"{type(e).__name__}: {e}", self.max_rows)
            self.prompt_rows = self.max_rows
            self.__dict__.pop("_shapes_total", None)   # shape_count without the prompt buckets
        return True

    def close(self) -> None:
        """Drop the graphs, their pool, the cache and the last picks (an unload), after the warm-up:
        one still compiling holds its toy tensors on the device and this runner, so the unload waits
        for it (seconds at most, in a fresh process; engine.close runs off the event loop), and one
        not started never starts. The cuBLAS workspace of the capture stream (torch.cuda.graph's one
        side stream) stays, as every stream's does: allocated by the process's first capture, reused
        by every later one."""
        self._later = None
        if self._warming is not None:
            self._warming.join()
            self._warming = None
        self._warm = self.on_warmed = None
        self.graphs.clear()
        self.pool = self.logits = None
        self.cache.k = self.cache.v = None
        self.last_picks = None
