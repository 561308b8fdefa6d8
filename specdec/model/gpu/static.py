"""Passes of one shape over a static KV cache: exact speculation on GPUs, and CUDA graphs.

Why this exists. Greedy speculation is exact only if the target computes the same bits for a
position whether it is decoded alone or verified among k other positions and other sequences. GPU
libraries do not promise that: cuBLAS picks its tiling and split-K by the number of rows, attention
kernels split the keys by length and batch, reductions in norms change with the row count. So on
the GPU every forward of a Llama-family model runs here, as passes of ONE shape:

- every pass holds exactly `pass_rows` token rows (T), padded with rows that write a scratch slot;
  a long prompt is fed in chunks of T rows. The matrix products therefore always have T rows, the
  library always picks the same kernel, and a row's result never depends on the others (checked on
  the GPU by tests/test_static.py, which benchmarks/cuda_check.sh runs on CUDA).
  One shape is also what a CUDA graph replays: one capture serves
  prefill, decode and verification, and a decode step is one graph launch, not ~450 kernel launches.
- keys and values live in a static cache [layers, slots + 1, kv heads, capacity, head dim]; a
  sequence owns a slot (`SlotCache`), position p at index p, so rollback is moving an integer.
- attention walks each query's LOGICAL key list: the first `prefix` indices of its slot, then up to
  MAX_TAIL explicit indices (a draft tree's ancestors), in blocks of BLOCK keys with an online
  softmax, in that order. A query at position p sees the keys of positions 0..p in the same blocks
  whether it is decoded alone, verified in a chain, or a tree node whose ancestors sit elsewhere in
  the slot, so its bits are the same. Keys past a query's list are never read.

The attention kernel is Triton on CUDA (`_attention_triton`) and a torch loop with the same blocks
elsewhere (`attention_reference`, also the oracle of the tests); each is exact against itself. Both,
with the norm and the rotary positions, are in static_kernels.py.

Supported: decoder stacks shaped like Llama (Llama 2/3, SmolLM, Mistral without sliding windows,
Qwen2): RMS norms, rotary positions, grouped-query attention, gated SiLU MLP, optional q/k/v bias.
Other models keep transformers' forward (`static_supported` says why not).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch
from transformers import PreTrainedModel

from specdec.errors import Overloaded
from specdec.kv.store import Sequence
from specdec.model.interface import LanguageModel
from specdec.model.lm import CausalLM
from specdec.model.gpu.static_kernels import _attention_triton, _rms_norm, _rotate, attention_reference, triton

MAX_TAIL = 65  # explicit key indices per query: a tree node's ancestors and itself (MAX_TREE_NODES + 1)
_FIELDS = 6  # token, position, slot, slot index, prefix, tail length; then MAX_TAIL tail indices
SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def static_supported(model: torch.nn.Module) -> str | None:
    """None if the model can run here, else why not (the caller logs it and keeps transformers')."""
    if not isinstance(model, PreTrainedModel):
        return f"not a transformers model ({type(model).__name__})"
    config = model.config
    kind = getattr(config, "model_type", "")
    if kind not in SUPPORTED_TYPES:
        return f"model type {kind!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", kind != "qwen2"):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers or not hasattr(layers[0], "self_attn") or not hasattr(layers[0].mlp, "gate_proj"):
        return "not a Llama-shaped decoder stack"
    if any(type(m).__name__ != "Linear" for layer in layers for m in (layer.self_attn.q_proj, layer.mlp.down_proj)):
        return "its linear layers are not plain torch Linear (compact --weights)"
    return None


def _joined(*biases: torch.Tensor | None) -> torch.Tensor | None:
    """The biases of layers computed as one product, concatenated; None where the layers have none."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("layers computed as one product must all have a bias or none")
    return torch.cat(biases)


class _Pool:
    """Free slot numbers; a slot comes back when its SlotCache is garbage (weakref.finalize)."""

    def __init__(self, slots: int):
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise Overloaded("every KV slot of the GPU cache is in use (raise --static-slots)")
            return self._free.pop()

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class SlotCache:
    """A sequence's keys and values: slot `slot` of the static cache, its first `length` indices.

    Implements the part of transformers' cache interface the engines use (crop, get_seq_length), so
    `Sequence.crop_cache` rolls it back as it rolls back any cache."""

    def __init__(self, lm: StaticLM, slot: int):
        self.lm, self.slot, self.length = lm, slot, 0
        weakref.finalize(self, lm._pool.give, slot)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def keep(self, prefix: int, extra: list[int]) -> None:
        """Keeps indices [0, prefix) followed by the indices `extra` (a tree's accepted path),
        moved down so that the cache is the chain that path would have left."""
        if extra:
            self.lm._move(self.slot, list(extra), prefix)
        self.length = prefix + len(extra)


@dataclasses.dataclass
class _Row:
    slot: int
    token: int
    position: int  # rotary position
    index: int  # where its key and value go in the slot
    prefix: int  # its logical key list: indices [0, prefix) of the slot ...
    tail: tuple[int, ...] = ()  # ... then these indices


class StaticLM(CausalLM):
    """CausalLM whose forwards are passes of `pass_rows` rows over a static cache (module docstring).

    Engines use it as they use CausalLM (forward, forward_rows via specdec/forward/*); what differs is
    the cache (`SlotCache`) and that every result is row-exact. Not thread-safe, as CausalLM.
    """

    fixed_shape = True  # forward_batch and forward_tree below: passes of one shape hold any rows

    def __init__(self, model: torch.nn.Module, device: torch.device, pass_rows: int = 64, slots: int = 32,
                 max_context: int = 0, graphs: bool | None = None):
        super().__init__(model, device)
        why = static_supported(model)
        if why:
            raise ValueError(f"this model cannot run in fixed-shape passes: {why}")
        config = model.config
        self.pass_rows, self.slots = pass_rows, slots
        limit = self.max_context or 8192
        self.max_context = min(max_context, limit) if max_context else limit
        self.capacity = self.max_context + MAX_TAIL  # a tree's nodes sit past the canonical tokens
        self.max_sequences = slots
        self._pool = _Pool(slots)
        self.dtype = next(model.parameters()).dtype
        decoder = model.get_decoder()
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.embed = decoder.embed_tokens.weight
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # one product, not three
            # Every bias the model holds is applied (Llama's attention_bias / mlp_bias, Qwen2's q/k/v):
            # a layer that dropped one would serve another model, and speculation would be exact against it.
            qkv_b = _joined(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
            gate_up_b = _joined(mlp.gate_proj.bias, mlp.up_proj.bias)
            self.layers.append((layer.input_layernorm.weight, qkv, qkv_b, attn.o_proj.weight, attn.o_proj.bias,
                                layer.post_attention_layernorm.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                gate_up_b, mlp.down_proj.weight, mlp.down_proj.bias))
        self.norm = decoder.norm.weight
        self.head = model.get_output_embeddings().weight
        # cos/sin of every position, from the model's own rotary module (its scaling included)
        positions = torch.arange(self.capacity, device=device)[None]
        probe = torch.zeros(1, 1, self.head_dim, device=device, dtype=self.dtype)
        cos, sin = decoder.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [capacity, D]
        # slot `slots` is the scratch slot that padding rows write
        self.cache = torch.zeros(len(self.layers), 2, slots + 1, self.kv_heads, self.capacity, self.head_dim,
                                 dtype=self.dtype, device=device)
        T = pass_rows
        self._host = torch.zeros(T, _FIELDS + MAX_TAIL, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._inputs = torch.zeros(T, _FIELDS + MAX_TAIL, dtype=torch.int32, device=device)
        self._logits = torch.empty(T, self.head.shape[0], dtype=self.dtype, device=device)
        self._hidden = torch.empty(T, config.hidden_size, dtype=self.dtype, device=device)
        self._use_triton = device.type == "cuda" and triton is not None
        # the torch loop reads the longest key list on the host, which a graph cannot capture
        self._graphs = self._use_triton if graphs is None else graphs
        self._graph = None

    # -- the cache --------------------------------------------------------------------------------

    def new_cache(self) -> SlotCache:
        return SlotCache(self, self._pool.take())

    def full_attention_cache(self) -> bool:
        return True  # a slot holds every position (static_supported refuses sliding windows)

    @torch.inference_mode()
    def _move(self, slot: int, source: list[int], start: int) -> None:
        index = torch.tensor(source, device=self.device)
        self.cache[:, :, slot, :, start:start + len(source)] = self.cache[:, :, slot, :, index]

    # -- one pass ---------------------------------------------------------------------------------

    def _compute(self) -> None:
        """The pass over the rows in self._inputs: fills self._logits [T, V] and self._hidden [T, H]."""
        fields = self._inputs.long()
        columns = fields[:, :_FIELDS].t().contiguous()  # [6, T]: each field contiguous, for the kernel
        tokens, positions, slots, index, prefix, tail_len = columns
        tail = fields[:, _FIELDS:]  # [T, MAX_TAIL]
        T, H, G, D = self.pass_rows, self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, D]
        h = self.embed[tokens]  # [T, hidden]
        for number, (norm_in, qkv_w, qkv_b, o_w, o_b, norm_post, gate_up_w, gate_up_b, down_w, down_b) in enumerate(self.layers):
            x = _rms_norm(h, norm_in, self.eps)
            qkv = torch.nn.functional.linear(x, qkv_w, qkv_b)  # [T, (H + 2G) D]
            qk = _rotate(qkv[:, :(H + G) * D].view(T, H + G, D), cos, sin)  # queries and keys in one go
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + G) * D:].view(T, G, D)
            keys, values = self.cache[number, 0], self.cache[number, 1]  # [S + 1, G, C, D]
            keys[slots, :, index] = k
            values[slots, :, index] = v
            if self._use_triton:
                a = _attention_triton(q, keys, values, slots, prefix, tail, tail_len, self.scale)
            else:
                a = attention_reference(q, keys, values, slots, prefix, tail, tail_len, self.scale)
            h = h + torch.nn.functional.linear(a.reshape(T, H * D), o_w, o_b)
            x = _rms_norm(h, norm_post, self.eps)
            gate, up = torch.nn.functional.linear(x, gate_up_w, gate_up_b).chunk(2, dim=-1)
            h = h + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_w, down_b)
        h = _rms_norm(h, self.norm, self.eps)
        self._hidden.copy_(h)
        self._logits.copy_(torch.nn.functional.linear(h, self.head))

    def _run(self, rows: list[_Row]) -> None:
        """One pass over at most pass_rows rows; the rest of the pass is padding."""
        host = self._host
        host.zero_()
        array = host.numpy()
        array[:, 2] = self.slots  # padding rows: the scratch slot, index 0, one key
        array[:, 4] = 1
        for i, row in enumerate(rows):
            array[i, :_FIELDS] = (row.token, row.position, row.slot, row.index, row.prefix, len(row.tail))
            if row.tail:
                array[i, _FIELDS:_FIELDS + len(row.tail)] = row.tail
        # a blocking copy: the next pass rewrites `host`, which an asynchronous copy might still read
        self._inputs.copy_(host)
        if not self._graphs:
            self._compute()
            return
        with torch.cuda.device(self.device):  # a draft on cuda:1 captures and replays on its own GPU
            if self._graph is None:
                self._record()
            self._graph.replay()

    def _record(self) -> None:
        """Records the pass once (after warm-up runs that compile the kernels), on a side stream."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._compute()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._compute()
        self._graph = graph

    @torch.inference_mode()
    def run_rows(self, rows: list[_Row], wanted: list[int], host: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs `rows` in passes of pass_rows; returns the float32 logits of the rows `wanted` [W, V]
        (on the CPU, or with `host` False where they were computed) and, while features are being
        captured, every row's final hidden state [R, H]."""
        logits, hidden = [], []
        capture = self._captured is not None
        T = self.pass_rows
        for start in range(0, len(rows), T):
            self._run(rows[start:start + T])
            here = [i - start for i in wanted if start <= i < start + T]
            if here:
                logits.append(self._logits.index_select(0, torch.tensor(here, device=self.device)).float())
            if capture:
                hidden.append(self._hidden[:min(T, len(rows) - start)].clone())
        out = torch.cat(logits) if logits else torch.empty(0, self.vocab_size, device=self.device)
        return (out.cpu() if host else out), (torch.cat(hidden) if hidden else None)

    # -- what the engines call --------------------------------------------------------------------

    def _chain_rows(self, seq: Sequence, extra: list[int]) -> list[_Row]:
        """The pending tokens as a chain: position p at index p, seeing indices [0, p]."""
        if seq.cache is None:
            seq.cache = self.new_cache()
            seq.cached = 0
        pending = seq.tokens[seq.cached:] + list(extra)
        if seq.cached + len(pending) > self.max_context:
            raise ValueError(f"{seq.cached + len(pending)} positions exceed the static cache's {self.max_context}")
        slot = seq.cache.slot
        return [_Row(slot, t, p, p, p + 1) for p, t in enumerate(pending, start=seq.cached)]

    def forward(self, seq: Sequence, extra: list[int] | tuple[int, ...] = (), keep: int = 1) -> torch.Tensor:
        """As CausalLM.forward: feeds seq.tokens[seq.cached:] + extra; returns [keep, V] float32."""
        rows = self._chain_rows(seq, list(extra))
        if not rows:
            raise ValueError("nothing to feed: the store keeps at least one pending token")
        if keep > len(rows):
            raise ValueError(f"cannot keep {keep} logits from {len(rows)} new positions")
        logits, hidden = self.run_rows(rows, list(range(len(rows) - keep, len(rows))))
        self._finish(seq, len(rows))
        if hidden is not None:
            self._captured.append(hidden[None])  # [1, n, H], as the norm's hook would see it
        return self.to_target_logits(logits)

    def forward_batch(self, seqs: list[Sequence], extras: list[list[int]], keeps: list[int],
                      trees: list[list[int] | None] | None = None, on_device: bool = False) -> tuple[list[torch.Tensor], StaticBatch]:
        """As specdec.forward.batching.forward_batch: every row's pending tokens (a chain or a tree)
        in shared passes; returns each row's last keeps[i] logits (left on the GPU with
        `on_device`) and the state to write back."""
        rows, spans, pending_counts = [], [], []
        for i, (seq, extra, keep) in enumerate(zip(seqs, extras, keeps)):
            tree = trees[i] if trees is not None else None
            if tree is not None:
                these = self._tree_rows(seq, list(extra), tree)
            else:
                these = self._chain_rows(seq, list(extra))
            if not these or keep > len(these):
                raise ValueError(f"cannot keep {keep} logits from {len(these)} new positions")
            spans.append((len(rows) + len(these) - keep, len(rows) + len(these)))
            pending_counts.append(len(these))
            rows.extend(these)
        wanted = [i for a, b in spans for i in range(a, b)]
        logits, hidden = self.run_rows(rows, wanted, host=not on_device)
        if hidden is not None:  # [B, N, H] as the norm's hook sees a padded batch
            batch = hidden.new_zeros(len(seqs), max(pending_counts), hidden.shape[-1])
            at = 0
            for i, n in enumerate(pending_counts):
                batch[i, :n] = hidden[at:at + n]
                at += n
            self._captured.append(batch)
        out, at = [], 0
        for seq, (a, b), n in zip(seqs, spans, pending_counts):
            out.append(self.to_target_logits(logits[at:at + (b - a)]))
            at += b - a
            self._finish(seq, n)
        return out, StaticBatch(self)

    def forward_tree(self, seq: Sequence, tree_tokens: list[int], parents: list[int]) -> torch.Tensor:
        """As specdec.forward.tree.forward_tree: root and node logits [N + 1, V]."""
        rows = self._tree_rows(seq, list(tree_tokens), parents)
        logits, hidden = self.run_rows(rows, list(range(len(rows) - len(tree_tokens) - 1, len(rows))))
        self._finish(seq, len(rows))
        if hidden is not None:  # [1, pending + N, H], as the norm's hook sees a tree pass: a feature draft's tree needs them
            self._captured.append(hidden[None])
        return self.to_target_logits(logits)

    def _tree_rows(self, seq: Sequence, tree_tokens: list[int], parents: list[int]) -> list[_Row]:
        """The pending canonical tokens as a chain, then the nodes: node i sits at index L + i, at
        position L - 1 + depth, and sees indices [0, L) then its ancestors' indices and its own."""
        rows = self._chain_rows(seq, [])
        length = len(seq.tokens)
        if length + len(tree_tokens) > self.capacity:
            raise ValueError("the tree does not fit the static cache")
        slot = seq.cache.slot
        chains: list[tuple[int, ...]] = []
        for i, (token, parent) in enumerate(zip(tree_tokens, parents)):
            chain = (chains[parent] if parent >= 0 else ()) + (length + i,)
            if len(chain) > MAX_TAIL:
                raise ValueError(f"a tree deeper than {MAX_TAIL} nodes")
            chains.append(chain)
            rows.append(_Row(slot, token, length - 1 + len(chain), length + i, length, chain))
        return rows

    def _finish(self, seq: Sequence, fed: int) -> None:
        seq.cached += fed
        seq.cache.length = seq.cached


class StaticBatch:
    """forward_batch's state: rows already hold their keys in their own slots, so writing back is
    cutting each sequence to its accepted positions (and moving a tree's accepted path down)."""

    def __init__(self, lm: StaticLM):
        self.lm = lm

    def write_back(self, i: int, seq: Sequence, lm, length: int, extra: list[int] = ()) -> None:
        if length <= 0 and not extra:
            seq.cache, seq.cached = None, 0
            return
        seq.cache.keep(length, list(extra))
        seq.cached = seq.cache.length


def exact_lm(model: torch.nn.Module, device: torch.device, numerics: str = "exact", pass_rows: int = 64, slots: int = 32,
             max_context: int = 0) -> LanguageModel:
    """The LM an engine serves with: fixed-shape passes on CUDA when numerics is 'exact' and the
    model is supported, else transformers' forward (CausalLM), which on a GPU is not row-exact."""
    if device.type == "cuda" and numerics == "exact":
        why = static_supported(model)
        if why is None:
            return StaticLM(model, device, pass_rows, slots, max_context)
        import structlog
        structlog.get_logger(__name__).warning("greedy speculation is not bit-exact for this model on the GPU", reason=why)
    return CausalLM(model, device)
