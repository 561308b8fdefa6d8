"""The start-up check behind "numerics: exact" (specdec/forward/selfcheck.py, issue 57 item 3): one
row computed alone, first in a pass, and among rows of other lengths must be the same bits; the
target says "fast" where it is not."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.forward import selfcheck
from specdec.forward.selfcheck import row_exactness
from specdec.model.assembly import LMOptions, load_lm
from specdec.model.cpu import gemm
from specdec.model.gpu.static import StaticLM
from specdec.model.lm import CausalLM
from target_service.config import TargetConfig
from target_service.servicer import serve
from tests import tiny

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not gemm.available(CPU, torch.float32), reason="no C compiler: the kernel is not available here")


@needs_kernel
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_the_cpu_kernel_passes_its_own_check(tmp_path, weights):
    """fp32 through the packed layers and row-exact attention (padded batches), int8 through the
    one-call C stack (rows fed from their own caches): both exact, as load_lm claims."""
    target, _ = tiny.tiny_pair()
    served = load_lm(LMOptions(model=tiny.save(target, tmp_path / "target"), device="cpu", weights=weights))
    assert served.numerics == "exact" and row_exactness(served.lm) is None


def test_the_fixed_shape_passes_pass_it_on_the_cpu():
    target, _ = tiny.tiny_pair()
    assert row_exactness(StaticLM(target, CPU, pass_rows=16, slots=8)) is None


class _Jittery(CausalLM):
    """A forward whose lone row rounds otherwise than the batched one: what a BLAS that blocks its
    products by the number of rows does to the last bits."""

    def forward(self, seq, extra=(), keep=1):
        return super().forward(seq, extra, keep) * (1 + 2 ** -20)


def test_a_forward_whose_lone_row_differs_is_caught():
    target, _ = tiny.tiny_pair()
    found = row_exactness(_Jittery(target, CPU))
    assert found is not None and "first of two rows" in found


@needs_kernel
def test_the_target_says_fast_when_its_check_fails(tmp_path, monkeypatch):
    """The service claims what its check found on the device in use: GetInfo's numerics; a check that
    cannot run leaves the model served as "fast", not refused."""
    target, _ = tiny.tiny_pair()
    folder = tiny.save(target, tmp_path / "target")

    async def info(check) -> str:
        monkeypatch.setattr(selfcheck, "row_exactness", check)
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(TargetConfig(model=folder, port=0, metrics_port=-1, device="cpu"), ready=ready, signals=False))
        done, _ = await asyncio.wait({ready, task}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # it failed to start: say why
        server = ready.result()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                return (await pb_grpc.TargetServiceStub(channel).GetInfo(pb.TargetServiceGetInfoRequest(), timeout=30)).info.numerics
        finally:
            await server.stop(0)
            await asyncio.wait_for(task, 30)

    def broken(lm):
        raise RuntimeError("a model the check cannot drive")

    assert asyncio.run(info(lambda lm: None)) == "exact"
    assert asyncio.run(info(lambda lm: "a row's logits differ first of two rows")) == "fast"
    assert asyncio.run(info(broken)) == "fast"  # served, claiming nothing it was not seen to do
