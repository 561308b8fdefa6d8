"""The draft engine: keeps each sequence's tokens (and KV cache) and proposes continuations.

Two drafters share one interface: a small causal LM (`ModelDrafter`) and prompt lookup
(`NgramDrafter`). Both yield proposals one token at a time, so the servicer can stream each token
the moment it exists. `build_engine` picks and loads the drafter a DraftConfig names. No gRPC here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from draft_service.config import DraftConfig
from specdec.limits import MAX_DRAFT_TOKENS
from draft_service.drafters.ngram import MatchCalibration, NgramIndex
from draft_service.tree import TreeBuilder, TreeDraft, TreeSettings, check_tree_settings
from specdec.forward.batching import batchable, forward_batch
from specdec.serving.batcher import Requeue
from specdec.errors import InvalidArgument
from specdec.model.features import FeatureRows
from specdec.kv.store import Sequence, SequenceStore
from specdec.model import gemm
from specdec.model.lm import CausalLM, feed
from specdec.spec.sampling import truncated_probs

# Catch-up tokens an n-gram Propose may bring and still be answered on the event loop (answers_inline):
# a step's catch-up is the accepted tokens plus one (at most MAX_DRAFT_TOKENS + 1); a few hundred
# tokens index in well under a millisecond.
INLINE_APPEND = 256


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One drafted token and the distribution it was drawn from (None: drawn with p = 1)."""

    token: int
    dist_ids: list[int] | None
    dist_probs: list[float] | None
    cumulative_prob: float
    compute_seconds: float


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    max_tokens: int
    min_cumulative_prob: float
    temperature: float
    seed: int


class ModelDrafter:
    """Drafts with a small causal LM, sampling from its top-k truncated distribution.

    Truncating to top-k is what makes the sparse p on the wire exact (see sampling.truncated_probs);
    with temperature 0 it proposes the argmax and sends no distribution. `staged`: greedy drafts
    are themselves speculated by an n-gram index (draft_service/drafters/staged.py), the same tokens in
    fewer draft forwards.
    """

    kind = "model"

    def __init__(self, lm: CausalLM, top_k: int = 32, staged: bool = False):
        self.lm = lm
        self.top_k = top_k
        self.vocab_size = lm.vocab_size
        self.staged = staged
        self.forwards = 0  # draft-model forward passes so far (staged drafting saves some)

    def draft(self, seq: Sequence, settings: DraftSettings, start: float) -> Iterator[Proposal]:
        if self.staged and settings.temperature == 0:
            from draft_service.drafters.staged import draft_staged

            return draft_staged(self, seq, settings, start)
        return self._draft(seq, settings, start)

    def _draft(self, seq: Sequence, settings: DraftSettings, start: float) -> Iterator[Proposal]:
        state = self.begin(settings, start)
        self.forwards += 1
        logits = self.lm.forward(seq, keep=1)[0]  # [V]; feeds the catch-up tokens
        while (proposal := self.choose(logits, state)) is not None:
            seq.tokens.append(proposal.token)
            yield proposal
            if state.done:
                return
            self.forwards += 1
            logits = self.lm.forward(seq, keep=1)[0]

    def begin(self, settings: DraftSettings, start: float) -> ChainState:
        return ChainState(settings, start, torch.Generator().manual_seed(settings.seed))

    def choose(self, logits: torch.Tensor, state: ChainState) -> Proposal | None:
        """The next draft token from the logits [V] that follow the chain so far; None: stop here.

        Split from the forward so the batched path (draft_service/batcher.py) draws exactly what
        the one-sequence path draws: the same generator, the same order of draws.

        The cumulative-probability stop must not look at the token it would cut when sampling:
        dropping a drawn token x because q(x) was small makes the proposals follow q restricted to
        the tokens that pass, while the target is told they follow q, and the output is no longer
        the target's distribution. So a sampled token is always kept, and the chain stops AFTER
        the token that takes the product under the threshold (`state.done`): whether token i+1 is
        drawn depends only on tokens 1..i. Greedy tokens are no draw, so there the token that
        would fall under the threshold is left out, which is cheaper and harmless.
        """
        settings = state.settings
        if state.done:
            return None
        if settings.temperature == 0:
            token = int(logits.argmax())
            prob = float(torch.softmax(logits.float(), dim=-1)[token])  # the draft's confidence
            if state.cumulative * prob < settings.min_cumulative_prob:
                state.stopped = True  # not confident enough: verifying it would likely waste the slot
                return None
            ids = probs = None
        else:
            top_ids, top_probs = truncated_probs(logits, settings.temperature, self.top_k)
            choice = int(torch.multinomial(top_probs, 1, generator=state.generator))
            token, prob = int(top_ids[choice]), float(top_probs[choice])
            ids, probs = top_ids.tolist(), top_probs.tolist()
        state.cumulative *= prob
        state.drafted += 1
        if state.cumulative < settings.min_cumulative_prob:
            state.stopped = True  # decided from tokens 1..i, before token i+1 is drawn
        return Proposal(token, ids, probs, state.cumulative, time.perf_counter() - state.start)


@dataclasses.dataclass
class ChainState:
    """One Propose call's drafting state between forwards."""

    settings: DraftSettings
    start: float
    generator: torch.Generator
    cumulative: float = 1.0
    drafted: int = 0
    stopped: bool = False  # the cumulative-probability stop fired (see ModelDrafter.choose)

    @property
    def done(self) -> bool:
        """No further token is to be drawn: the stop fired or the proposal is full."""
        return self.stopped or self.drafted >= self.settings.max_tokens


class NgramDrafter:
    """Prompt lookup over the sequence's own tokens (prompt and output). p is one-hot.

    Each sequence keeps an incremental NgramIndex in its `cache` slot: the store's rollback crops it
    like a KV cache (Sequence.crop_cache), and a step only indexes the tokens that arrived since the
    last one, so drafting costs microseconds however long the sequence grows.
    """

    kind = "ngram"
    vocab_size = 0

    def __init__(self, max_n: int = 4, min_n: int = 1):
        NgramIndex(max_n, min_n)  # validates the pair at start-up rather than on the first call
        self.max_n, self.min_n = max_n, min_n
        self.calibration = MatchCalibration(max_n)

    def draft(self, seq: Sequence, settings: DraftSettings, start: float) -> Iterator[Proposal]:
        """Each token's cumulative_prob is the calibrated chance that it and every token before it
        are right (MatchCalibration), which the coordinator weighs against the target's cost of
        checking them. The distribution sent for sampling stays one-hot: the token is certain."""
        if not isinstance(seq.cache, NgramIndex) or len(seq.cache) != seq.cached:
            seq.cache, seq.cached = NgramIndex(self.max_n, self.min_n), 0  # first call, or a state we cannot trust
        index = seq.cache
        self._learn(index, seq.tokens)
        index.extend(seq.tokens[seq.cached:])
        seq.cached = len(seq.tokens)  # drafted tokens below are not indexed; a rejection crops nothing
        proposal, n = index.propose(settings.max_tokens)
        if proposal:
            index.last = (len(seq.tokens), seq.tokens[-1], proposal, n)
        for token, cumulative in zip(proposal, self.calibration.survival(n, len(proposal))):
            seq.tokens.append(token)
            one_hot = ([token], [1.0]) if settings.temperature > 0 else (None, None)
            yield Proposal(token, *one_hot, cumulative, time.perf_counter() - start)

    def _learn(self, index: NgramIndex, tokens: list[int]) -> None:
        """Scores the last proposal against the canonical tokens that have replaced it (the store
        has cropped the drafted ones and appended the verdict). Skipped when the sequence has not
        moved past it yet, or was rewound before it."""
        if index.last is None:
            return
        position, before, proposal, n = index.last
        if len(tokens) > position and tokens[position - 1] == before:
            self.calibration.observe(n, proposal, tokens[position:])
            index.last = None


def load_pruned_drafter(folder, device: str = "auto", dtype: str = "auto", top_k: int = 32) -> ModelDrafter:
    """A ModelDrafter over a distilled pruned-vocabulary draft (specdec/model/pruned.py).

    Its logits come back in the target's vocabulary with -inf outside the kept ids, so greedy
    drafting and top-k sampling are the plain ModelDrafter's, and tokens off the head get p = 0.
    """
    from specdec.model.loading import resolve_device, resolve_dtype
    from specdec.model.pruned import PrunedCausalLM, load_draft

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, meta = load_draft(folder, dev, dt)
    return ModelDrafter(PrunedCausalLM(model, dev, meta.get("eos_token_ids")), top_k)


class DraftEngine:
    """Not thread-safe: the servicer runs each step on one worker thread, or on the event loop
    while that worker has nothing to do (answers_inline)."""

    def __init__(self, drafter: ModelDrafter | NgramDrafter, max_sequences: int = 256, idle_timeout_s: float = 600.0,
                 max_prefill_tokens: int = 0):
        """`max_prefill_tokens`: most pending tokens a row feeds in one batched pass (0: all), as the
        target's chunked prefill (forward_rows)."""
        self.drafter = drafter
        self.max_prefill_tokens = max_prefill_tokens
        self.store = SequenceStore(max_sequences, idle_timeout_s)
        self._batchable: bool | None = None  # known after the first look at the model's cache layout

    def propose(self, sequence_id: str, known_len: int, append: list[int], settings: DraftSettings,
                features: FeatureRows | None = None) -> Iterator[Proposal]:
        """Syncs the sequence (rollback + catch-up), then yields proposals lazily.

        Validation and the sync happen eagerly, before the first token is asked for, so bad input
        fails the call at once. Drafted tokens are appended to the sequence's own token list; the
        next call's known_len crops the ones the target rejected.
        """
        start = time.perf_counter()
        seq = self.open(sequence_id, known_len, append, settings, features)
        if settings.max_tokens == 0:
            return iter(())
        return self.drafter.draft(seq, settings, start)

    def answers_inline(self, append: int) -> bool:
        """Whether a Propose is cheaper to answer on the event loop than to hand to the worker: an
        n-gram draft whose catch-up is short (indexing costs a few microseconds a token). A thread
        hop each way cost more than the n-gram's whole draft: through the three services on the
        grounded prompts its exchange took 1.17 ms wall for 0.15 ms of drafting, 0.79 ms inline.
        A prompt (or a lost sequence re-sent whole) still goes to the worker, so a 100k-token
        index build never stalls the other calls."""
        return type(self.drafter) is NgramDrafter and append <= INLINE_APPEND

    def batches(self, settings: DraftSettings) -> bool:
        """Whether this chain can draft in forwards shared with other sequences (draft_service/
        batcher.py): a plain model draft (not another vocabulary's, not staged greedy, which
        speculates its own forwards) over a model whose caches line up position by position."""
        if self._batchable is None:
            self._batchable = type(self.drafter) is ModelDrafter and batchable(self.drafter.lm)
        return self._batchable and not (self.drafter.staged and settings.temperature == 0)

    def open(self, sequence_id: str, known_len: int, append: list[int], settings: DraftSettings,
             features: FeatureRows | None = None) -> Sequence:
        """Validates a Propose and syncs its sequence (rollback + catch-up, and for a feature draft
        the target features that came with it; other drafters ignore features)."""
        if not 0 <= settings.max_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidArgument("max_tokens", f"must be in [0, {MAX_DRAFT_TOKENS}], got {settings.max_tokens}")
        if settings.temperature < 0:
            raise InvalidArgument("temperature", f"must be >= 0, got {settings.temperature}")
        vocab = self.drafter.vocab_size
        if vocab and any(not 0 <= t < vocab for t in append):
            raise InvalidArgument("append_tokens", f"token ids must be in the draft's vocabulary [0, {vocab})")
        seq = self.store.sync(sequence_id, known_len, append)
        receive = getattr(self.drafter, "receive", None)
        if receive is not None:
            receive(seq, features)
        return seq

    def forward_rows(self, seqs: list[Sequence]) -> list[torch.Tensor | Requeue]:
        """The next-token logits [V] of each sequence, feeding all their pending tokens in ONE pass.

        A sequence with more than max_prefill_tokens pending (a long prompt's catch-up) feeds that
        many this pass, one such row a pass, and comes back as Requeue: the batcher runs the other
        streams' steps before its next chunk (specdec/serving/batcher.py)."""
        lm = self.drafter.lm
        out: list[torch.Tensor | Requeue | None] = [None] * len(seqs)
        rows, budget = [], self.max_prefill_tokens
        for i, seq in enumerate(seqs):
            if self.max_prefill_tokens and len(seq.tokens) - seq.cached > self.max_prefill_tokens:
                if budget:
                    feed(lm, seq, budget)
                    budget = 0
                out[i] = Requeue(seq)
            else:
                rows.append(i)
        self.drafter.forwards += len(rows)
        if len(rows) == 1:
            out[rows[0]] = lm.forward(seqs[rows[0]], keep=1)[0]  # alone: no batch buffer to gather and copy back
        elif rows:
            logits, state = forward_batch(lm, [seqs[i] for i in rows], [[] for _ in rows], [1] * len(rows))
            for row, i in enumerate(rows):
                state.write_back(row, seqs[i], lm, len(seqs[i].tokens))
                out[i] = logits[row][0]
        return out

    def propose_tree(self, sequence_id: str, known_len: int, append: list[int], settings: TreeSettings) -> TreeDraft:
        """Syncs the sequence, then drafts a tree (draft_service/tree.py). The sequence keeps only
        its canonical tokens afterwards: the next call's known_len is len(canonical) at this call.

        A drafter that cannot branch (n-gram, another vocabulary) sends its chain as a one-branch tree.
        """
        start = time.perf_counter()
        check_tree_settings(settings)
        vocab = self.drafter.vocab_size
        if vocab and any(not 0 <= t < vocab for t in append):
            raise InvalidArgument("append_tokens", f"token ids must be in the draft's vocabulary [0, {vocab})")
        seq = self.store.sync(sequence_id, known_len, append)
        if type(self.drafter) is ModelDrafter:
            tree = TreeBuilder(self.drafter.lm, seq, settings, self.drafter.top_k).build()
        else:
            # The drafted tokens stay in the sequence until the next call's known_len crops them,
            # exactly as after a chain the target rejected.
            chain = DraftSettings(min(settings.budget, settings.max_depth), 0.0, settings.temperature, settings.seed)
            proposals = list(self.drafter.draft(seq, chain, start))
            dists = [(p.dist_ids, p.dist_probs) for p in proposals if p.dist_ids is not None]
            child_dists = dists + [([], [])] if len(dists) == len(proposals) and dists else []
            tree = TreeDraft(list(range(-1, len(proposals) - 1)), [p.token for p in proposals], child_dists)
        return dataclasses.replace(tree, compute_seconds=time.perf_counter() - start)

    def release(self, sequence_id: str) -> bool:
        return self.store.release(sequence_id)

    def warm_up(self) -> None:
        features = None
        if getattr(self.drafter, "needs_features", False):  # without features a feature draft drafts nothing
            features = FeatureRows(0, torch.zeros(5, self.drafter.dim))
        for _ in self.propose("__warmup__", 0, [0, 1, 2, 3, 0, 1], DraftSettings(2, 0.0, 0.0, 0), features):
            pass
        self.store.release("__warmup__", retire=False)  # warm-ups may run again


# --- building the engine a DraftConfig names ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DrafterInfo:
    """What the service says it hosts (GetInfo's ModelInfo, field for field)."""

    model: str
    drafter: str  # "model", "ngram" or "feature"
    vocab_size: int = 0  # 0: no vocabulary to check against the target's (n-gram, another vocabulary)
    max_context: int = 0
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    device: str = ""
    dtype: str = ""
    needs_features: bool = False
    weights: str = ""  # what the forward reads the weights as (--weights); empty without weights (n-gram)
    weight_bytes: int = 0


def _lm_info(config: DraftConfig, drafter, kind: str, **overrides) -> DrafterInfo:
    """A model draft's info, read off its `lm` (a pruned or feature draft's, which name their dtype)."""
    lm = drafter.lm
    fields = {"max_context": lm.max_context, "eos_token_ids": list(lm.eos_token_ids), "device": str(lm.device),
              "dtype": getattr(lm, "dtype_name", "")} | overrides
    return DrafterInfo(config.model, kind, drafter.vocab_size, **fields)


def _load_model_drafter(config: DraftConfig):
    """A plain causal LM draft; with --target-tokenizer, one that maps to the target's vocabulary
    (unless the two tokenizers turn out the same)."""
    if not config.model:
        raise ValueError("--drafter model needs --model (alias, hub id, folder or .gguf)")
    from specdec.model.loading import load_model

    from specdec.model.static import exact_lm

    loaded = load_model(config.model, config.device, config.dtype)
    # On a GPU the draft runs the same fixed-shape passes for their speed (one CUDA graph a step).
    lm = exact_lm(loaded.model, loaded.device, config.numerics, config.pass_rows, config.static_slots, config.static_context)
    drafter = ModelDrafter(lm, config.top_k, staged=config.staged)
    if config.target_tokenizer:
        from draft_service.drafters.other_vocab import build_cross_drafter

        drafter = build_cross_drafter(lm, loaded.tokenizer, config.model, config.target_tokenizer, config.top_k) or drafter
    drafter.source = loaded.path  # where --weights gguf finds the file's blocks
    return drafter, _lm_info(config, drafter, "model", device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."))


def build_drafter(config: DraftConfig):
    """The drafter the config names, and its info (blocking: loads weights)."""
    from specdec.model.loading import feature_draft_folder, pruned_draft_folder

    if config.drafter == "ngram":
        return NgramDrafter(config.ngram_max, config.ngram_min), DrafterInfo("ngram", "ngram")
    on_disk = config.drafter == "model" and config.model  # a pruned or feature draft's folder, or a model spec
    pruned = pruned_draft_folder(config.model) if on_disk else None
    featured = feature_draft_folder(config.model) if on_disk else None
    if featured is not None:  # drafts from the target's hidden states (specdec/model/feature_draft.py)
        from draft_service.drafters.feature import load_feature_drafter

        drafter = load_feature_drafter(featured, config.device, config.dtype, config.top_k)
        return drafter, _lm_info(config, drafter, "feature", needs_features=True)
    if pruned is not None:  # a distilled draft in its target's own vocabulary (specdec/model/pruned.py)
        drafter = load_pruned_drafter(pruned, config.device, config.dtype, config.top_k)
        drafter.staged = config.staged
        return drafter, _lm_info(config, drafter, "model")
    return _load_model_drafter(config)


def build_engine(config: DraftConfig) -> tuple[DraftEngine, DrafterInfo]:
    """The engine over the drafter the config names, warmed up, and its info (blocking: call it
    off the event loop)."""
    drafter, info = build_drafter(config)
    model = getattr(getattr(drafter, "lm", None), "model", None)
    if isinstance(model, torch.nn.Module):  # a model draft: its decode steps are 1-row GEMMs
        parameter = next(model.parameters())
        packed = gemm.apply(model, parameter.device, parameter.dtype, config.packed_gemm_rows, gemm.DEFAULT_MIN_ROWS,
                            config.weights, getattr(drafter, "source", None))
        info = dataclasses.replace(info, weights=packed.weights if packed else str(parameter.dtype).removeprefix("torch."),
                                   weight_bytes=packed.weight_bytes if packed else gemm.linear_bytes(model))
    engine = DraftEngine(drafter, min(config.max_sequences, getattr(getattr(drafter, "lm", None), "max_sequences", config.max_sequences)),
                         config.idle_timeout_s, config.max_prefill_tokens_per_pass)
    engine.warm_up()
    return engine, info
