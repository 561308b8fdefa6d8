"""What every bench shares: one prompt's timed result (Sample), the runners that make one
(transformers' generate, specdec's loop in process, a coordinator over gRPC), the tiny random
models of --quick, and the machine a run measured on.

Apart from bench.py so that its sibling benches (bench_overlap.py, bench_llamacpp.py) use them
without importing bench.py, which imports them in turn (no import cycle among the tools).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import pathlib
import time
import uuid

import torch

from specdec_tools.workload import greedy_generate


@dataclasses.dataclass
class Sample:
    tokens: list[int]
    seconds: float
    ttft: float = 0.0
    stats: dict | None = None


# --- models ---------------------------------------------------------------------------------------

def quick_models(folder: pathlib.Path, noise: float = 0.08) -> tuple[str, str]:
    """Tiny random target and draft (byte tokenizer with a chat template) saved as model folders;
    the draft is the target plus relative noise `noise`."""
    from specdec_tools.tinymodels import save, tiny_pair

    target, draft = tiny_pair(seed=0, noise=noise)
    return save(target, folder / "target"), save(draft, folder / "draft")


# --- runners --------------------------------------------------------------------------------------

def hf_runner(model, max_new: int, eos: list[int], **generate_kwargs):
    def run(prompt: list[int]) -> Sample:
        start = time.perf_counter()
        tokens = greedy_generate(model, prompt, max_new, eos, **generate_kwargs)
        return Sample(tokens, time.perf_counter() - start)

    return run


def local_runner(loop, max_new: int, eos: list[int], draft_length: int, adaptive: bool, tree=None):
    from coordinator.protocol import GenerationSpec, Stats
    from specdec.maths.sampling import SamplingConfig

    def run(prompt: list[int]) -> Sample:
        spec = GenerationSpec(request_id=uuid.uuid4().hex[:12], prompt_ids=list(prompt), max_new_tokens=max_new,
                              sampling=SamplingConfig(), draft_length=draft_length, adaptive=adaptive,
                              eos_token_ids=frozenset(eos), tree=tree, answered_whole=True)  # as the gRPC rows' unary Generate
        stats = Stats()

        async def collect() -> list[int]:
            out: list[int] = []
            async with contextlib.aclosing(loop.run(spec, stats)) as steps:
                async for step in steps:
                    out.extend(step.tokens)
            return out

        start = time.perf_counter()
        tokens = asyncio.run(collect())
        seconds = time.perf_counter() - start
        return Sample(tokens, seconds, stats.time_to_first_token_seconds, stats_dict(stats))

    return run


def grpc_runner(address: str, max_new: int, draft_length: int, adaptive: bool):
    import grpc

    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.CoordinatorServiceStub(channel)

    def run(prompt: list[int]) -> Sample:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=max_new,
                                     speculation=pb.SpeculationParams(draft_length=draft_length, adaptive=adaptive))
        start = time.perf_counter()
        response = stub.Generate(request, timeout=600)
        seconds = time.perf_counter() - start
        return Sample(list(response.token_ids), seconds, response.stats.time_to_first_token_seconds, stats_dict(response.stats))

    return run


def stats_dict(s) -> dict:
    return {
        "steps": s.steps, "draft_steps": s.draft_steps, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
        "accepted_per_position": list(s.accepted_per_position), "draft_seconds": s.draft_seconds,
        "verify_seconds": s.verify_seconds, "wire_seconds": s.wire_seconds, "total_seconds": s.total_seconds,
        "wire_bytes": s.wire_bytes, "completion_tokens": s.completion_tokens,
        "runahead_steps": s.runahead_steps, "runahead_hits": s.runahead_hits, "runahead_tokens": s.runahead_tokens,
        "runahead_used_tokens": s.runahead_used_tokens, "first_step_tokens": s.first_step_tokens,
    }


def machine() -> dict:
    import platform

    import transformers

    cpu = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "platform": platform.platform()}
