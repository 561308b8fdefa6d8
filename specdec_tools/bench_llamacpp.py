"""llama.cpp as an optional peer of `specdec bench`: plain greedy decoding and its prompt lookup decoding.

Why: users who run on CPU compare specdec with llama.cpp, the usual CPU runtime, on the very GGUF file the
target was converted from. These rows put that comparison in the bench, on the same prompts (as token ids,
not re-tokenised text) and the same number of threads, so its tokens/s stand beside specdec's honestly.

What a row measures: one cold prompt per run (the KV cache is emptied first, so prompt processing is part of
`seconds`; `ttft` is the time until the first new token), then greedy decoding up to max_new tokens or the
first end-of-sequence token, which is kept in the output as transformers' generate() keeps it, so the tokens
compare one to one with the bench's baseline. llama.cpp runs the quantised weights (Q4_1 for the default
target) while the baseline runs their dequantised fp32 values, so its greedy tokens may part from the
baseline's after a near tie: the bench reports that agreement rather than assuming it. Prompt lookup is
lossless only up to llama.cpp's numerics too: its logits for a position depend on how many tokens share the
batch (verification evaluates 1 + drafted tokens at once, plain decoding one; up to ~0.9 logits apart on
SmolLM2 Q4_1), so at a near tie its tokens may part from plain decoding's.

The binding is llama-cpp-python (`pip install 'llama-cpp-python>=0.3'`, or specdec's `llamacpp` extra); it is
optional, and without it the rows are skipped with unavailable_reason()'s message. Decoding goes through
Llama.generate(), the token-id level loop under create_completion(): it takes the prompt as ids without
adding BOS, yields token ids (not text), and is the loop that runs the draft model, so prompt lookup
(LlamaPromptLookupDecoding passed as draft_model) is measured through the same path as plain decoding.

Building it: a native build (`CMAKE_ARGS="-DGGML_NATIVE=ON"`) with GCC 12 on a CPU with AMX (Sapphire Rapids
and later) crashed in llama.cpp's AMX matmul (a tile configuration left half uninitialised); building with
CFLAGS and CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" keeps the rest native and works.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from typing import Callable

INSTALL_HINT = "pip install 'llama-cpp-python>=0.3' (or specdec's extra: pip install 'specdec[llamacpp]')"


def unavailable_reason() -> str | None:
    """None when llama_cpp imports; else one line saying why not and how to install it.

    Importing (not just finding the package) also loads its compiled library, which is what can fail."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama.cpp rows skipped: llama-cpp-python is not installed; {INSTALL_HINT}"
    except (OSError, RuntimeError) as e:  # installed, but its shared library does not load
        return f"llama.cpp rows skipped: llama-cpp-python does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__}); {INSTALL_HINT}"
    return None


def gguf_for(target_spec: str, cache_dir: str | None = None) -> pathlib.Path | None:
    """The GGUF file a target spec comes from: the spec itself when it is a .gguf file, an alias's file
    (specdec.model.loading's aliases all ship as GGUF), else None: a saved folder or a hub model has no
    GGUF for llama.cpp to run, and its rows are skipped."""
    from specdec.model.loading import _ALIASES, default_cache_dir

    if target_spec in _ALIASES:
        cache = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        try:
            return _ALIASES[target_spec](cache)
        except FileNotFoundError:  # the alias's package is not installed: the target does not load either
            return None
    path = pathlib.Path(target_spec).expanduser()
    return path.resolve() if target_spec.lower().endswith(".gguf") and path.is_file() else None


def skip_reason(target_spec: str, cache_dir: str | None = None) -> str | None:
    """Why the bench cannot run llama.cpp rows for this target (one line), or None when it can."""
    reason = unavailable_reason()
    if reason is None and gguf_for(target_spec, cache_dir) is None:
        reason = f"llama.cpp rows skipped: target {target_spec!r} is not a GGUF file or an alias of one"
    return reason


def llamacpp_runner(gguf: pathlib.Path, max_new: int, eos: list[int], prompt_lookup: int = 0, threads: int = 2,
                    n_ctx: int = 2048, sample: Callable | None = None) -> Callable[[list[int]], object]:
    """run(prompt_ids) -> Sample(tokens, seconds, ttft) decoding greedily with llama.cpp on `gguf`.

    prompt_lookup > 0 drafts that many tokens a step by prompt lookup (n-grams of up to 2 tokens, as
    transformers' prompt_lookup_num_tokens does): the plain runner's tokens but at llama.cpp's near ties
    (module docstring). The model loads once here, not per prompt. `sample` builds the result (default:
    specdec_tools.bench_runners.Sample). n_ctx bounds prompt + max_new; with prompt lookup llama-cpp-python keeps n_ctx x vocabulary
    float32 logits (about 400 MB for SmolLM2 at 2048), so a much larger default would cost memory for nothing.
    """
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if sample is None:
        from specdec_tools.bench_runners import Sample as sample
    draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup > 0 else None
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                draft_model=draft, verbose=False)
    stop = frozenset(eos)

    def run(prompt: list[int]) -> object:
        if not prompt or len(prompt) + max_new > llm.n_ctx():
            raise ValueError(f"llama.cpp runner: a prompt of {len(prompt)} tokens plus {max_new} new ones does not fit n_ctx={llm.n_ctx()}")
        tokens: list[int] = []
        ttft = 0.0
        start = time.perf_counter()
        # reset() first: generate() would otherwise reuse the previous run's cache for a shared prefix
        # (the chat template's system turn), and every run is meant to process its whole prompt.
        llm.reset()
        # temp 0 is llama.cpp's greedy sampler. Every penalty is passed as off: a repeat penalty changes greedy
        # tokens, and earlier releases of the binding defaulted it to 1.1 (0.3.36 defaults to 1.0).
        steps = llm.generate(list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                             frequency_penalty=0.0, presence_penalty=0.0, reset=True)
        with contextlib.closing(steps):
            for token in steps:
                if not tokens:
                    ttft = time.perf_counter() - start
                tokens.append(int(token))
                if token in stop or len(tokens) >= max_new:
                    break
        return sample(tokens, time.perf_counter() - start, ttft)

    run.llm = llm  # type: ignore[attr-defined]  # for callers that want to close it or read its settings
    return run
